"""The ``rocm`` backend: the shared Triton kernels on AMD GPUs, top-k buffer head-major.

Probe: a ROCm build of PyTorch (``torch.version.hip``) with a visible GPU and
an importable Triton; or CPU tensors under ``TRITON_INTERPRET=1`` (test-only,
served only when named).

Test-only override: ``MM3_ROCM_ALLOW_NON_ROCM=1`` lets this plugin run on a
non-ROCm GPU (an NVIDIA one), so its code path and its head-major layout are
proven on whatever GPU the tests have. Never set it in production: the launch
configuration (:data:`.tuning.AMD_LAUNCH`) is tuned for AMD, and AMD-only launch options are
dropped there.

Example:
    >>> from mm3_backends.rocm import plugin
    >>> plugin.backend_capabilities().topk_layout
    'head_major'
"""

from __future__ import annotations

import os

import torch

from mm3_backends.triton.plugin_factory import TritonPlatform, make_hookimpls

from .tuning import AMD_LAUNCH

__all__ = ["PLATFORM", "AMD_LAUNCH", "ALLOW_NON_ROCM_ENV", "backend_capabilities", "backend_probe",
           "alloc_topk_buffer", "index_topk", "attention_forward", "index_scores", "check_contents"]

ALLOW_NON_ROCM_ENV = "MM3_ROCM_ALLOW_NON_ROCM"
"""Test-only: set to 1 to run the rocm plugin on a non-ROCm GPU."""


def _platform() -> tuple[str, str]:
    if torch.version.hip:
        return "", f"AMD GPU (HIP {torch.version.hip}) with Triton"
    if os.environ.get(ALLOW_NON_ROCM_ENV, "") == "1":
        return "", f"test-only override {ALLOW_NON_ROCM_ENV}=1: rocm kernels on a non-ROCm GPU"
    return (f"not a ROCm build of PyTorch (torch.version.hip is None, CUDA {torch.version.cuda}); the rocm "
            f"backend needs an AMD GPU (tests only: {ALLOW_NON_ROCM_ENV}=1 runs it on this GPU anyway)"), ""


def _native() -> bool:
    # AMD-only launch options (waves_per_eu) are rejected by NVIDIA's Triton backend
    return bool(torch.version.hip)


PLATFORM = TritonPlatform(
    "rocm", "Triton kernels for AMD GPUs (head-major top-k buffer, 64-wide wavefront launch configs)",
    "head_major", _platform, AMD_LAUNCH, _native)

(backend_capabilities, backend_probe, alloc_topk_buffer,
 index_topk, attention_forward, index_scores, check_contents) = make_hookimpls(PLATFORM)
