"""Scratch memory of eager decode steps, kept per (device, stream) instead of allocated per step.

A decode step needs scratch: the indexer's block scores and the attention's
split partials. ``torch.empty`` on a GPU costs a few microseconds of host
time per call, and an eager decode step at batch 1 is host-bound (two calls
were about a tenth of an eager layer's host time on the H200's host). So an
eager step takes its scratch from a buffer kept for the current stream:

* launches on one stream run in order, and each decode kernel that touches
  scratch waits for the kernel before it first (its PDL prologue, when it is
  launched early), so one step's scratch is never in use by another step:
  the caching allocator relies on the same order to reuse memory freed on a
  stream;
* during a CUDA-graph capture the step allocates as before (the graph's pool
  holds the memory for the replays);
* a slot only grows; the buffer is allocated by a thread of its own on the
  caller's stream (:func:`.arrivals.in_own_thread`: torch.compile's graph
  trees pool the calling thread's allocations during their warm-up runs), and
  the same shape is handed back as the same tensor (a view costs host time too).

Example:
    >>> import torch
    >>> a = scratch(torch.device("cpu"), "example", (4, 25))
    >>> a.shape, a.dtype
    (torch.Size([4, 25]), torch.float32)
    >>> scratch(torch.device("cpu"), "example", (4, 25)) is a
    True
    >>> scratch(torch.device("cpu"), "example", (60,)).data_ptr() == a.data_ptr()
    True
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .arrivals import capturing, in_own_thread, stream_key

__all__ = ["scratch", "scratch_parts"]

#: (device, stream, slot, dtype) -> (the kept buffer, the last request handed out, what was handed out)
_KEPT: dict[tuple[Any, ...], tuple[torch.Tensor, tuple[int, ...], Any]] = {}


def scratch(device: torch.device, slot: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
            ) -> torch.Tensor:
    """A contiguous ``shape`` tensor of scratch ``slot`` for a launch on ``device``'s current stream
    (uninitialised; its contents last only until the stream's next step)."""
    numel = 1
    for n in shape:
        numel *= n
    return _handed(device, slot, dtype, shape, numel, lambda buf: buf.view(shape))


def scratch_parts(device: torch.device, slot: str, sizes: tuple[int, ...], dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, ...]:
    """Consecutive 1-D parts of ``sizes`` elements of one scratch ``slot`` (see :func:`scratch`).

    Example:
        >>> m, acc = scratch_parts(torch.device("cpu"), "example-parts", (2, 6))
        >>> m.numel(), acc.numel(), acc.data_ptr() - m.data_ptr() == 2 * m.element_size()
        (2, 6, True)
    """
    def cut(buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        return tuple(buf[a:b] for a, b in zip(starts, starts[1:]))
    return _handed(device, slot, dtype, ("parts", *sizes), sum(sizes), cut)


def _handed(device: torch.device, slot: str, dtype: torch.dtype, request: tuple[Any, ...], numel: int,
            make: Callable[[torch.Tensor], Any]) -> Any:
    """``make(numel elements of the slot's buffer)``, the same object again for the same request."""
    if capturing(device):
        return make(torch.empty(numel, dtype=dtype, device=device))
    key = (*stream_key(device), slot, dtype)
    kept = _KEPT.get(key)
    if kept is not None and kept[1] == request:
        return kept[2]
    buf = kept[0] if kept is not None and kept[0].numel() >= numel else _allocate(device, numel, dtype)
    handed = make(buf[:numel])
    _KEPT[key] = (buf, request, handed)
    return handed


def _allocate(device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    size = 1 << max(0, numel - 1).bit_length()   # grow by powers of two: few reallocations
    if device.type != "cuda":
        return torch.empty(size, dtype=dtype, device=device)
    stream = torch.cuda.current_stream(device)

    def alloc() -> torch.Tensor:
        # on the caller's stream, so the allocator orders the buffer's eventual reuse after its kernels
        with torch.cuda.stream(stream):
            return torch.empty(size, dtype=dtype, device=device)
    return in_own_thread(alloc)
