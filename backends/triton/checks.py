"""What the Triton plugins check themselves: only what mm3's bound backend cannot know.

mm3's :class:`~mm3.Backend` checks every argument before a hook runs: types,
shapes, devices, dtypes, and the limits these plugins declare in their
capabilities (tile sizes, top-k, GQA group, decode query length). Left here:
whether the tensors' device can run the kernels right now (a GPU, or CPU
tensors under Triton's interpreter), and the index query's dtype, read from
the same capabilities. No contiguity is demanded: the kernels are stride-generic.
"""

from __future__ import annotations

from typing import Callable

import torch

from mm3.contract import BackendCapabilities, InputError, dtype_name

__all__ = ["check_device", "check_index_q"]


def check_device(backend: str, device: torch.device, device_problem: Callable[[torch.device], str]) -> None:
    """Raise :class:`InputError` naming ``backend`` when the kernels cannot run on ``device`` here."""
    why = device_problem(device)
    if why:
        raise InputError(f"{backend}: {why}")


def check_index_q(backend: str, caps: BackendCapabilities, index_q: torch.Tensor) -> None:
    """The index query must be in one of the declared attention dtypes (the kernels read it as such)."""
    if dtype_name(index_q.dtype) not in caps.dtypes:
        raise InputError(f"{backend}: index_q dtype {index_q.dtype} unsupported; use one of "
                         f"{sorted(caps.dtypes)}")
