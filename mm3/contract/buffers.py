"""Buffers that carry their own layout: the top-k buffer and the paged caches.

The top-k buffer is written by an indexer and read by an attention, which may
come from different backends. Its storage order is a *property of the object*,
never guessed from a shape: a reader asks for the view or the ``(h, t, k)``
strides it needs and gets the right answer whatever the writer preferred.

Example:
    >>> import torch
    >>> buf = TopkBuffer.allocate(num_tokens=6, num_heads=2, topk=4, layout="token_major")
    >>> buf.head_major().shape          # logical [H, T, K], a strided view
    torch.Size([2, 6, 4])
    >>> buf.strides()                  # element strides in (h, t, k) order
    (4, 8, 1)
    >>> step = buf.rows(0, 3)          # the first 3 tokens of this step, same storage
    >>> step.num_tokens, step.layout
    (3, 'token_major')
"""

from __future__ import annotations

from typing import Any, Optional, Union, cast, get_args

import torch

from mm3.contract.capabilities import TopkLayout
from mm3.contract.errors import InputError
from mm3.contract.facts import topk_facts

__all__ = ["TopkBuffer", "PagedKVCache", "TORCH_DTYPES", "dtype_name", "in_storage_order", "is_dense_storage"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling capabilities use)."""
    return str(dtype).removeprefix("torch.")


def _check_layout(layout: str) -> TopkLayout:
    if layout not in get_args(TopkLayout):
        raise InputError(
            f"unknown top-k layout {layout!r}; use 'head_major' ([H, T, K]) or "
            f"'token_major' ([T, H, K])")
    return cast(TopkLayout, layout)


def in_storage_order(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when axes 0, 1, 2 of a 3-D tensor of ``shape``/``stride`` lie in memory outermost to
    innermost, without overlap.

    Axes of size 1 are skipped: their stride is meaningless. That is why
    vLLM's bug hid with one KV head (both layouts are then one memory map),
    and why a one-token ``rows(t, t + 1)`` view stays legal.
    """
    axes = [(shape[i], stride[i]) for i in range(3) if shape[i] > 1]
    return all(outer_stride >= inner_size * inner_stride
               for (_, outer_stride), (inner_size, inner_stride) in zip(axes, axes[1:]))


def is_dense_storage(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when the inner two axes of 3-D top-k storage are packed (the outer stride may be larger):
    what ``topk_requires_contiguous`` backends need (:meth:`TopkBuffer.is_dense`)."""
    return stride[2] == 1 and stride[1] == shape[2] and stride[0] >= shape[1] * shape[2]


#: the last view :class:`TopkBuffer` wrapped that passed its checks: ``(its shape, strides, dtype and device,
#: (token_major, facts))``, one tuple swapped whole
_LAST_VIEW: tuple[Any, Any] = ((), None)


class TopkBuffer:
    """An int32 top-k buffer whose memory says its layout.

    Logical shape is always ``[H, T, K]`` (KV head, token, slot). Storage is
    ``[H, T, K]`` for ``head_major`` and ``[T, H, K]`` for ``token_major``.
    Slots hold logical block ids (0-based) as a prefix, then ``-1``.

    Construct with :meth:`allocate`, or wrap memory as its logical ``[H, T, K]``
    view: ``TopkBuffer(view)`` reads the layout from the strides, never from a
    label, so it cannot be wrong (token-major memory viewed through
    ``.permute(1, 0, 2)``, vLLM's MiniMax-M3 buffer, is ``token_major``).

    Example:
        >>> memory = torch.zeros(6, 2, 4, dtype=torch.int32)           # token-major memory [T, H, K]
        >>> TopkBuffer(memory.permute(1, 0, 2)).layout
        'token_major'
        >>> TopkBuffer(torch.zeros(2, 6, 4, dtype=torch.int32)).layout
        'head_major'
        >>> TopkBuffer(memory, "head_major")                          # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        mm3.contract.errors.InputError: TopkBuffer takes the logical [H, T, K] view of your memory...
    """

    __slots__ = ("_data", "_layout", "facts", "num_tokens")   # the last two worked out when built: a step reads them

    def __init__(self, view: torch.Tensor, layout: Optional[str] = None) -> None:
        global _LAST_VIEW
        if layout is not None:
            raise InputError(
                "TopkBuffer takes the logical [H, T, K] view of your memory, and reads the layout from its "
                "strides (a label could contradict the memory: vLLM's MiniMax-M3 bug); for token-major "
                "[T, H, K] memory pass memory.permute(1, 0, 2), for head-major [H, T, K] memory the tensor itself")
        if not isinstance(view, torch.Tensor):
            raise InputError(f"TopkBuffer needs the logical [H, T, K] view (a 3-D int32 tensor), got "
                             f"{type(view).__name__}")
        # what the checks and the facts read of the view, compared whole with the last view's (wrappers are
        # made per call: drop-ins and custom ops wrap the caller's memory every step)
        shape = view.shape
        key = (shape, view.stride(), view.dtype, view.device)
        last = _LAST_VIEW
        if key == last[0]:
            token_major, facts = last[1]
            data = view.permute(1, 0, 2) if token_major else view
        else:
            if len(shape) != 3:
                raise InputError(f"TopkBuffer needs the logical [H, T, K] view (a 3-D int32 tensor), got "
                                 f"{tuple(shape)}")
            token_major = shape[0] > 1 and shape[1] > 1 and key[1][0] < key[1][1]
            data = self._checked(view.permute(1, 0, 2) if token_major else view,
                                 "token_major" if token_major else "head_major")
            facts = topk_facts(data, "token_major" if token_major else "head_major")
            _LAST_VIEW = (key, (token_major, facts))
        self._data = data
        self._layout: TopkLayout = "token_major" if token_major else "head_major"
        self.facts = facts
        self.num_tokens: int = shape[1]   # rows it holds: the logical view's token axis

    @staticmethod
    def _checked(data: torch.Tensor, layout: str) -> torch.Tensor:
        if not isinstance(data, torch.Tensor):
            raise InputError(f"TopkBuffer needs a torch.Tensor, got {type(data).__name__}")
        if data.dtype != torch.int32:
            raise InputError(f"top-k buffer must be int32, got {data.dtype}; allocate with "
                             f"TopkBuffer.allocate(...) or pass tensor.to(torch.int32)")
        if data.dim() != 3:
            raise InputError(f"top-k storage must be 3-D ({'[H, T, K]' if layout == 'head_major' else '[T, H, K]'}"
                             f" for {layout}), got shape {tuple(data.shape)}")
        if not in_storage_order(data.shape, data.stride()):
            raise InputError(
                f"top-k storage of shape {tuple(data.shape)} has strides {tuple(data.stride())}: its memory is "
                f"not laid out outermost-to-innermost as {layout!r} storage, so a kernel would write other "
                f"tokens' rows (a token_major [T, H, K] tensor permuted to look head_major is vLLM's "
                f"MiniMax-M3 bug); allocate with TopkBuffer.allocate(..., layout={layout!r}), or wrap the "
                f"logical [H, T, K] view of the memory: TopkBuffer(view)")
        return data

    @classmethod
    def _wrap(cls, storage: torch.Tensor, layout: str) -> "TopkBuffer":
        """``storage`` in ``layout``'s own order (``[T, H, K]`` for token_major), checked: for mm3's
        code that knows the layout it allocated (the custom ops' storage argument); callers wrap views."""
        return cls._checked_before(cls._checked(storage, _check_layout(layout)), _check_layout(layout))

    def _as(self, layout: str) -> "TopkBuffer":
        """Labelled ``layout`` if its memory is in that order too (one head or token), else itself."""
        other = self._data.permute(1, 0, 2)
        if layout == self._layout or not in_storage_order(other.shape, other.stride()):
            return self
        return TopkBuffer._checked_before(other, _check_layout(layout))

    @classmethod
    def _checked_before(cls, data: torch.Tensor, layout: TopkLayout) -> "TopkBuffer":
        """:meth:`_wrap` without the checks: for a view of a checked buffer (rows of it keep its
        memory order) or storage of shapes and strides already checked."""
        buf = object.__new__(cls)
        buf._data, buf._layout, buf.facts = data, layout, topk_facts(data, layout)
        buf.num_tokens = data.shape[1 if layout == "head_major" else 0]
        return buf

    # -- construction ---------------------------------------------------------
    @classmethod
    def allocate(cls, num_tokens: int, num_heads: int, topk: int,
                 layout: str = "head_major",
                 device: Union[str, torch.device, None] = None,
                 fill: int = -1) -> "TopkBuffer":
        """A new contiguous buffer in ``layout``, filled with ``fill``."""
        layout = _check_layout(layout)
        for label, v in (("num_tokens", num_tokens), ("num_heads", num_heads), ("topk", topk)):
            if not isinstance(v, int) or v < (0 if label == "num_tokens" else 1):
                raise InputError(f"TopkBuffer.allocate: {label} must be a "
                                 f"{'non-negative' if label == 'num_tokens' else 'positive'} int, got {v!r}")
        shape = (num_heads, num_tokens, topk) if layout == "head_major" else (num_tokens, num_heads, topk)
        data = torch.full(shape, fill, dtype=torch.int32, device=device)
        return cls._checked_before(data, layout)

    # -- facts ------------------------------------------------------------------
    @property
    def layout(self) -> TopkLayout:
        return self._layout

    @property
    def storage(self) -> torch.Tensor:
        """The tensor in storage order (see :attr:`layout`)."""
        return self._data

    @property
    def num_heads(self) -> int:
        return self._data.shape[0 if self._layout == "head_major" else 1]

    @property
    def capacity(self) -> int:
        """Rows (tokens) this buffer can hold: :attr:`num_tokens`."""
        return self.num_tokens

    @property
    def topk(self) -> int:
        return self._data.shape[2]

    @property
    def device(self) -> torch.device:
        return self._data.device

    def is_contiguous(self) -> bool:
        """True when the storage tensor is fully contiguous."""
        return self._data.is_contiguous()

    def is_dense(self) -> bool:
        """True when the inner two storage axes are packed (the outer stride may be larger): what
        ``topk_requires_contiguous`` backends need. A row range of a contiguous buffer is dense in
        either layout (a head-major head stride keeps the full capacity)."""
        return is_dense_storage(self._data.shape, self._data.stride())

    # -- views --------------------------------------------------------------------
    def head_major(self) -> torch.Tensor:
        """Logical ``[H, T, K]`` view (a permuted view for token-major storage)."""
        return self._data if self._layout == "head_major" else self._data.permute(1, 0, 2)

    def token_major(self) -> torch.Tensor:
        """Logical ``[T, H, K]`` view (a permuted view for head-major storage)."""
        return self._data if self._layout == "token_major" else self._data.permute(1, 0, 2)

    def view(self, layout: str) -> torch.Tensor:
        """The view for ``layout``; same as :meth:`head_major` / :meth:`token_major`."""
        return self.head_major() if _check_layout(layout) == "head_major" else self.token_major()

    def strides(self) -> tuple[int, int, int]:
        """Element strides of the logical ``(h, t, k)`` axes, for kernels."""
        s = self._data.stride()   # the storage is [H, T, K] (head_major) or [T, H, K]
        return (s[0], s[1], s[2]) if self._layout == "head_major" else (s[1], s[0], s[2])

    def rows(self, start: int, stop: int) -> "TopkBuffer":
        """Tokens ``[start, stop)`` as a buffer sharing this storage."""
        if not (0 <= start <= stop <= self.num_tokens):
            raise InputError(
                f"top-k buffer rows [{start}, {stop}) out of range: capacity is {self.num_tokens} "
                f"tokens; allocate a larger buffer (max_num_tokens) for this step")
        # a token range of memory in storage order is in storage order
        data = self._data[:, start:stop] if self._layout == "head_major" else self._data[start:stop]
        if stop - start < 2 or self.num_tokens < 2:
            return TopkBuffer._checked_before(data, self._layout)
        # its facts are this buffer's: a slice keeps the dtype, device and strides, and the facts count the
        # token axis as 1 or 2 (reading them again costs about as much as the slice)
        buf = object.__new__(TopkBuffer)
        buf._data, buf._layout, buf.facts, buf.num_tokens = data, self._layout, self.facts, stop - start
        return buf

    # -- mutation / conversion -------------------------------------------------------
    def fill_(self, value: int) -> "TopkBuffer":
        self._data.fill_(value)
        return self

    def copy_(self, other: "TopkBuffer") -> "TopkBuffer":
        """Copy ``other``'s contents into this buffer, whatever either layout is."""
        if (other.num_heads, other.num_tokens, other.topk) != (self.num_heads, self.num_tokens, self.topk):
            raise InputError(
                f"cannot copy top-k buffer [H={other.num_heads}, T={other.num_tokens}, K={other.topk}] "
                f"into [H={self.num_heads}, T={self.num_tokens}, K={self.topk}]")
        self.head_major().copy_(other.head_major())
        return self

    def to_layout(self, layout: str, *, contiguous: bool = True) -> "TopkBuffer":
        """This buffer in ``layout``: ``self`` if already there (and dense when asked), else a copy."""
        layout = _check_layout(layout)
        if layout == self._layout and (not contiguous or self.is_dense()):
            return self
        out = TopkBuffer.allocate(self.num_tokens, self.num_heads, self.topk, layout, self.device)
        return out.copy_(self)

    def clone(self) -> "TopkBuffer":
        return TopkBuffer._checked_before(self._data.clone(), self._layout)

    def __repr__(self) -> str:
        return (f"TopkBuffer(layout={self._layout!r}, H={self.num_heads}, T={self.num_tokens}, "
                f"K={self.topk}, device={self.device}, dense={self.is_dense()})")


# the paged caches live in their own module (mm3.contract.caches); this name stays importable from here
from mm3.contract.caches import PagedKVCache  # noqa: E402
