"""The decode-first mixed batch of one step (docs/spec.md §2), built and validated once.

Requests ``0 .. num_decodes-1`` are decodes, each with the same query length
``decode_query_len`` (1, or 1 + draft tokens), or padding rows; the rest are
prefills of any length, possibly a later chunk of a long prompt.

Two kinds of padding decode exist, both common inside CUDA graphs:

* ``query_len == 0``: the request holds no token of the step;
* ``seq_len == 0`` with ``query_len == decode_query_len``: the request keeps its
  slots in the flat batch, but they are padding tokens (position ``-1``): their
  top-k rows are all ``-1`` and their outputs are zero.

Example:
    >>> import torch
    >>> bt = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    >>> b = BatchMetadata.build(query_lens=[1, 1, 5], seq_lens=[300, 129, 5],
    ...                         block_table=bt, block_size=128, num_decodes=2)
    >>> b.num_tokens, b.num_decode_tokens, b.token_positions.tolist()
    (7, 2, [299, 128, 0, 1, 2, 3, 4])
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence, Union

import torch

from mm3.contract.errors import InputError
from mm3.contract.page_ids import check_page_ids

__all__ = ["BatchMetadata"]

IntSeq = Union[Sequence[int], torch.Tensor]
_INT32_MIN, _INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def _to_list(name: str, v: IntSeq) -> list[int]:
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.is_floating_point():
            raise InputError(f"{name} must be a 1-D integer tensor or list, got {v.dtype} {tuple(v.shape)}")
        return [int(x) for x in v.tolist()]
    try:
        out = [int(x) for x in v]
    except (TypeError, ValueError) as e:
        raise InputError(f"{name} must be a sequence of ints: {e}") from None
    return out


@dataclass(frozen=True)
class BatchMetadata:
    """Per-step batch description; all tensors int32 on ``device``.

    Build it with :meth:`build`. Host-side copies (``query_lens``, ``seq_lens_host``)
    are kept for validation and for kernels that size grids on the host.
    """

    num_decodes: int
    decode_query_len: int
    query_lens: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    block_size: int
    query_start_loc: torch.Tensor   # [R + 1]
    seq_lens: torch.Tensor          # [R]
    context_lens: torch.Tensor      # [R]
    block_table: torch.Tensor       # [R, max_blocks]
    token_to_request: torch.Tensor  # [T]
    token_positions: torch.Tensor   # [T]; -1 marks a padding token

    # -- derived facts ---------------------------------------------------------
    # Sums over the host tuples are cached: every layer, backend and check of a
    # step asks for them, and the tuples never change (``update_`` keeps them).
    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def num_prefills(self) -> int:
        return self.num_requests - self.num_decodes

    @cached_property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))

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

    @property
    def device(self) -> torch.device:
        return self.seq_lens.device

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
        if not self.num_requests:
            return "empty"
        kind = "mixed" if self.num_decodes and self.num_prefills else \
            "decode" if self.num_decodes else "prefill"
        return f"speculative {kind}" if self.num_decodes and self.decode_query_len > 1 else kind

    # -- construction ----------------------------------------------------------------
    @classmethod
    def build(cls, query_lens: IntSeq, seq_lens: IntSeq, block_table: torch.Tensor, *,
              block_size: int, num_decodes: Optional[int] = None,
              is_decode: Optional[Sequence[bool]] = None,
              decode_query_len: Optional[int] = None,
              num_pages: Optional[int] = None,
              device: Union[str, torch.device, None] = None) -> "BatchMetadata":
        """Validate per-request lengths and build the step's metadata.

        Give either ``num_decodes`` (decodes are the first requests) or
        ``is_decode`` (one flag per request; must be decodes-first). When
        ``num_pages`` is given, every block-table entry a request uses is
        checked to lie in ``[0, num_pages)``.
        """
        ql = _to_list("query_lens", query_lens)
        sl = _to_list("seq_lens", seq_lens)
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
        if not (0 <= num_decodes <= n):
            raise InputError(f"num_decodes={num_decodes} must be in [0, {n}] (number of requests)")
        if not isinstance(block_size, int) or block_size <= 0:
            raise InputError(f"block_size must be a positive int, got {block_size!r}")

        for r, (q, s) in enumerate(zip(ql, sl)):
            if q < 0 or s < 0:
                raise InputError(f"request {r}: negative length (query_len={q}, seq_len={s})")
            if s > _INT32_MAX:
                raise InputError(f"request {r}: seq_len {s} does not fit int32 (max {_INT32_MAX})")
        dec_q = sorted({q for q in ql[:num_decodes] if q > 0})
        if len(dec_q) > 1:
            raise InputError(
                f"decode query lengths must be uniform (1, or 1 + draft tokens) or 0 for padding; "
                f"got lengths {dec_q}; run speculative and plain decodes with the same length")
        if decode_query_len is None:
            decode_query_len = dec_q[0] if dec_q else 1
        elif dec_q and dec_q[0] != decode_query_len:
            raise InputError(f"decodes have query length {dec_q[0]} but decode_query_len={decode_query_len}")
        if decode_query_len < 1:
            raise InputError(f"decode_query_len must be >= 1, got {decode_query_len}")
        for r in range(n):
            q, s = ql[r], sl[r]
            is_dec = r < num_decodes
            if is_dec and s == 0:
                continue  # padding decode
            if not is_dec and q < 1:
                raise InputError(f"prefill request {r} has query_len {q}; prefills need >= 1 token "
                                 f"(drop empty requests, or list them among the decodes as padding)")
            if s < q:
                raise InputError(f"request {r}: seq_len {s} < query_len {q}; seq_len counts the cache "
                                 f"tokens including this step's")

        if not isinstance(block_table, torch.Tensor):
            try:  # no dtype here: a float list must be rejected below, not truncated
                block_table = torch.as_tensor(block_table)
            except (TypeError, ValueError, RuntimeError) as e:
                raise InputError(f"block_table must be a 2-D integer tensor or a rectangular nested list "
                                 f"of ints: {e}") from None
            if block_table.numel() == 0:
                block_table = block_table.to(torch.int32)  # [] / [[]] carry no dtype information
        if block_table.dim() != 2 or block_table.shape[0] != n:
            raise InputError(f"block_table must be [num_requests={n}, max_blocks], got {tuple(block_table.shape)}")
        if block_table.is_floating_point() or block_table.is_complex():
            raise InputError(f"block_table must hold integer page ids, got {block_table.dtype}")
        if block_table.dtype != torch.int32 and block_table.numel():
            # Stored as int32: a wider id would wrap around silently (one host sync, only here).
            lo, hi = int(block_table.min()), int(block_table.max())
            if lo < _INT32_MIN or hi > _INT32_MAX:
                raise InputError(f"block_table holds {hi if hi > _INT32_MAX else lo}, which does not fit "
                                 f"the int32 page ids mm3 uses")
        dev = torch.device(device) if device is not None else block_table.device
        max_blocks = block_table.shape[1]
        for r, s in enumerate(sl):
            need = -(-s // block_size)
            if need > max_blocks:
                raise InputError(
                    f"request {r}: seq_len {s} needs {need} blocks of {block_size} but block_table has "
                    f"only {max_blocks} columns; widen the block table")

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
        i32 = dict(dtype=torch.int32, device=dev)
        ctx = [max(s - q, 0) if not (r < num_decodes and s == 0) else 0 for r, (q, s) in enumerate(zip(ql, sl))]
        batch = cls(
            num_decodes=num_decodes,
            decode_query_len=decode_query_len,
            query_lens=tuple(ql),
            seq_lens_host=tuple(sl),
            block_size=block_size,
            query_start_loc=torch.tensor(starts, **i32),
            seq_lens=torch.tensor(sl, **i32),
            context_lens=torch.tensor(ctx, **i32),
            block_table=block_table.to(**i32).contiguous(),
            token_to_request=torch.tensor(tok_req, **i32),
            token_positions=torch.tensor(tok_pos, **i32),
        )
        if num_pages is not None:
            check_page_ids(batch, num_pages, hint=False)
        return batch

    def to(self, device: Union[str, torch.device]) -> "BatchMetadata":
        """The same batch with its tensors on ``device``."""
        fields = {f: getattr(self, f).to(device) for f in
                  ("query_start_loc", "seq_lens", "context_lens", "block_table",
                   "token_to_request", "token_positions")}
        return BatchMetadata(num_decodes=self.num_decodes, decode_query_len=self.decode_query_len,
                             query_lens=self.query_lens, seq_lens_host=self.seq_lens_host,
                             block_size=self.block_size, **fields)

    def update_(self, other: "BatchMetadata") -> "BatchMetadata":
        """Copy ``other``'s tensors into this batch's tensors in place (for CUDA-graph replay).

        Shapes must match (same requests, tokens and block-table width); the host-side
        lengths of ``self`` are *not* changed, so only use this where kernels size their
        grids from shapes alone (the decode path).
        """
        for f in ("query_start_loc", "seq_lens", "context_lens", "block_table",
                  "token_to_request", "token_positions"):
            dst, src = getattr(self, f), getattr(other, f)
            if dst.shape != src.shape:
                raise InputError(f"update_: {f} shape {tuple(src.shape)} != captured {tuple(dst.shape)}")
            dst.copy_(src)
        return self

    def __repr__(self) -> str:
        return (f"BatchMetadata(requests={self.num_requests}, decodes={self.num_decodes} "
                f"x q{self.decode_query_len}, prefills={self.num_prefills}, tokens={self.num_tokens}, "
                f"max_seq_len={self.max_seq_len}, device={self.device})")
