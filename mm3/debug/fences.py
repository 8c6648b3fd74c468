"""Fences: a byte-exact snapshot of a tensor's storage, to prove nothing outside a view changed."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["Fence", "locate", "false_flag", "mark_unwritten", "still_marked"]

_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# A NaN with a payload no arithmetic produces (computed NaNs are the canonical quiet NaN), per dtype.
_MARK_BITS = {torch.float32: 0x7FC04D33, torch.float16: 0x7E4D, torch.bfloat16: 0x7FCD}


def false_flag(device: torch.device) -> torch.Tensor:
    """A 0-d False on ``device``: a flag that joins the others in the one host sync."""
    return torch.zeros((), dtype=torch.bool, device=device)


class Fence:
    """A byte-exact snapshot of a tensor's whole storage, minus a writable view.

    ``changed()`` is a 0-d bool tensor (no sync); ``first_change()`` locates the
    first changed element (slow path). Comparing bit patterns makes NaN equal to
    itself, so a NaN-filled region that stays NaN is "unchanged".
    """

    def __init__(self, base: torch.Tensor, writable: Optional[torch.Tensor]) -> None:
        self.dtype = base.dtype
        st = base.untyped_storage()
        n = st.nbytes() // base.element_size()
        # Whole storage as a flat tensor of base's dtype, reinterpreted as ints of the same size.
        flat = torch.empty(0, dtype=base.dtype, device=base.device).set_(st, 0, (n,), (1,))
        self.flat = flat.view(_SAME_SIZE_INT[base.element_size()])
        self.writable = writable
        covers_all = (writable is not None and writable.numel() == n and writable.is_contiguous()
                      and writable.storage_offset() == 0)
        self.before = None if covers_all or n == 0 else self.flat.clone()

    def _diff(self) -> Optional[torch.Tensor]:
        if self.before is None:
            return None
        diff = self.flat != self.before
        w = self.writable
        if w is not None and w.numel():
            torch.as_strided(diff, w.shape, w.stride(), w.storage_offset()).fill_(False)
        return diff

    def changed(self) -> torch.Tensor:
        diff = self._diff()
        if diff is None:
            return false_flag(self.flat.device)
        return diff.any()

    def first_change(self) -> tuple[int, int, int]:
        """``(element offset, value bits before, value bits after)`` of the first changed element."""
        diff = self._diff()
        assert diff is not None
        e = int(diff.nonzero()[0, 0])
        return e, int(self.before[e]), int(self.flat[e])  # type: ignore[index]


def mark_unwritten(t: torch.Tensor) -> bool:
    """Fill the float view ``t`` with a marked NaN before a call that must overwrite all of it.

    Returns False (and fills nothing) for a dtype without a mark. Afterwards
    :func:`still_marked` tells the elements that were not written: no computed
    value has these bits.

    Example:
        >>> out = torch.zeros(3, 2)
        >>> mark_unwritten(out[:2])
        True
        >>> out[0] = 1.0                 # a backend that writes row 0 only
        >>> still_marked(out[:2]).any(-1).tolist(), out[2].tolist()
        ([False, True], [0.0, 0.0])
    """
    bits = _MARK_BITS.get(t.dtype)
    if bits is None or not t.numel():
        return False
    t.view(_SAME_SIZE_INT[t.element_size()]).fill_(bits)   # positive NaNs: the bits fit the signed int
    return True


def still_marked(t: torch.Tensor) -> torch.Tensor:
    """Bool mask of the elements of ``t`` that still hold :func:`mark_unwritten`'s marked NaN."""
    return t.view(_SAME_SIZE_INT[t.element_size()]) == _MARK_BITS[t.dtype]


def locate(offset: int, base_offset: int, strides: Sequence[int], names: Sequence[str],
            sizes: Sequence[int]) -> str:
    """``"token 9, head 1, slot 0"`` for an element offset in a dense buffer with these strides."""
    rel = offset - base_offset
    if rel < 0:
        return f"element {offset} of the storage (before the buffer)"
    parts: dict[str, int] = {}
    for name, stride in sorted(zip(names, strides), key=lambda x: -x[1]):
        parts[name], rel = divmod(rel, stride) if stride else (0, rel)
    inside = all(parts[n] < s for n, s in zip(names, sizes))
    where = ", ".join(f"{n} {parts[n]}" for n in names)
    return where if inside else f"element {offset} of the storage (past the buffer)"
