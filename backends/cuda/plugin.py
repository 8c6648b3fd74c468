"""The ``cuda`` backend: the shared Triton kernels on NVIDIA GPUs, top-k buffer token-major.

Probe: a CUDA device on a PyTorch that is not a ROCm build, and an importable
Triton; or CPU tensors under ``TRITON_INTERPRET=1`` (test-only). Launch
configuration: 32-wide warps, two pipeline stages (Hopper/Ampere ``cp.async``).

Example:
    >>> from mm3_backends.cuda import plugin
    >>> plugin.backend_capabilities().topk_layout
    'token_major'
"""

from __future__ import annotations

import torch

from mm3.capabilities import Probe
from mm3_backends.triton.launch import LaunchConfig
from mm3_backends.triton.plugin_factory import TritonPluginSpec, interpreter_probe, make_hookimpls, triton_missing

__all__ = ["SPEC", "NVIDIA_LAUNCH", "backend_capabilities", "backend_probe", "alloc_topk_buffer",
           "index_topk", "attention_forward"]

NVIDIA_LAUNCH = LaunchConfig(
    target_programs=264,        # replaced by 2 x the GPU's SM count at first use
    warp_size=32,
    decode_index_warps=4,       # a [B, Di] bf16 key tile per step: 32 KB in flight per program
    topk_warps=4,
    prefill_index_rows=64,
    prefill_index_warps=8,
    decode_attention_warps=8,
    prefill_attention_rows=64,
    prefill_attention_warps=8,
    num_stages=2,
)


def _probe(device: torch.device) -> Probe:
    if device.type == "cpu":
        return interpreter_probe("cuda")
    if device.type != "cuda":
        return Probe.no(f"the cuda backend serves CUDA devices, not {device.type!r}")
    if torch.version.hip:
        return Probe.no(f"this PyTorch is a ROCm build (torch.version.hip={torch.version.hip}); "
                        f"the cuda backend is for NVIDIA GPUs: use the rocm backend")
    if not torch.cuda.is_available():
        return Probe.no("no CUDA device is visible (torch.cuda.is_available() is False)")
    missing = triton_missing()
    if missing:
        return Probe.no(missing)
    return Probe.yes(f"NVIDIA GPU (CUDA {torch.version.cuda}) with Triton")


SPEC = TritonPluginSpec(
    name="cuda",
    description="Triton kernels for NVIDIA GPUs (token-major top-k buffer, CUDA-graph safe decode)",
    topk_layout="token_major",
    probe=_probe,
    launch=NVIDIA_LAUNCH,
    priority=100,
)

(backend_capabilities, backend_probe, alloc_topk_buffer,
 index_topk, attention_forward) = make_hookimpls(SPEC)
