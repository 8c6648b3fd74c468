"""The ``rocm`` backend: the shared Triton kernels on AMD GPUs, top-k buffer head-major.

Probe: a ROCm build of PyTorch (``torch.version.hip``) with a visible GPU and
an importable Triton; or CPU tensors under ``TRITON_INTERPRET=1`` (test-only).

Test-only override: ``MM3_ROCM_ALLOW_NON_ROCM=1`` lets this plugin run on a
non-ROCm GPU (an NVIDIA one), so its code path and its head-major layout are
proven on whatever GPU CI has. Never set it in production: the launch
configuration is tuned for AMD, and AMD-only launch options are dropped there.

Example:
    >>> from mm3_backends.rocm import plugin
    >>> plugin.backend_capabilities().topk_layout
    'head_major'
"""

from __future__ import annotations

import os

import torch

from mm3.capabilities import Probe
from mm3_backends.triton.launch import LaunchConfig
from mm3_backends.triton.plugin_factory import TritonPluginSpec, interpreter_probe, make_hookimpls, triton_missing

__all__ = ["SPEC", "AMD_LAUNCH", "ALLOW_NON_ROCM_ENV", "backend_capabilities", "backend_probe",
           "alloc_topk_buffer", "index_topk", "attention_forward"]

ALLOW_NON_ROCM_ENV = "MM3_ROCM_ALLOW_NON_ROCM"
"""Test-only: set to 1 to run the rocm plugin on a non-ROCm GPU."""

AMD_LAUNCH = LaunchConfig(
    target_programs=608,        # replaced by 2 x the GPU's CU count at first use
    warp_size=64,
    # 64-wide wavefronts: half the warps of NVIDIA for the same threads per program
    decode_index_warps=2,
    topk_warps=2,
    prefill_index_rows=64,
    prefill_index_warps=4,
    decode_attention_warps=2,
    prefill_attention_rows=64,
    prefill_attention_warps=4,
    # AMD's stream pipeliner: one prefetch stage keeps LDS use low
    num_stages=1,
    platform_launch_options=(("waves_per_eu", 2),),
)


def _probe(device: torch.device) -> Probe:
    if device.type == "cpu":
        return interpreter_probe("rocm")
    if device.type != "cuda":
        return Probe.no(f"the rocm backend serves ROCm GPUs (torch device type 'cuda'), not {device.type!r}")
    override = os.environ.get(ALLOW_NON_ROCM_ENV, "") == "1"
    if not torch.version.hip and not override:
        return Probe.no(f"not a ROCm build of PyTorch (torch.version.hip is None, CUDA "
                        f"{torch.version.cuda}); the rocm backend needs an AMD GPU "
                        f"(tests only: {ALLOW_NON_ROCM_ENV}=1 runs it on this GPU anyway)")
    if not torch.cuda.is_available():
        return Probe.no("no GPU is visible (torch.cuda.is_available() is False)")
    missing = triton_missing()
    if missing:
        return Probe.no(missing)
    if not torch.version.hip:
        return Probe.yes(f"test-only override {ALLOW_NON_ROCM_ENV}=1: rocm kernels on a non-ROCm GPU")
    return Probe.yes(f"AMD GPU (HIP {torch.version.hip}) with Triton")


SPEC = TritonPluginSpec(
    name="rocm",
    description="Triton kernels for AMD GPUs (head-major top-k buffer, 64-wide wavefront launch configs)",
    topk_layout="head_major",
    probe=_probe,
    launch=AMD_LAUNCH,
    priority=100,
)

(backend_capabilities, backend_probe, alloc_topk_buffer,
 index_topk, attention_forward) = make_hookimpls(SPEC)
