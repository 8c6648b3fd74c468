"""The decode-first mixed batch of one step (docs/spec.md §2), built and validated once.

Requests ``0 .. num_decodes-1`` are decodes, each with the same query length
``decode_query_len`` (1, or 1 + draft tokens), or padding rows; the rest are
prefills of any length, possibly a later chunk of a long prompt.

Two kinds of padding decode exist, both common inside CUDA graphs:

* ``query_len == 0``: the request holds no token of the step;
* ``seq_len == 0`` with ``query_len == decode_query_len``: the request keeps its
  slots in the flat batch, but they are padding tokens (position ``-1``): their
  top-k rows are all ``-1`` and their outputs are zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional, Sequence, Union

import torch

from mm3.contract.errors import InputError
from mm3.contract.facts import ArgNames, BatchShape, batch_kind, batch_shape
from mm3.contract.lengths import IntSeq, check_lengths, check_table, to_int_list
from mm3.contract.contents import check_on_host, derive_context, derive_tokens
from mm3.contract.slots import TokenSlots

__all__ = ["BatchMetadata"]

#: host ints a batch caches (pre-set by :meth:`BatchMetadata.assemble`), carried by ``to()``
_HOST_INTS = ("num_decode_tokens", "max_query_len", "max_seq_len", "max_prefill_query_len",
              "max_prefill_context_len")
_TENSORS = ("query_start_loc", "seq_lens", "context_lens", "block_table", "token_to_request", "token_positions")
#: how :meth:`BatchMetadata.build`'s caller spells what its errors name
BUILD_NAMES = ArgNames(query_start_loc="query_lens", seq_lens="seq_lens", block_table="block_table",
                       context_lens="context_lens", where_made="the lengths given to BatchMetadata.build")
#: host facts read back from the tensors' contents (dropped when the contents change in place)
READ_BACK = ("query_lens", "seq_lens_host", "max_seq_len", "max_prefill_context_len")


@dataclass(frozen=True)
class BatchMetadata:
    """Per-step batch description; all tensors int32 on ``device``.

    Build it from per-request lengths with :meth:`build` (validated on the host),
    or from device tensors an engine already holds with :meth:`from_device` (no
    device-to-host copy). The host copies ``query_lens`` / ``seq_lens_host`` are
    the lengths :meth:`build` was given; a batch from device tensors reads them
    back from the tensors on first use (a device sync, so the decode path of
    the GPU backends never asks for them).

    Example:
        >>> import torch
        >>> bt = torch.arange(12, dtype=torch.int32).reshape(3, 4)
        >>> b = BatchMetadata.build(query_lens=[1, 1, 5], seq_lens=[300, 129, 5],
        ...                         block_table=bt, block_size=128, num_decodes=2)
        >>> b.num_tokens, b.num_decode_tokens, b.token_positions.tolist()
        (7, 2, [299, 128, 0, 1, 2, 3, 4])
    """

    num_decodes: int
    decode_query_len: int
    block_size: int
    query_start_loc: torch.Tensor   # [R + 1]
    seq_lens: torch.Tensor          # [R]
    context_lens: torch.Tensor      # [R]
    block_table: torch.Tensor       # [R, max_blocks]
    token_to_request: torch.Tensor  # [T]
    token_positions: torch.Tensor   # [T]; -1 marks a padding token
    #: the per-request lengths :meth:`build` validated; ``None`` when built from device tensors
    host_lens: Optional[tuple[tuple[int, ...], tuple[int, ...]]] = field(default=None, repr=False)
    #: token slots (:mod:`mm3.contract.slots`): each token's cache row through a slot table; the block
    #: table then has no columns. ``None``: pages, through the block table
    slots: Optional[TokenSlots] = field(default=None, repr=False)

    # -- derived facts ---------------------------------------------------------
    # Host facts are cached: every layer, backend and check of a step asks for
    # them. A batch from device tensors has the engine's host ints pre-set
    # (:meth:`assemble`) and reads the per-request lengths back only on demand.
    @cached_property
    def query_lens(self) -> tuple[int, ...]:
        """Per-request query lengths on the host (a device sync for a batch from device tensors)."""
        if self.host_lens is not None:
            return self.host_lens[0]
        qsl = self.query_start_loc.tolist()
        return tuple(b - a for a, b in zip(qsl[:-1], qsl[1:]))

    @cached_property
    def seq_lens_host(self) -> tuple[int, ...]:
        """Per-request sequence lengths on the host (a device sync for a batch from device tensors)."""
        return self.host_lens[1] if self.host_lens is not None else tuple(self.seq_lens.tolist())

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_prefills(self) -> int:
        return self.num_requests - self.num_decodes

    @property
    def num_tokens(self) -> int:
        return self.token_positions.shape[0]

    @cached_property
    def num_decode_tokens(self) -> int:
        return int(sum(self.query_lens[: self.num_decodes]))

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @cached_property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @cached_property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @cached_property
    def max_prefill_query_len(self) -> int:
        return max(self.query_lens[self.num_decodes:], default=0)

    @cached_property
    def max_prefill_context_len(self) -> int:
        """Longest cached context (``seq_len - query_len``) of a prefill request; 0 without prefills."""
        n = self.num_decodes
        return max((s - q for s, q in zip(self.seq_lens_host[n:], self.query_lens[n:])), default=0)

    def prefill_seq_len_bound(self) -> int:
        """At least the longest prefill's ``seq_len``, from host ints only (never a read of the device).

        Exact when the host has the lengths (:meth:`build`), else what the block table
        can hold (a batch's contents are checked to fit it, docs/errors.md §2.6). For
        launch sizes of a step that may be captured in a CUDA graph.

        Example:
            >>> b = BatchMetadata.build([1, 5], [300, 40], torch.zeros(2, 4, dtype=torch.int32), block_size=128,
            ...                         num_decodes=1)
            >>> b.prefill_seq_len_bound()
            40
        """
        cap = self.facts.width * (self.block_size if self.slots is None else 1)
        # set by build() from its lengths (read here only if there: computing it reads the device)
        context = self.__dict__.get("max_prefill_context_len")
        return cap if context is None else min(cap, context + self.max_prefill_query_len)

    @property
    def device(self) -> torch.device:
        return self.seq_lens.device

    @cached_property
    def facts(self) -> BatchShape:
        """What this batch says of itself (:class:`~mm3.contract.facts.BatchShape`), worked out once: every
        layer of a step reads it instead of the tensors' shapes (``batch.facts.kind``: ``"mixed"``...)."""
        d = self.__dict__      # context lengths not given are derived from the lengths: right by construction
        return batch_shape(d["query_start_loc"], d["seq_lens"], d["block_table"], d["token_to_request"],
                           d["token_positions"], d.get("context_lens"), self.num_decodes, self.decode_query_len,
                           self.num_decode_tokens, self.block_size, self.max_prefill_query_len,
                           *(d.get("slots") or (None, None)))

    @property
    def kind(self) -> str:
        """What the step holds: ``"decode"``, ``"prefill"``, ``"mixed"`` or ``"empty"``, with
        ``"speculative "`` in front when its decodes carry draft tokens (``decode_query_len > 1``).

        Example:
            >>> import torch
            >>> BatchMetadata.build([2, 2, 9], [50, 40, 9], torch.zeros(3, 4, dtype=torch.int32),
            ...                     block_size=16, num_decodes=2).kind
            'speculative mixed'
        """
        return batch_kind(self.num_requests, self.num_decodes, self.decode_query_len)

    # -- construction ----------------------------------------------------------------
    @classmethod
    def build(cls, query_lens: IntSeq, seq_lens: IntSeq, block_table: torch.Tensor, *,
              block_size: int, num_decodes: Optional[int] = None,
              is_decode: Optional[Sequence[bool]] = None,
              decode_query_len: Optional[int] = None,
              num_pages: Optional[int] = None, device: Union[str, torch.device, None] = None,
              slots: Optional[TokenSlots] = None) -> "BatchMetadata":
        """Validate per-request lengths and build the step's metadata.

        Give either ``num_decodes`` (decodes are the first requests) or
        ``is_decode`` (one flag per request; must be decodes-first). When
        ``num_pages`` is given, every block-table entry a request uses is
        checked to lie in ``[0, num_pages)``. ``slots``: a batch of token slots
        (:mod:`mm3.contract.slots`; pass an empty ``[R, 0]`` block table), whose
        used slots are checked against ``num_pages`` one-token pages. ``device``: built and checked in host
        memory, then moved, never waiting for the device (a table given there is read back once, to be checked).
        """
        ql = to_int_list("query_lens", query_lens)
        sl = to_int_list("seq_lens", seq_lens)
        if len(ql) != len(sl):
            raise InputError(f"query_lens has {len(ql)} requests but seq_lens has {len(sl)}")
        n = len(ql)
        if is_decode is not None:
            flags = [bool(f) for f in is_decode]
            if len(flags) != n:
                raise InputError(f"is_decode has {len(flags)} entries for {n} requests")
            nd = sum(flags)
            if flags != [True] * nd + [False] * (n - nd):
                first_pf = flags.index(False)
                late = flags.index(True, first_pf)
                raise InputError(
                    f"batch is not decode-first: request {late} is a decode after prefill request "
                    f"{first_pf}; reorder the requests so all decodes come first")
            if num_decodes is not None and num_decodes != nd:
                raise InputError(f"num_decodes={num_decodes} disagrees with is_decode ({nd} decodes)")
            num_decodes = nd
        if num_decodes is None:
            num_decodes = 0
        block_table = check_table(block_table, n)
        dev = torch.device(device) if device is not None else block_table.device
        decode_query_len = check_lengths(ql, sl, num_decodes, decode_query_len, block_size)

        starts = [0]
        tok_req: list[int] = []
        tok_pos: list[int] = []
        for r in range(n):
            q, s = ql[r], sl[r]
            starts.append(starts[-1] + q)
            tok_req.extend([r] * q)
            if r < num_decodes and s == 0:
                tok_pos.extend([-1] * q)
            else:
                tok_pos.extend(range(s - q, s))
        i32, cpu = torch.int32, torch.device("cpu")
        ctx = [max(s - q, 0) if not (r < num_decodes and s == 0) else 0 for r, (q, s) in enumerate(zip(ql, sl))]
        # judged in host memory, never read back (but a device table, once; a device slot pool judged there)
        where = dev if dev.type == "cpu" or (slots is not None and slots.table.device.type != "cpu") else cpu
        there = block_table.to(dtype=i32).contiguous() if where is cpu and block_table.device.type == dev.type \
            and dev.index in (None, block_table.device.index) else None
        table = (block_table if there is None else there).to(dtype=i32, device=where).contiguous()
        batch = cls(num_decodes=num_decodes, decode_query_len=decode_query_len, host_lens=(tuple(ql), tuple(sl)),
                    block_size=block_size, **{name: torch.tensor(values, dtype=i32, device=where) for name, values in (
                        ("query_start_loc", starts), ("seq_lens", sl), ("context_lens", ctx),
                        ("token_to_request", tok_req), ("token_positions", tok_pos))},
                    block_table=table, slots=None if slots is None else slots.to(where))
        check_on_host(batch, num_pages, entry="BatchMetadata.build", names=BUILD_NAMES)
        if where is not dev:
            if there is not None:       # judged: the table given there is the batch's, as it is
                object.__setattr__(batch, "block_table", there)
            batch = batch.to(dev)
        for name in (*_HOST_INTS, "facts"):  # cached now: a compiled caller reads them without running Python
            getattr(batch, name)
        return batch

    @classmethod
    def assemble(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, context_lens: Optional[torch.Tensor],
                 block_table: torch.Tensor, token_to_request: torch.Tensor, token_positions: torch.Tensor, *,
                 num_decodes: int, decode_query_len: int, num_decode_tokens: int, max_prefill_query_len: int,
                 block_size: int, max_query_len: Optional[int] = None,
                 max_seq_len: Optional[int] = None, slots: Optional[TokenSlots] = None) -> "BatchMetadata":
        """A batch from its tensors, as they are, and the host ints that describe them; no checks, no copy.

        What :meth:`from_device` returns, and how mm3's custom ops rebuild a batch
        from their arguments. ``max_prefill_query_len`` may be an upper bound (it
        sizes prefill grids). Lengths not given are read back from the tensors
        only when something asks for them. ``context_lens=None``: derived from
        ``seq_lens`` and ``query_start_loc`` on the device when first read (no
        backend's decode path reads them, so a captured decode step that does not
        runs no kernel for them).

        Example:
            >>> qsl, sl = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([40, 0], dtype=torch.int32)
            >>> b = BatchMetadata.assemble(qsl, sl, None, torch.zeros(2, 3, dtype=torch.int32),
            ...                            torch.tensor([0, 1], dtype=torch.int32), sl - 1, num_decodes=2,
            ...                            decode_query_len=1, num_decode_tokens=2, max_prefill_query_len=0,
            ...                            block_size=16)
            >>> b.context_lens.tolist()     # a padding decode (seq_len 0) has no context
            [39, 0]
        """
        facts = batch_shape(query_start_loc, seq_lens, block_table, token_to_request, token_positions, context_lens,
                            num_decodes, decode_query_len, num_decode_tokens, block_size, max_prefill_query_len,
                            *(slots or (None, None)))
        batch = cls.__new__(cls)  # the fields set directly: the drop-ins assemble a batch per call
        batch.__dict__.update(num_decodes=num_decodes, decode_query_len=decode_query_len, block_size=block_size,
                              query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                              token_to_request=token_to_request, host_lens=None, token_positions=token_positions,
                              num_decode_tokens=num_decode_tokens, max_prefill_query_len=max_prefill_query_len,
                              slots=slots, facts=facts)
        for k, v in (("context_lens", context_lens), ("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
            if v is not None:     # the cached properties
                batch.__dict__[k] = v
        return batch

    def __getattr__(self, name: str) -> torch.Tensor:
        # Reached only for an attribute that is not set: the context lengths of a batch assembled
        # without them, derived once on first use (seq_len - query length, 0 for padding decodes).
        if name != "context_lens" or "seq_lens" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        ctx = derive_context(self.query_start_loc, self.seq_lens, self.num_decodes)
        self.__dict__["context_lens"] = ctx
        return ctx

    @classmethod
    def from_device(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, *,
                    num_decodes: int, num_tokens: int, max_query_len: int, block_size: int,
                    decode_query_len: int = 1, num_decode_tokens: Optional[int] = None,
                    max_seq_len: Optional[int] = None, context_lens: Optional[torch.Tensor] = None,
                    slots: Optional[TokenSlots] = None) -> "BatchMetadata":
        """The step's metadata from tensors an engine already holds, with no device-to-host copy.

        ``query_start_loc`` ``[R + 1]``, ``seq_lens`` ``[R]`` and ``block_table``
        ``[R, max_blocks]`` (int32, on the step's device) are used as they are;
        the per-token tensors are derived from them on the device. The host ints
        are the ones an engine's scheduler knows: decodes (first), tokens
        (``query_start_loc[-1]``), the longest query (an upper bound is fine),
        ``decode_query_len`` (1 + draft tokens) and ``num_decode_tokens``
        (default ``num_decodes * decode_query_len``). ``context_lens``: the
        engine's own ``[R]`` context lengths, if it keeps them (used as they are).
        ``slots``: token slots (:mod:`mm3.contract.slots`) with an empty ``[R, 0]`` block table.

        What the tensors hold is checked where the step runs, never here (that
        needs the data on the host): on the host at the first step of each shape
        class and every step for a batch in host memory, on the device otherwise
        (:mod:`mm3.contract.contents`); :meth:`validate` checks it now. Refill a
        captured batch with :meth:`update_from_device_`.

        Example:
            >>> qsl = torch.tensor([0, 1, 2, 7], dtype=torch.int32)
            >>> b = BatchMetadata.from_device(qsl, torch.tensor([300, 129, 5], dtype=torch.int32),
            ...     torch.arange(12, dtype=torch.int32).reshape(3, 4), num_decodes=2, num_tokens=7,
            ...     max_query_len=5, block_size=128)
            >>> b.token_positions.tolist(), b.validate().num_decode_tokens
            ([299, 128, 0, 1, 2, 3, 4], 2)
        """
        i32, T = torch.int32, torch.Tensor
        if not (isinstance(query_start_loc, T) and query_start_loc.dtype is i32 and isinstance(seq_lens, T)
                and seq_lens.dtype is i32 and isinstance(block_table, T) and block_table.dtype is i32
                and (context_lens is None or (isinstance(context_lens, T) and context_lens.dtype is i32))):
            for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                            ("block_table", block_table), ("context_lens", context_lens)):
                if (t is not None or name != "context_lens") and (not isinstance(t, T) or t.dtype != i32):
                    raise InputError(f"{name} must be an int32 tensor, got "
                                     f"{t.dtype if isinstance(t, T) else type(t).__name__}")
        R = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
        if R < 0 or query_start_loc.shape != (R + 1,) or block_table.dim() != 2 or block_table.shape[0] != R or \
                (context_lens is not None and context_lens.shape != (R,)):
            raise InputError(f"shapes do not agree: query_start_loc {tuple(query_start_loc.shape)} must be "
                             f"[R + 1], seq_lens {tuple(seq_lens.shape)} [R], block_table "
                             f"{tuple(block_table.shape)} [R, max_blocks]"
                             + ("" if context_lens is None else f", context_lens {tuple(context_lens.shape)} [R]"))
        if num_decode_tokens is None and type(num_decodes) is int and type(decode_query_len) is int:
            num_decode_tokens = num_decodes * decode_query_len
        # every step builds one: the common case in one expression, the message only when it fails
        if not (type(num_decodes) is int and type(num_tokens) is int and type(max_query_len) is int
                and type(block_size) is int and type(decode_query_len) is int and type(num_decode_tokens) is int
                and 0 <= num_decodes <= R and num_tokens >= 0 and max_query_len >= 0 and block_size >= 1
                and decode_query_len >= 1 and 0 <= num_decode_tokens <= num_tokens):
            for name, value, most in (("num_decodes", num_decodes, R), ("decode_query_len", decode_query_len, None),
                                      ("num_tokens", num_tokens, None), ("max_query_len", max_query_len, None),
                                      ("block_size", block_size, None), ("num_decode_tokens", num_decode_tokens,
                                                                         num_tokens)):
                _count(name, value, most)
            if block_size < 1 or decode_query_len < 1:
                raise InputError(f"block_size ({block_size}) and decode_query_len ({decode_query_len}) must be >= 1")
        pos, req = derive_tokens(query_start_loc, seq_lens, num_decodes, num_tokens)
        return cls.assemble(
            query_start_loc, seq_lens, context_lens, block_table, req, pos, num_decodes=num_decodes,
            decode_query_len=decode_query_len, num_decode_tokens=num_decode_tokens,  # type: ignore[arg-type]
            max_prefill_query_len=max_query_len if num_decodes < R else 0, block_size=block_size,
            max_query_len=max_query_len, max_seq_len=max_seq_len, slots=slots)

    def _derive_tokens(self) -> None:
        """Refill the per-token tensors (and derived ``context_lens``) in place, on the device, from the lengths."""
        qsl, sl, nd = self.query_start_loc, self.seq_lens, self.num_decodes
        pos, req = derive_tokens(qsl, sl, nd, self.num_tokens)
        if "context_lens" in self.__dict__:
            self.context_lens.copy_(derive_context(qsl, sl, nd))
        self.token_to_request.copy_(req)
        self.token_positions.copy_(pos)

    def update_from_device_(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor) -> "BatchMetadata":
        """Refill this batch (of :meth:`from_device`) in place from the engine's tensors of a new step.

        For CUDA-graph replay: every tensor keeps its address, nothing is copied to
        the host. The step must be of the same shape class (requests, tokens,
        decodes, block-table width). Host lengths read back earlier are dropped.
        """
        for name, src in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                          ("block_table", block_table)):
            dst = getattr(self, name)
            if not isinstance(src, torch.Tensor) or dst.shape != src.shape:
                raise InputError(f"update_from_device_: {name} shape "
                                 f"{tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__} != "
                                 f"captured {tuple(dst.shape)}; build a new batch for a new shape class")
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        for k in READ_BACK:
            self.__dict__.pop(k, None)
        self._derive_tokens()
        return self

    def validate(self) -> "BatchMetadata":
        """Check what the batch's tensors hold now, as a step does (one device sync for a device batch).

        For a batch of :meth:`from_device`, or one an engine edited in place: raises
        :class:`InputError` naming the request and what to fix; returns ``self``. Steps
        check the same rules themselves (:mod:`mm3.contract.contents`); this is for
        finding a bad batch where it is made.
        """
        R = self.num_requests
        if self.block_table.numel() or R:
            # every used block-table entry must exist; no cache here, so only that ids are not negative
            check_on_host(self, num_pages=2 ** 31 - 1, entry="BatchMetadata.validate")
        return self

    def to(self, device: Union[str, torch.device]) -> "BatchMetadata":
        """The same batch with its tensors on ``device``; from pageable host memory without waiting (a copy from
        pinned memory waits: it would read the buffer later, when the caller may have refilled it)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=t.is_cpu and not t.is_pinned() and torch.device(device).type == "cuda")
        moved = BatchMetadata(num_decodes=self.num_decodes, decode_query_len=self.decode_query_len,
                              host_lens=self.host_lens, block_size=self.block_size,
                              **{f: move(getattr(self, f)) for f in _TENSORS},
                              slots=None if self.slots is None else type(self.slots)(*map(move, self.slots)))
        moved.__dict__.update({k: v for k, v in self.__dict__.items() if k in _HOST_INTS})
        return moved

    def update_(self, other: "BatchMetadata") -> "BatchMetadata":
        """Copy ``other``'s tensors into this batch's tensors in place (for CUDA-graph replay).

        Shapes must match (same requests, tokens and block-table width); the host-side
        lengths of ``self`` are *not* changed, so only use this where kernels size their
        grids from shapes alone (the decode path).
        """
        for f in _TENSORS:
            dst, src = getattr(self, f), getattr(other, f)
            if dst.shape != src.shape:
                raise InputError(f"update_: {f} shape {tuple(src.shape)} != captured {tuple(dst.shape)}")
            dst.copy_(src)
        return self

    def __repr__(self) -> str:
        return (f"BatchMetadata(requests={self.num_requests}, decodes={self.num_decodes} "
                f"x q{self.decode_query_len}, prefills={self.num_prefills}, tokens={self.num_tokens}, "
                f"max_seq_len={self.max_seq_len}, device={self.device})")


def _count(name: str, value: object, most: Optional[int] = None) -> None:
    """Raise :class:`InputError` unless ``value`` is an int in ``[0, most]``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (most is not None and value > most):
        raise InputError(f"{name} must be an int >= 0{'' if most is None else f' and at most {most}'}, got {value!r}")
