"""The argument checks of a call: rules over its facts, never over tensors, and the plan they give.

:func:`check` takes one :class:`~mm3.contract.facts.StepFacts` value and raises
:class:`InputError` naming the entry point and the argument the caller wrote,
or returns the :class:`Plan` the runner follows. It reads nothing but that
value (and what the value holds: the parameters, the bound backends'
capabilities and probe answers). The plan also says which *counts* (tokens,
decodes, rows) a later call may have and still pass every rule: the boundary
(:mod:`mm3.runtime.step`) keeps a target's plans under the facts engine
traffic does not change and compares each call's counts with its plan, so a
new batch shape costs a few int comparisons, not the rules. Nothing here
synchronises with a device; the data checks (page ids, lengths) are
:mod:`mm3.contract.contents`'.

The rules, in the order they are checked: the batch's tensors and host ints;
the caches; a layer's own promises (exact token count, the dtypes and device
it was built for, its capacity); what each hook needs (shapes against the
parameters, one device, the top-k buffer); then the limits each backend
declares and its probe on the step's device.

Example:
    >>> import torch, mm3
    >>> from mm3.testing.factories import make_case
    >>> from mm3.runtime.registry import default_registry
    >>> from mm3.runtime.step import describe
    >>> p = mm3.SparseAttentionParams(num_heads=2, num_kv_heads=1, head_dim=16,
    ...     num_index_heads=1, index_head_dim=16, block_size=16, topk=4)
    >>> case = make_case(p, decodes=[40], dtype="float32")
    >>> be = default_registry().get("cpu_ref")
    >>> buf = mm3.TopkBuffer.allocate(1, 1, 4)
    >>> facts = describe("demo", ("index_topk",), p, be, None, index_q=case.index_q, caches=case.caches,
    ...                  batch=case.batch, topk=buf)
    >>> plan = check(facts)
    >>> plan.convert_to, plan.max_decode_query_len == be.capabilities.max_decode_query_len
    (None, True)
    >>> check(facts._replace(params=p.model_copy(update={"index_head_dim": 32})))   # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mm3.contract.errors.InputError: demo: index cache keys have dim 16, params.index_head_dim is 32...
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from mm3.contract.buffers import dtype_name, in_storage_order, is_dense_storage
from mm3.contract.capabilities import Requirements
from mm3.contract.errors import InputError
from mm3.contract.facts import StepFacts, TensorFacts
from mm3.contract.hookspecs import INDEX_OPS, Op
from mm3.contract.kv_scales import FP8_KV_DTYPES
from mm3.contract.quant import FP8_UNSCALED, NVFP4, cache_fault, logical_dim
from mm3.contract.slots import slots_fault

__all__ = ["check", "Plan", "UNLIMITED", "check_layer_args", "overlaps_itself"]

_INDEX_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8)  # uint8: NVFP4


class Plan(NamedTuple):
    """What the runner does for calls whose facts match, and which counts such a call may have.

    ``convert_to``: the layout the attention reads a copy of the top-k buffer in (``None``: it reads the
    buffer as it is); ``index_via``: the layout the indexer writes a buffer in before it is copied into the
    caller's (``None``: it writes the caller's); ``sort_written``: the rows the index op wrote are sorted
    ascending, ``-1`` last, in place, before an attention reads them and before the call returns (the entry
    point or the attention needs that order and the indexer does not declare it); ``sort_read``: the
    attention reads a sorted copy of the rows the caller handed in (it needs ascending rows and the entry
    point does not promise them).

    The counts: a later call whose facts differ from the planned one only in its token count ``T``, its
    requests and its decodes passes every rule exactly when ``T <= max_tokens``, its decodes' query length
    is at most ``max_decode_query_len`` (or it has no decodes), each row-per-token input holds at least
    ``T`` rows (exactly ``T`` for ``q`` and ``index_q`` when ``exact_rows``: a layer's promise), the top-k
    buffer holds ``T`` to ``max_topk_rows`` rows (its memory order holds up to that many), and the batch's
    own shapes agree (:attr:`~mm3.contract.facts.BatchShape.consistent`). The boundary compares those
    ints every call (:mod:`mm3.runtime.step`); ``tests/test_plan.py`` holds the two to agreeing.
    """

    convert_to: Optional[str]
    index_via: Optional[str]
    sort_written: bool
    sort_read: bool
    max_decode_query_len: int
    max_tokens: int
    exact_rows: bool
    max_topk_rows: int


#: no limit (an int, so a plan compares ints only)
UNLIMITED = 2 ** 62


def check_layer_args(device: object, max_decode_query_len: object) -> torch.device:
    """Check a layer's construction arguments; returns ``torch.device(device)``.

    The device must parse and be usable in this process (a zero-size
    allocation on it succeeds): otherwise torch's own assertion would surface
    from deep inside the first buffer allocation.
    """
    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError) as e:
        raise InputError(f"device {device!r} is not a torch device: {e}") from None
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError, TypeError) as e:
        raise InputError(f"device {str(dev)!r} cannot be used in this process ({type(e).__name__}: {e}); "
                         f"pick a device this PyTorch build and machine provide") from None
    if not isinstance(max_decode_query_len, int) or isinstance(max_decode_query_len, bool) \
            or max_decode_query_len < 1:
        raise InputError(f"max_decode_query_len must be an int >= 1 (1, or 1 + draft tokens), got "
                         f"{max_decode_query_len!r}")
    return dev


def overlaps_itself(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when two elements of a tensor of ``shape``/``stride`` may share memory (an ``expand``-ed
    tensor). Sufficient test: with axes sorted by stride, each stride steps over the smaller ones."""
    extent = 1
    for st, sz in sorted((st, sz) for sz, st in zip(shape, stride) if sz > 1):
        if st < extent:
            return True
        extent = st * sz
    return False


def _shown(fmt: str, dtype: torch.dtype) -> Any:
    """A cache's (or a layer's) format as an error shows it: the dtype itself when the format is the dtype's."""
    return dtype if not fmt or fmt == dtype_name(dtype) else fmt


def _on(device: torch.device, want: torch.device) -> bool:
    """``device`` is ``want`` (a device without an index matches any of its type)."""
    return device.type == want.type and (want.index is None or device.index is None or device == want)


class _Rules:
    """The checks of one :class:`StepFacts` value; each method raises :class:`InputError`."""

    def __init__(self, f: StepFacts) -> None:
        self.f, self.n, self.p = f, f.names, f.params
        self.T = f.batch.num_tokens

    def fail(self, msg: str) -> InputError:
        return InputError(f"{self.f.entry}: {msg}")

    # -- the batch ------------------------------------------------------------------------------
    def batch(self) -> None:
        b, n = self.f.batch, self.n
        tensors = (("query_start_loc", 1), ("seq_lens", 1), ("block_table", 2), ("token_to_request", 1),
                   ("token_positions", 1), ("context_lens", 1))
        for field, dim in tensors:
            t: Optional[TensorFacts] = getattr(b, field)
            if t is None:
                continue
            if len(t.shape) != dim:
                raise self.fail(f"{getattr(n, field)} must be {dim}-D, got shape {tuple(t.shape)}")
            if t.dtype != torch.int32:
                raise self.fail(f"{getattr(n, field)} must be int32, got {t.dtype}; pass "
                                f"{getattr(n, field)}.to(torch.int32)")
        R, T = b.num_requests, self.T
        want = {"query_start_loc": (R + 1,), "block_table": (R, b.block_table.shape[1]), "token_to_request": (T,),
                "context_lens": (R,)}
        for field, shape in want.items():
            t = getattr(b, field)
            if t is not None and tuple(t.shape) != shape:
                raise self.fail(f"{getattr(n, field)} has shape {tuple(t.shape)}, expected {shape} for "
                                f"{R} requests ({n.seq_lens}) and {T} tokens")
        fault = None if b.slot_table is None else slots_fault(b.slot_table, b.slot_rows, R, n)
        if fault:
            raise self.fail(fault)
        if not 0 <= b.num_decodes <= R:
            raise self.fail(f"num_decodes={b.num_decodes} must be in [0, {R}] (the number of requests)")
        if b.num_decodes and b.decode_query_len < 1:
            raise self.fail(f"decode_query_len={b.decode_query_len} must be >= 1 (1, or 1 + draft tokens)")
        if not 0 <= b.num_decode_tokens <= min(T, b.num_decodes * b.decode_query_len):
            raise self.fail(f"num_decode_tokens={b.num_decode_tokens} does not fit {b.num_decodes} decodes of "
                            f"{b.decode_query_len} tokens in a step of {T} tokens")

    # -- the caches -------------------------------------------------------------------------------
    def caches(self) -> None:
        c, n = self.f.caches, self.n
        if len(c.k.shape) != 4 or c.k.shape != c.v.shape or c.k.dtype != c.v.dtype:
            raise self.fail(f"{n.k} {tuple(c.k.shape)} {c.k.dtype} and {n.v} {tuple(c.v.shape)} {c.v.dtype} must "
                            f"be alike, [num_pages, block_size, num_kv_heads, head_dim]")
        if len(c.index.shape) != 3 or tuple(c.index.shape[:2]) != tuple(c.k.shape[:2]):
            raise self.fail(f"{n.index} has shape {tuple(c.index.shape)}, expected [num_pages, block_size, "
                            f"index_head_dim] with the pages and block size of {n.k} {tuple(c.k.shape[:2])}")
        if c.index.dtype not in _INDEX_DTYPES:
            raise self.fail(f"{n.index} dtype {c.index.dtype} unsupported; use bfloat16 or float8_e4m3fn")
        devices = {c.k.device, c.v.device, c.index.device}
        if len(devices) != 1:
            raise self.fail(f"the caches live on different devices: {sorted(map(str, devices))}")
        quant = cache_fault(c.kv_format, c.index_format, (c.k.shape, c.k.dtype), (c.index.shape, c.index.dtype),
                            c.k_scale, (c.k_block_scale, c.v_block_scale, c.index_block_scale))
        if quant is not None:
            raise self.fail(quant)
        scaled = c.k.dtype in FP8_KV_DTYPES and c.kv_format != FP8_UNSCALED
        if (c.k_scale is None) != (c.v_scale is None) or scaled != (c.k_scale is not None):
            raise self.fail(f"{n.k_scale} and {n.v_scale} go with fp8 (float8_e4m3fn, float8_e5m2) K/V and only with it: got "
                            f"{c.k.dtype} K/V with {'no ' if c.k_scale is None else ''}scales")
        P, B, H = c.k.shape[:3]
        for name, s in ((n.k_scale, c.k_scale), (n.v_scale, c.v_scale)):
            if s is None:
                continue
            if s.dtype != torch.float32 or s.device != c.k.device or not (
                    tuple(s.shape) == (H,) or (len(s.shape) == 2 and s.shape[0] == H and s.shape[1] >= P * B)):
                raise self.fail(f"{name} must be float32 on {c.k.device}, [num_kv_heads={H}] or [num_kv_heads, "
                                f">= num_slots={P * B}]; got {s.dtype} {tuple(s.shape)} on {s.device}")
        if c.k_scale is not None and len(c.k_scale.shape) != len(c.v_scale.shape):  # type: ignore[union-attr]
            raise self.fail(f"{n.k_scale} and {n.v_scale}: both per token slot ([num_kv_heads, num_slots]) or "
                            f"neither")

    # -- a layer's promises -------------------------------------------------------------------------
    def layer(self) -> None:
        f, n, p, T = self.f, self.n, self.p, self.T
        L = f.layer
        if L is None:
            return
        if f.caches.k_scale is not None and len(f.caches.k_scale.shape) == 2:
            # selection knows nothing of them here: a backend that reads [Hkv] scales would misread them
            raise self.fail("caches hold K/V scales per token slot ([Hkv, num_slots]), which SparseAttention "
                            "does not select backends for: call the bound backend of one that declares "
                            "kv_slot_scales (mm3 backends), or use mm3.integrations.vllm, whose selection "
                            "requires them")
        given = [(n.q, f.q, (p.num_heads, p.head_dim), L.q_dtype or L.dtype), (n.index_q, f.index_q,
                 (p.num_index_heads, p.index_head_dim), L.dtype)]
        for name, t, tail, dtype in given:
            if t is None:     # a call of one op: the other op's query is not part of it
                continue
            if tuple(t.shape) != (T, *tail):
                what = "num_heads, head_dim" if name == n.q else "num_index_heads, index_head_dim"
                raise self.fail(f"{name} has shape {tuple(t.shape)}, expected {(T, *tail)} = [num_tokens, {what}]")
            if t.dtype != dtype:
                raise self.fail(f"{name} is {t.dtype} but this layer was built for {dtype}; cast it, or build the "
                                f"layer with the matching dtype")
            if not _on(t.device, L.device):
                raise self.fail(f"{name} is on {t.device} but the layer runs on {L.device}; move it with .to()")
        # formats, not dtypes: unscaled e4m3 and NVFP4 are formats of their own (mm3.contract.quant)
        c = f.caches
        cache_dtypes = [("the index cache", _shown(c.index_format, c.index.dtype), _shown(
            L.index_format, L.index_dtype), "index_dtype")] if f.index_q else []
        cache_dtypes += [("the k/v cache", _shown(c.kv_format, c.k.dtype), _shown(L.kv_format, L.kv_dtype),
                          "kv_dtype")] if f.q else []
        for name, dtype, want, arg in cache_dtypes:
            if dtype != want:
                raise self.fail(f"{name} is {dtype} but this layer was built for {want}; cast it, or build the "
                                f"layer with {arg}={dtype}")
        for name, dev in (("caches", f.caches.k.device), ("batch", f.batch.seq_lens.device)):
            if not _on(dev, L.device):
                raise self.fail(f"{name} is on {dev} but the layer runs on {L.device}; move it with .to()")
        if T > L.capacity:
            raise self.fail(f"the step has {T} tokens but the top-k buffer holds {L.capacity}; build the layer "
                            f"with max_num_tokens >= {T}")
        b = f.batch
        if b.num_decodes and b.decode_query_len > L.max_decode_query_len:
            raise self.fail(f"decode query length {b.decode_query_len} exceeds the layer's max_decode_query_len "
                            f"{L.max_decode_query_len}; if the first num_decodes={b.num_decodes} requests are "
                            f"decodes with draft tokens, build the layer with a larger one; if one of them is a "
                            f"prefill, the batch is not decode-first: put every decode before the first prefill")
        if f.out is not None and f.q is not None and (f.out.dtype != L.dtype or f.out.device != f.q.device):
            raise self.fail(f"{n.out} is {f.out.dtype} on {f.out.device}; needs {L.dtype} on {f.q.device}")

    # -- what the hooks need ----------------------------------------------------------------------
    def hooks(self) -> tuple[Optional[str], Optional[str], int]:
        f, n, p, T = self.f, self.n, self.p, self.T
        c, b = f.caches, f.batch
        B, H = c.k.shape[1], c.k.shape[2]
        if b.slot_table is not None and not (B == 1 and b.block_size == p.block_size):
            raise self.fail(f"token slots need caches of one-token pages ([num_slots, 1, Hkv, D]; {n.k} has pages "
                            f"of {B}) and the batch's block_size ({b.block_size}) = params.block_size ({p.block_size})")
        if b.slot_table is None and not B == b.block_size == p.block_size:
            raise self.fail(f"block sizes disagree: cache pages hold {B} tokens, the batch's block_size is "
                            f"{b.block_size}, params.block_size is {p.block_size}; the sparse block is the KV "
                            f"page, make them equal")
        if H != p.num_kv_heads:
            raise self.fail(f"the caches have {H} KV heads, params.num_kv_heads is {p.num_kv_heads}")
        rows: list[tuple[str, TensorFacts, tuple[int, ...]]] = []
        if INDEX_OPS.intersection(f.ops):
            assert f.index_q is not None
            rows.append((n.index_q, f.index_q, (p.num_index_heads, p.index_head_dim)))
            if logical_dim(c.index.shape[2], c.index_format) != p.index_head_dim:
                raise self.fail(f"index cache keys have dim {logical_dim(c.index.shape[2], c.index_format)}, "
                                f"params.index_head_dim is "
                                f"{p.index_head_dim}")
        if Op.ATTENTION in f.ops:
            assert f.q is not None and f.out is not None
            rows += [(n.q, f.q, (p.num_heads, p.head_dim)), (n.out, f.out, (p.num_heads, p.head_dim))]
            if logical_dim(c.k.shape[3], c.kv_format) != p.head_dim:
                raise self.fail(f"KV cache heads have dim {logical_dim(c.k.shape[3], c.kv_format)}"
                                f"{' (NVFP4: two per byte)' if c.kv_format == NVFP4 else ''}, params.head_dim is "
                                f"{p.head_dim}")
            # fp8 queries say nothing of the attention dtype: the output's dtype is it (docs/spec.md §1)
            att = f.out.dtype if f.q.dtype == torch.float8_e4m3fn else f.q.dtype
            if f.q.dtype == torch.float8_e4m3fn and att not in (torch.bfloat16, torch.float16, torch.float32):
                raise self.fail(f"{n.q} is float8_e4m3fn, so {n.out}'s dtype is the attention dtype: it must be "
                                f"bfloat16, float16 or float32, got {f.out.dtype}")
            if c.k.dtype != att and c.k_scale is None and c.kv_format not in (FP8_UNSCALED, NVFP4):
                raise self.fail(f"the KV cache dtype {c.k.dtype} differs from {n.q}'s {f.q.dtype}"
                                f"{'' if att == f.q.dtype else f' (fp8 queries: from the output dtype {att})'}; cast one "
                                f"of them, or store K/V in fp8 (float8_e4m3fn, float8_e5m2) with k_scale/v_scale, "
                                f"unscaled e4m3 or NVFP4 (PagedKVCache kv_format)")
            if f.out.dtype != att:
                raise self.fail(f"{n.out} dtype {f.out.dtype} differs from {n.q}'s {f.q.dtype}; the output is in "
                                f"{n.q}'s dtype (in out's own, bfloat16/float16/float32, for float8_e4m3fn queries)")
        for name, t, tail in rows:
            if len(t.shape) != 1 + len(tail) or tuple(t.shape[1:]) != tail or t.shape[0] < T:
                what = "num_heads, head_dim" if tail == (p.num_heads, p.head_dim) else \
                    "num_index_heads, index_head_dim"
                raise self.fail(f"{name} has shape {tuple(t.shape)}; needs [>= {T}, {', '.join(map(str, tail))}] = "
                                f"[>= the step's tokens, {what}]: one row per token of the batch, heads as params "
                                f"say")
        written = None if f.out is None else (T, *f.out.shape[1:])
        if Op.INDEX_SCORES in f.ops:
            written = self.scores()
        if written is not None and f.out.stride is not None and overlaps_itself(written, f.out.stride):  # type: ignore[union-attr]
            raise self.fail(f"{n.out} has strides {f.out.stride} for shape {tuple(f.out.shape)}: several of its "
                            f"elements share memory (an expand()-ed or as_strided tensor), so writes would "
                            f"collide; pass a tensor with its own memory per element")
        dev = c.k.device
        placed = [(name, t.device) for name, t, _ in rows] + [
            (n.block_table, b.block_table.device), (n.query_start_loc, b.query_start_loc.device),
            (n.seq_lens, b.seq_lens.device), (n.token_positions, b.token_positions.device),
            (n.token_to_request, b.token_to_request.device)]
        placed += [] if b.slot_table is None else [(n.slot_table, b.slot_table.device), (n.slot_rows, b.slot_rows.device)]  # type: ignore[union-attr]
        placed += [(n.topk, f.topk.device)] if f.topk is not None else [(n.out, f.out.device)]  # type: ignore[union-attr]
        for name, d in placed:
            if d != dev:
                raise self.fail(f"{name} is on {d} but the caches are on {dev}; move every input of the step to "
                                f"one device (tensor.to(device), batch.to(device))")
        return self.topk()

    def scores(self) -> tuple[int, ...]:
        """The block scores ``index_scores`` writes: float32 ``[Hidx, >= T, >= 1]``; returns the written shape."""
        f, n, p, T = self.f, self.n, self.p, self.T
        o = f.out
        assert o is not None
        if o.dtype != torch.float32 or len(o.shape) != 3 or o.shape[0] != p.num_index_heads or o.shape[1] < T \
                or o.shape[2] < 1:
            raise self.fail(f"{n.out} is {o.dtype} {tuple(o.shape)}; block scores need float32 [num_index_heads="
                            f"{p.num_index_heads}, >= {T} tokens, >= 1 block]")
        return (o.shape[0], T, o.shape[2])

    def topk(self) -> tuple[Optional[str], Optional[str], int]:
        """``(convert_to, index_via, max_topk_rows)`` of the :class:`Plan`."""
        f, n, p, T = self.f, self.n, self.p, self.T
        s, layout = f.topk, f.topk_layout
        if s is None:     # block scores: no top-k buffer
            return None, None, UNLIMITED
        head_major = layout == "head_major"
        if s.dtype != torch.int32 or len(s.shape) != 3:
            raise self.fail(f"{n.topk} must be 3-D int32, got {s.dtype} {tuple(s.shape)}")
        H, rows, K = (s.shape[0], s.shape[1], s.shape[2]) if head_major else (s.shape[1], s.shape[0], s.shape[2])
        order = "[H, T, K]" if head_major else "[T, H, K]"
        if (H, K) != (p.num_kv_heads, p.topk):
            raise self.fail(f"{n.topk} is {layout} storage {order} = {tuple(s.shape)}, but the step needs "
                            f"[H={p.num_kv_heads}, T>={T}, K={p.topk}] (num_kv_heads, tokens, topk): a tensor in the "
                            f"other layout ([T, H, K] token-major memory read as [H, T, K], or the reverse) is "
                            f"vLLM's MiniMax-M3 bug; pass the logical [H, T, K] view of your memory")
        if rows < T:
            raise self.fail(f"{n.topk} holds {rows} rows but the step has {T} tokens; pass rows(0, T) of a buffer "
                            f"sized for the most tokens per step")
        if not in_storage_order(s.shape, s.stride):  # type: ignore[arg-type]
            raise self.fail(f"{n.topk} of shape {tuple(s.shape)} has strides {s.stride}: its memory is not in "
                            f"{layout} order {order}, so a kernel would write other tokens' rows")
        dense = is_dense_storage(s.shape, s.stride)  # type: ignore[arg-type]
        # a backend that needs a dense buffer in its own layout gets one, copied (the trace says so)
        via = [be.capabilities.topk_layout if be is not None and not be.capabilities.accepts_topk(layout, dense)
               else None for be in (f.attention, f.indexer)]
        # head-major memory stays in order and dense while the head stride steps over every row
        st = s.stride
        most = UNLIMITED if not head_major or H == 1 else st[0] // max(st[1], K, 1)  # type: ignore[index]
        return via[0], via[1], most

    def order(self) -> tuple[bool, bool]:
        """``(sort_written, sort_read)`` of the :class:`Plan`: the order the entry point and the attention
        need of a row's ids, against the order the indexer declares it writes them in."""
        f = self.f
        want = f.topk_order
        if want not in (None, "ascending"):
            raise self.fail(f"the entry point asks for top-k rows in {want!r} order; the core establishes "
                            f"'ascending' (or leaves rows as written: None), no other order")
        if f.topk is None:    # block scores: no rows
            return False, False
        need = None if f.attention is None else f.attention.capabilities.topk_order_required
        if Op.INDEX_TOPK in f.ops and f.indexer is not None:
            return f.indexer.capabilities.topk_order != "ascending" and "ascending" in (want, need), False
        # an attention alone reads the caller's rows, in the order the entry point promises of them
        return False, need == "ascending" and want != "ascending"

    # -- what the backends declare ---------------------------------------------------------------
    def declared(self) -> int:
        """The declared limits and probes; returns the longest decode query every op's backend takes."""
        f, p, b = self.f, self.p, self.f.batch
        most = UNLIMITED
        device = f.caches.k.device
        dql = b.decode_query_len if b.num_decodes else 1
        for op in f.ops:
            be = f.attention if op == Op.ATTENTION else f.indexer
            x = f.q if op == Op.ATTENTION else f.index_q
            assert x is not None
            if be is None:    # an op no bound backend provides: the caller does its work
                continue
            caps = be.capabilities
            most = min(most, caps.max_decode_query_len)
            probe = be.probe(device)
            if not probe.available:
                raise self.fail(f"backend {caps.name!r} cannot run on {device} here: {probe.reason}")
            # model_construct: these values come from tensors, not users; a dtype no backend
            # declares must reach unmet() and be named there, not fail validation here.
            fp8_q = op == Op.ATTENTION and x.dtype == torch.float8_e4m3fn and f.out is not None
            req = Requirements.model_construct(
                device_type=device.type, ops=frozenset({op}), dtype=dtype_name(f.out.dtype if fp8_q else x.dtype),  # type: ignore[union-attr]
                query_dtype="float8_e4m3fn" if fp8_q else None,
                index_cache_dtype=f.caches.index_format, kv_cache_dtype=f.caches.kv_format,
                head_dim=p.head_dim, index_head_dim=p.index_head_dim, block_size=p.block_size, topk=p.topk,
                gqa_group=p.gqa_group, decode_query_len=dql,
                addressing="pages" if b.slot_table is None else "slots",
                kv_slot_scales=f.caches.k_scale is not None and len(f.caches.k_scale.shape) == 2)
            reasons = caps.unmet(req)
            if op in INDEX_OPS and dtype_name(x.dtype) not in caps.dtypes:
                reasons.append(f"{self.n.index_q} dtype {x.dtype} not in {sorted(caps.dtypes)}")
            if reasons:
                raise self.fail(f"{'; '.join(reasons)}: outside what backend {caps.name!r} declares for {op.value}; "
                                f"choose another backend or change the input")
        return most


def check(facts: StepFacts) -> Plan:
    """Raise :class:`InputError` for the first rule ``facts`` breaks; else the :class:`Plan` for calls like it.

    A pure function of ``facts``. The plan holds for every call whose facts equal these but for the
    counts it lists (:class:`Plan`), so the boundary keeps it under the facts that stay.
    """
    rules = _Rules(facts)
    rules.batch()
    rules.caches()
    rules.layer()
    convert_to, index_via, topk_rows = rules.hooks()
    sort_written, sort_read = rules.order()
    most = rules.declared()
    L = facts.layer
    if L is not None:
        most = min(most, L.max_decode_query_len)
    return Plan(convert_to, index_via, sort_written, sort_read, most, UNLIMITED if L is None else L.capacity,
                L is not None, topk_rows)

