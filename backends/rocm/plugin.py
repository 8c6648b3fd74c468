"""The ``rocm`` backend: the shared Triton kernels on AMD GPUs, top-k buffer head-major.

Probe: a ROCm build of PyTorch (``torch.version.hip``) with a visible GPU and
an importable Triton; or CPU tensors under ``TRITON_INTERPRET=1`` (test-only,
served only when named).

Test-only override: ``MM3_ROCM_ALLOW_NON_ROCM=1`` lets this plugin run on a
non-ROCm GPU (an NVIDIA one), so its code path and its head-major layout are
proven on whatever GPU the tests have. Never set it in production: the launch
configuration is tuned for AMD, and AMD-only launch options are dropped there.

Example:
    >>> from mm3_backends.rocm import plugin
    >>> plugin.backend_capabilities().topk_layout
    'head_major'
"""

from __future__ import annotations

import os

import torch

from mm3_backends.triton.launch import LaunchConfig
from mm3_backends.triton.plugin_factory import TritonPlatform, make_hookimpls

__all__ = ["PLATFORM", "AMD_LAUNCH", "ALLOW_NON_ROCM_ENV", "backend_capabilities", "backend_probe",
           "alloc_topk_buffer", "index_topk", "attention_forward"]

ALLOW_NON_ROCM_ENV = "MM3_ROCM_ALLOW_NON_ROCM"
"""Test-only: set to 1 to run the rocm plugin on a non-ROCm GPU."""

# 64-wide wavefronts: half the warps of the NVIDIA config give the same threads per
# program; one pipeline stage (AMD's stream pipeliner) keeps LDS use low; an MI300's
# 304 CUs want about 608 programs (resized from the device at first use).
AMD_LAUNCH = LaunchConfig(
    target_programs=608, warp_size=64, decode_index_warps=2, topk_warps=2, prefill_index_warps=4,
    prefill_attention_warps=4, num_stages=1, prefill_index_rows=64,
    prefill_attention_rows=64, index_block_n=64, decode_index_programs_factor=1, decode_index_min_blocks=4,
    # the session-1 decode attention and indexer paths: the later NVIDIA-tuned defaults
    # (persistent attention, fp16 dots for fp8 caches) have not run on AMD hardware
    decode_attention_warps=4, decode_attention_programs_factor=8, decode_attention_stages=2,
    decode_attention_flat=False, index_fp8_as_f16=False, index_nan_in_max=False, attention_block_n=64,
    pdl=False, prefill_attention=None,
    platform_launch_options=(("waves_per_eu", 2),))


def _platform() -> tuple[str, str]:
    if torch.version.hip:
        return "", f"AMD GPU (HIP {torch.version.hip}) with Triton"
    if os.environ.get(ALLOW_NON_ROCM_ENV, "") == "1":
        return "", f"test-only override {ALLOW_NON_ROCM_ENV}=1: rocm kernels on a non-ROCm GPU"
    return (f"not a ROCm build of PyTorch (torch.version.hip is None, CUDA {torch.version.cuda}); the rocm "
            f"backend needs an AMD GPU (tests only: {ALLOW_NON_ROCM_ENV}=1 runs it on this GPU anyway)"), ""


PLATFORM = TritonPlatform(
    "rocm", "Triton kernels for AMD GPUs (head-major top-k buffer, 64-wide wavefront launch configs)",
    "head_major", _platform, AMD_LAUNCH)

(backend_capabilities, backend_probe, alloc_topk_buffer,
 index_topk, attention_forward) = make_hookimpls(PLATFORM)
