"""The ``cuda`` backend: the shared Triton kernels on NVIDIA GPUs, top-k buffer token-major.

Probe: a CUDA device on a PyTorch that is not a ROCm build, and an importable
Triton; or CPU tensors under ``TRITON_INTERPRET=1`` (test-only, served only
when named). Launch configuration: :data:`.tuning.NVIDIA_LAUNCH`, chosen for
32-wide warps on Hopper (sized to 2 programs per SM at first use).

Example:
    >>> from mm3_backends.cuda import plugin
    >>> plugin.backend_capabilities().topk_layout
    'token_major'
"""

from __future__ import annotations

import torch

from mm3_backends.triton.plugin_factory import TritonPlatform, make_hookimpls

from .tuning import NVIDIA_LAUNCH

__all__ = ["PLATFORM", "NVIDIA_LAUNCH", "backend_capabilities", "backend_probe", "alloc_topk_buffer",
           "index_topk", "attention_forward", "index_scores", "check_contents"]

def _platform() -> tuple[str, str]:
    if torch.version.hip:
        return (f"this PyTorch is a ROCm build (torch.version.hip={torch.version.hip}); the cuda backend "
                f"is for NVIDIA GPUs: use the rocm backend"), ""
    return "", f"NVIDIA GPU (CUDA {torch.version.cuda}) with Triton"


def _native() -> bool:
    # a ROCm build never passes the probe; the check keeps NVIDIA-only PDL off there all the same
    return not torch.version.hip


PLATFORM = TritonPlatform(
    "cuda", "Triton kernels for NVIDIA GPUs (token-major top-k buffer, CUDA-graph safe decode)",
    "token_major", _platform, NVIDIA_LAUNCH, _native)

(backend_capabilities, backend_probe, alloc_topk_buffer,
 index_topk, attention_forward, index_scores, check_contents) = make_hookimpls(PLATFORM)
