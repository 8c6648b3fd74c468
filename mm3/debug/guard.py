"""The contract guard: check every backend call against docs/spec.md, name the culprit.

A backend that breaks the top-k contract must fail *here*, with a message
naming it, not three kernels later with an illegal memory access or silently
wrong tokens (which is how MiniMax-M3 failed in vLLM, docs/spec.md §5).
The step's boundary (:mod:`mm3.runtime.step`) runs a hook call through
:func:`checked_call` — the same call, with checks around it — by default for
the first eager call of each op and kind of batch (``check_contracts="first"``;
``"always"``: every eager call); a checked call that breaks a rule raises
:class:`~mm3.contract.errors.ContractViolation` naming the backend, the hook, the rule
and the first offending row (head, token, the row's content). A checked call
synchronises with the device once.

Rules (``ContractViolation.rule``; docs/errors.md has the full table):

==============================  =============================================================
``alloc.type`` ... ``alloc.shape``  ``alloc_topk_buffer`` returns an int32 :class:`TopkBuffer`
                                of the asked ``[H, T, K]`` on the asked device
``alloc.layout``                its label is the declared ``topk_layout`` (that its *memory*
                                is in that order, :class:`TopkBuffer` itself enforces)
``topk.unwritten``              every slot of the step's rows was written (the guard fills
                                them with :data:`GUARD_SENTINEL` before the call)
``topk.padding``                padding tokens' rows are all ``-1``
``topk.range``                  every id is ``-1`` or a visible block in ``[0, nb)``
``topk.prefix``                 exactly ``min(K, nb)`` ids as a prefix, then ``-1``
``topk.unique``                 no id twice in a row
``topk.forced``                 the forced init/local blocks are all present
``topk.order``                  an indexer that declares ``topk_order="ascending"`` writes
                                each row's ids increasing, then ``-1``
``topk.rows_past_T``            ``index_topk`` wrote nothing outside its step's rows
``attention.input_layout``      a ``topk_requires_contiguous`` backend got a dense buffer
                                in its layout (else the *caller* broke the contract)
``attention.topk_written``      ``attention_forward`` did not write the top-k buffer
``attention.out_past_T``        it wrote nothing outside ``out[:T]``
``attention.out_replaced``      ``out`` kept its shape, dtype, device and storage
``attention.unwritten``         every element of ``out[:T]`` was written (the guard fills it
                                with a marked NaN before the call)
``attention.padding``           padding tokens' outputs are exactly zero
``attention.nonfinite``         outputs are finite wherever the row's inputs (its ``q`` row
                                and the K/V of its selected blocks up to its position) are
``scores.unwritten``            ``index_scores`` wrote every element of its ``out``
``scores.outside``              it wrote nothing outside ``out``
``scores.hidden``               a block a token does not see (and a padding token's row) holds ``-inf``
``scores.nan``                  no NaN (a NaN block scores ``-1e30``)
``scores.forced``               the forced init / local blocks hold ``1e30`` / ``1e29``
==============================  =============================================================

The guard checks what a backend wrote and returned, never the call's
arguments: those were admitted before any hook runs, guarded or not.

How: everything is vectorised torch on the whole step (one ``[H, T]`` rule
code per row, a byte-exact snapshot of the storage around the writable
rows) and the host synchronises once per call, to read a few flags; the
slow path that finds and describes the first offending row only runs when a
rule is broken. A freshly allocated top-k buffer is filled with
:data:`GUARD_SENTINEL` so a stray write past ``T`` always changes a value,
and before each checked call the rows the call must write are filled too
(the step's top-k rows with the sentinel, ``out[:T]`` with a marked NaN), so
a backend that returns without writing them is caught whatever they held.
Under CUDA-graph capture the guard steps aside (it cannot synchronise there).

The guard's own cost per step is measured by ``benchmarks/guard_overhead.py``
(docs/errors.md has the figures).

Example:
    >>> import torch, mm3
    >>> from mm3.runtime.config import Settings
    >>> from mm3.runtime.layer import SparseAttention
    >>> from mm3.testing.factories import make_case
    >>> p = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16,
    ...     num_index_heads=2, index_head_dim=16, block_size=16, topk=4)
    >>> layer = SparseAttention(p, dtype=torch.float32, max_num_tokens=64, backend="cpu_ref",
    ...     settings=Settings(check_contracts="always"))
    >>> case = make_case(p, decodes=[70, 40], prefills=[(9, 30)], dtype="float32")
    >>> layer(case.q, case.index_q, case.caches, case.batch).shape   # every call checked, and fine
    torch.Size([11, 4, 16])
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.errors import ContractViolation
from mm3.contract.hookspecs import Op
from mm3.contract.params import SparseAttentionParams
from mm3.contract.topk_order import ASCENDING_FIX
from mm3.debug.fences import Fence, false_flag, locate, mark_unwritten, still_marked
from mm3.debug.inputs import finite_inputs
from mm3.debug.score_rows import describe_score, score_codes
from mm3.debug.topk_rows import GUARD_SENTINEL, describe_row, row_codes

__all__ = ["GUARD_SENTINEL", "RULES", "checked_call", "fill_sentinel", "check_topk_allocation", "capturing"]

RULES: dict[str, str] = {
    "alloc.type": "alloc_topk_buffer must return an mm3.TopkBuffer",
    "alloc.dtype": "the top-k buffer must be int32",
    "alloc.device": "the top-k buffer must live on the requested device",
    "alloc.shape": "the top-k buffer must be [H, T, K] as requested",
    "alloc.layout": "the top-k buffer's layout label must be the declared topk_layout",
    "topk.unwritten": "index_topk writes every slot of the step's rows [0, T)",
    "topk.padding": "a padding token's row must be all -1",
    "topk.range": "every id must be -1 or a visible block in [0, nb)",
    "topk.prefix": "a row holds exactly min(K, nb) ids as a prefix, then -1",
    "topk.unique": "a row holds each block id at most once",
    "topk.forced": "a row holds every forced init/local block",
    "topk.order": 'an indexer that declares topk_order="ascending" writes each row ascending, -1 last',
    "topk.rows_past_T": "index_topk writes only the step's rows [0, T) of the buffer",
    "attention.input_layout": "a topk_requires_contiguous backend gets a dense buffer in its layout",
    "attention.topk_written": "attention_forward must not write the top-k buffer",
    "attention.out_past_T": "attention_forward writes only out[:T]",
    "attention.out_replaced": "attention_forward writes into out in place (same shape/dtype/storage)",
    "attention.unwritten": "attention_forward writes every element of out[:T]",
    "attention.padding": "a padding token's output must be zeros",
    "attention.nonfinite": "outputs are finite where the row's inputs are finite",
    "scores.unwritten": "index_scores writes every element of out",
    "scores.outside": "index_scores writes only out",
    "scores.hidden": "a block the token does not see (every block of a padding token) scores -inf",
    "scores.nan": "a NaN block scores -1e30 (docs/spec.md §3.4), never NaN",
    "scores.forced": "the forced init / local blocks score 1e30 / 1e29",
}
"""Every rule the guard checks: ``ContractViolation.rule`` -> what it demands."""


# -- errors ------------------------------------------------------------------------------------

def _violation(backend: Any, hook: str, rule: str, detail: str, *, head: Optional[int] = None,
               token: Optional[int] = None, row: Optional[list[int]] = None,
               fix: str = "") -> ContractViolation:
    """A :class:`ContractViolation` with a uniform message and the facts as attributes."""
    name = getattr(backend, "name", str(backend))
    source = getattr(backend, "source", None)
    origin = f" ({source})" if source is not None else ""
    msg = (f"backend {name!r}{origin} broke the mm3 contract in {hook}: rule {rule} "
           f"({RULES[rule]}): {detail}")
    if fix:
        msg += f". {fix[0].upper()}{fix[1:]}"
    exc = ContractViolation(msg)
    # Structured facts for tests and tooling (the message is for people).
    exc.backend = name  # type: ignore[attr-defined]
    exc.hook = hook  # type: ignore[attr-defined]
    exc.rule = rule  # type: ignore[attr-defined]
    exc.head = head  # type: ignore[attr-defined]
    exc.token = token  # type: ignore[attr-defined]
    exc.row = row  # type: ignore[attr-defined]
    return exc


# -- the top-k buffer: allocation ------------------------------------------------------------

def check_topk_allocation(buf: Any, *, layout: str, num_tokens: int, num_heads: int, topk: int,
                          device: Union[str, torch.device], backend: Any = "caller",
                          hook: str = "alloc_topk_buffer") -> TopkBuffer:
    """Raise :class:`ContractViolation` unless ``buf`` is the buffer that was asked for.

    Checks type, dtype, device, ``[H, T, K]`` and the layout label (that the
    memory is in the labelled order, :class:`TopkBuffer` checked when it was
    built). Returns ``buf``. No device sync.

    Example:
        >>> b = TopkBuffer.allocate(8, 2, 4, "token_major")
        >>> check_topk_allocation(b, layout="token_major", num_tokens=8, num_heads=2, topk=4,
        ...                       device="cpu") is b
        True
        >>> check_topk_allocation(b, layout="head_major", num_tokens=8, num_heads=2, topk=4,
        ...                       device="cpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        mm3.contract.errors.ContractViolation: backend 'caller' broke the mm3 contract in alloc_topk_buffer: rule alloc.layout ...
    """
    if not isinstance(buf, TopkBuffer):
        raise _violation(backend, hook, "alloc.type", f"got {type(buf).__name__}",
                         fix="wrap the logical [H, T, K] view of the memory: TopkBuffer(view)")
    if buf.storage.dtype != torch.int32:
        raise _violation(backend, hook, "alloc.dtype", f"got {buf.storage.dtype}")
    want = torch.device(device)
    got = buf.device
    if got.type != want.type or (want.index is not None and got.index != want.index):
        raise _violation(backend, hook, "alloc.device", f"asked for {want}, got {got}")
    if (buf.num_heads, buf.num_tokens, buf.topk) != (num_heads, num_tokens, topk):
        raise _violation(backend, hook, "alloc.shape",
                         f"asked for [H={num_heads}, T={num_tokens}, K={topk}], got "
                         f"[H={buf.num_heads}, T={buf.num_tokens}, K={buf.topk}]")
    if buf.layout != layout:
        raise _violation(backend, hook, "alloc.layout",
                         f"capabilities declare topk_layout={layout!r} but the buffer is labelled "
                         f"{buf.layout!r}", fix="make the allocation and the declaration agree")
    return buf


# -- the wrapper -----------------------------------------------------------------------------------

def capturing(t: torch.Tensor) -> bool:
    """True inside CUDA-graph capture, where the guard cannot synchronise (nor anything pay for it)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def checked_call(backend: Any, op: str, args: tuple[Any, ...], *, check_finite: bool = True) -> None:
    """Run ``backend.invoke(op, args)`` — the very call a step makes — and check what it wrote and left.

    ``args`` are the hook's arguments in its spec's order (:mod:`mm3.contract.hookspecs`). Failures raise
    :class:`~mm3.contract.errors.ContractViolation` (see :data:`RULES`) naming the
    backend, the hook, the rule and the first offending row. Inside CUDA-graph
    capture the call runs unchecked (the checks must synchronise).
    ``check_finite``: check ``attention.nonfinite`` (one pass over ``out``).

    Example:
        >>> from mm3.runtime.registry import default_registry
        >>> from mm3.testing.factories import make_case
        >>> from mm3.testing.fixtures import default_params
        >>> p = default_params()
        >>> case = make_case(p, decodes=[40], prefills=[(5, 20)], dtype="float32")
        >>> be = default_registry().get("cpu_ref")
        >>> buf = fill_sentinel(be.alloc_topk_buffer(64, p.num_kv_heads, p.topk, "cpu"))
        >>> checked_call(be, "index_topk", (case.index_q, case.caches, case.batch, p, buf.rows(0, 6), None))
    """
    if op == "index_topk":
        _checked_index(backend, *args)
    elif op == "index_scores":
        _checked_scores(backend, *args)
    else:
        _checked_attention(backend, *args, check_finite=check_finite)


def fill_sentinel(buf: TopkBuffer) -> TopkBuffer:
    """``buf`` filled with :data:`GUARD_SENTINEL` (not a plausible id): every later stray write past a
    step's rows changes a value the guard can see."""
    return buf.fill_(GUARD_SENTINEL)


def _checked_index(be: Any, index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                   params: SparseAttentionParams, out: TopkBuffer, page_faults: Optional[torch.Tensor]) -> None:
    """The indexer's call, with ``topk.*`` rules checked on rows ``[0, T)`` afterwards."""
    args = (index_q, caches, batch, params, out, page_faults)
    if capturing(out.storage):
        return be.invoke(Op.INDEX_TOPK, args)
    T = batch.num_tokens
    step = out.rows(0, T)
    fence = Fence(out.storage, step.storage)
    step.fill_(GUARD_SENTINEL)   # what the call leaves unwritten breaks topk.unwritten
    be.invoke(Op.INDEX_TOPK, args)

    hm = step.head_major()
    codes = row_codes(hm, batch.token_positions, params, be.capabilities.topk_order == "ascending") if T else None
    any_bad = codes.any() if codes is not None else false_flag(out.device)
    past_rows, bad_rows = torch.stack([fence.changed(), any_bad]).tolist()  # the one host sync
    if bad_rows:
        assert codes is not None
        v = describe_row(codes, hm, batch, params)
        raise _violation(be, "index_topk", v.rule, v.detail, head=v.head, token=v.token,
                         row=v.row, fix=ASCENDING_FIX if v.rule == "topk.order" else _layout_hint(out))
    if past_rows:
        e, before, after = fence.first_change()
        sh, st, sk = out.strides()
        where = locate(e, out.storage.storage_offset(), (sh, st, sk), ("head", "token", "slot"),
                        (out.num_heads, 1 << 62, out.topk))
        was = f"{before} (the guard's sentinel)" if before == GUARD_SENTINEL else str(before)
        raise _violation(be, "index_topk", "topk.rows_past_T",
                         f"the step has T={T} tokens but {where} of the persistent buffer changed "
                         f"from {was} to {after}; out is rows(0, {T}) of it",
                         fix="size grids from batch.num_tokens and index through out.strides()")


def _checked_scores(be: Any, index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                    params: SparseAttentionParams, out: torch.Tensor, page_faults: Optional[torch.Tensor]) -> None:
    """The block scores' call, with ``scores.*`` rules checked afterwards (``out``: the step's ``[H, T, N]``)."""
    args = (index_q, caches, batch, params, out, page_faults)
    if capturing(out):
        return be.invoke(Op.INDEX_SCORES, args)
    fence = Fence(out, out)
    mark_unwritten(out)    # what the call leaves unwritten breaks scores.unwritten
    be.invoke(Op.INDEX_SCORES, args)
    codes = score_codes(out, batch.token_positions, params)
    outside, bad = torch.stack([fence.changed().to(out.device), codes.any()]).tolist()   # the one host sync
    if bad:
        v = describe_score(codes, out, batch, params)
        raise _violation(be, "index_scores", v.rule, v.detail, head=v.head, token=v.token)
    if outside:
        e, _, _ = fence.first_change()
        raise _violation(be, "index_scores", "scores.outside",
                         f"element {e} of out's storage changed, outside the step's {tuple(out.shape)} scores",
                         fix="write out[h, t, b] through out's strides, for t < batch.num_tokens and b < "
                             "out.shape[2] only")


def _layout_hint(buf: TopkBuffer) -> str:
    if buf.num_heads > 1:
        return (f"If only mixed batches with H > 1 fail, suspect a layout mix-up: this buffer is "
                f"{buf.layout} with (h, t, k) strides {buf.strides()}; index it through "
                f"buf.strides() or buf.head_major(), never through an assumed layout")
    return ""


def _checked_attention(be: Any, q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer, batch: BatchMetadata,
                       params: SparseAttentionParams, out: torch.Tensor, *, check_finite: bool) -> None:
    """The attention's call, with ``attention.*`` rules checked afterwards."""
    args = (q, caches, topk, batch, params, out)
    if capturing(q):
        return be.invoke(Op.ATTENTION, args)
    caps = be.capabilities
    if not caps.accepts_topk(topk.layout, topk.is_dense()):
        raise _violation(
            be, "attention_forward", "attention.input_layout",
            f"the caller passed a {'dense' if topk.is_dense() else 'non-dense'} {topk.layout} "
            f"buffer but the backend declares topk_requires_contiguous with "
            f"topk_layout={caps.topk_layout!r} (the caller, not the backend, broke the contract)",
            fix=f"convert it first: buf.to_layout({caps.topk_layout!r})")
    T = batch.num_tokens
    shape, dtype, ptr = tuple(out.shape), out.dtype, out.data_ptr()
    out_fence = Fence(out, out[:T])
    topk_fence = Fence(topk.storage, None)
    marked = mark_unwritten(out[:T])   # what the call leaves unwritten breaks attention.unwritten
    be.invoke(Op.ATTENTION, args)

    if (tuple(out.shape), out.dtype, out.data_ptr()) != (shape, dtype, ptr):
        raise _violation(be, "attention_forward", "attention.out_replaced",
                         f"out was {list(shape)} {dtype} at {ptr:#x}, is now {list(out.shape)} "
                         f"{out.dtype} at {out.data_ptr():#x}",
                         fix="write into out (out.copy_(...), out[...] = ...), never resize or re-set it")
    rows = out[:T]
    # Padding is read from the device positions, not from host lengths: a batch refreshed
    # in place with update_ (graph replay) keeps stale host lengths. No boolean-mask
    # indexing either: it would synchronise.
    pad = batch.token_positions < 0
    pad_rows = (pad & (rows != 0).flatten(1).any(-1)) if T else None
    pad_bad = pad_rows.any() if pad_rows is not None else false_flag(out.device)
    nonfinite = (~torch.isfinite(rows)).any() if (check_finite and T) else false_flag(out.device)
    unwritten = still_marked(rows).flatten(1).any(-1) if marked else None
    flags = torch.stack([out_fence.changed().to(out.device), topk_fence.changed().to(out.device),
                         unwritten.any() if unwritten is not None else false_flag(out.device),
                         pad_bad, nonfinite])
    out_past, topk_written, not_written, padding, nonfin = flags.tolist()   # the one host sync
    hook = "attention_forward"
    if out_past:
        e, before, after = out_fence.first_change()
        where = locate(e, out.storage_offset(), out.stride(), ("token", "head", "dim"),
                        (1 << 62, out.shape[1], out.shape[2]))
        raise _violation(be, hook, "attention.out_past_T",
                         f"the step has T={T} tokens but {where} of out changed (bits {before:#x} "
                         f"-> {after:#x})", token=None,
                         fix="size grids from batch.num_tokens; write only out[:T]")
    if topk_written:
        e, before, after = topk_fence.first_change()
        sh, st, sk = topk.strides()
        where = locate(e, topk.storage.storage_offset(), (sh, st, sk), ("head", "token", "slot"),
                        (topk.num_heads, topk.num_tokens, topk.topk))
        raise _violation(be, hook, "attention.topk_written",
                         f"{where} of the top-k buffer changed from {before} to {after}",
                         fix="the attention only reads the top-k buffer")
    if not_written:
        assert unwritten is not None
        t = int(unwritten.nonzero()[0, 0])
        n = int(unwritten.sum())
        raise _violation(be, hook, "attention.unwritten",
                         f"token {t} (request {int(batch.token_to_request[t])}, position "
                         f"{int(batch.token_positions[t])}) of out[:{T}] still holds the marked NaN "
                         f"the guard filled it with before the call: it was not written"
                         + (f"; {n} of {T} tokens" if n > 1 else ""), token=t,
                         fix="write every row of out[:T], zeros for padding tokens (out is not "
                             "zeroed for you)")
    if padding:
        assert pad_rows is not None
        t = int(pad_rows.nonzero()[0, 0])
        raise _violation(be, hook, "attention.padding",
                         f"token {t} is a padding token (request {int(batch.token_to_request[t])}, "
                         f"no position) but its output is not zero (first values "
                         f"{rows[t].flatten()[:4].tolist()})", token=t,
                         fix="write zeros for tokens whose position is -1")
    if nonfin:
        _attribute_nonfinite(be, q, caches, topk, batch, params, rows)

def _attribute_nonfinite(be: Any, q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer,
                         batch: BatchMetadata, params: SparseAttentionParams,
                         rows: torch.Tensor) -> None:
    """Raise if some non-finite output row had only finite inputs (docs/spec.md §4: garbage in, garbage out)."""
    real = batch.token_positions >= 0
    bad = (~torch.isfinite(rows)).any(-1) & real[:, None]           # [T, Hq]
    pairs = bad.nonzero()
    if not pairs.numel():
        return
    hm = topk.head_major()
    ok = finite_inputs(q, caches, hm, batch, params, pairs[:, 0], pairs[:, 1])
    if not bool(ok.any()):
        return
    i = int(ok.nonzero()[0, 0])
    t, g = int(pairs[i, 0]), int(pairs[i, 1])
    h = g // params.gqa_group
    row = [int(v) for v in hm[h, t].tolist()]
    n = int(ok.sum())
    raise _violation(
        be, "attention_forward", "attention.nonfinite",
        f"token {t} (request {int(batch.token_to_request[t])}, position "
        f"{int(batch.token_positions[t])}), query head {g} (KV head {h}, selected blocks {row}): "
        f"output {rows[t, g, :4].tolist()}... is not finite although q and the selected K/V are"
        + (f"; {n} such (token, head) rows" if n > 1 else ""),
        head=h, token=t, row=row, fix="accumulate in fp32 and mask positions past the token")
