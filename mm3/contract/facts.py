"""What the checks of a call read, as immutable values.

:class:`StepFacts` holds everything the argument rules
(:func:`mm3.contract.checks.check`) look at — the shapes, dtypes, devices and,
where a rule needs them, strides of every input, the batch's host ints, the
parameters, the bound backends and, for a layer, what it was built for — and
nothing else: the rules take this value alone, so a rule cannot read a fact
that is not part of it. They return a :class:`~mm3.contract.checks.Plan`, which
says, for every later call whose facts differ only in its counts (tokens,
requests, decodes), which counts it admits; the boundary
(:mod:`mm3.runtime.step`) keeps the plans of a bound target under the facts
that engine traffic does not change. Tensor *contents* (page ids, lengths)
are not facts: they are judged on the device (:mod:`mm3.contract.contents`).

:class:`BatchShape` and :class:`CacheFacts` are what a batch and a cache object
work out about themselves once, when built, so a step reads them instead of
their tensors; both are kept by exactly the facts they are worked out from
(every tensor's shape, dtype and device, compared whole; never a tensor's
identity), so the wrappers made anew for every call (the custom ops', the
drop-ins') read them back. :class:`ArgNames` says how the caller spells each
argument, so an error names the function and the argument the caller wrote
(``minimax_m3_sparse_attn: output ...``), not mm3's internal names.

Example:
    >>> import torch
    >>> a, b = torch.zeros(4, 2, 8), torch.ones(4, 2, 8)
    >>> TensorFacts(a.shape, a.dtype, a.device) == TensorFacts(b.shape, b.dtype, b.device)  # contents are no fact
    True
    >>> batch_kind(num_requests=3, num_decodes=2, decode_query_len=1)
    'mixed'
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from mm3.contract.quant import index_format_of, kv_format_of

__all__ = ["TensorFacts", "CacheFacts", "BatchFacts", "BatchShape", "LayerFacts", "StepFacts", "ArgNames",
           "batch_kind", "tensor_facts", "cache_facts", "topk_facts", "batch_shape", "LAYER_NAMES", "OPS_NAMES"]


def batch_kind(num_requests: int, num_decodes: int, decode_query_len: int) -> str:
    """``"decode"``, ``"prefill"``, ``"mixed"`` or ``"empty"``, with ``"speculative "`` in front when the
    decodes carry draft tokens (``decode_query_len > 1``).

    Example:
        >>> batch_kind(3, 2, 2), batch_kind(4, 0, 1)
        ('speculative mixed', 'prefill')
    """
    if num_requests <= 0:
        return "empty"
    kind = "decode" if num_decodes == num_requests else "prefill" if num_decodes == 0 else "mixed"
    return f"speculative {kind}" if num_decodes and decode_query_len > 1 else kind


class TensorFacts(NamedTuple):
    """Shape, dtype and device of one tensor, and its strides where a rule reads them (else ``None``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    stride: Optional[tuple[int, ...]] = None


def tensor_facts(t: Optional[torch.Tensor], stride: bool = False) -> Optional[TensorFacts]:
    """The facts of ``t`` (``None`` for ``None``), with its strides when ``stride``."""
    if t is None:
        return None
    return TensorFacts(t.shape, t.dtype, t.device, t.stride() if stride else None)


class CacheFacts(NamedTuple):
    """The paged caches: K, V, index keys, and the K/V scales (``None`` when unscaled)."""

    k: TensorFacts
    v: TensorFacts
    index: TensorFacts
    k_scale: Optional[TensorFacts]
    v_scale: Optional[TensorFacts]
    #: what K/V and the index keys hold (mm3.contract.quant: a dtype's name, "float8_e4m3fn_unscaled", "nvfp4")
    kv_format: str = ""
    index_format: str = ""
    #: NVFP4's per-16 e4m3 scales of K, V and the index keys (``None`` for other formats)
    k_block_scale: Optional[TensorFacts] = None
    v_block_scale: Optional[TensorFacts] = None
    index_block_scale: Optional[TensorFacts] = None


#: CacheFacts by the shapes, dtypes and devices they are made of: one object per value, so a step compares
#: it with its plan's by identity (an engine's caches keep their facts for the process)
_CACHE_FACTS: dict[tuple[Any, ...], CacheFacts] = {}
#: the last caches' key and facts (one tuple, swapped whole), compared before the dict is hashed
_LAST_CACHE: tuple[tuple[Any, ...], Optional[CacheFacts]] = ((), None)


def _scale_key(t: object) -> Optional[tuple[Any, ...]]:
    return (t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None


def cache_facts(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, k_scale: object,
                v_scale: object, k_block_scale: object = None, v_block_scale: object = None,
                index_block_scale: object = None) -> CacheFacts:
    """The facts of a cache's tensors (a scale that is not a tensor has none); kept by exactly what they are
    read from (the custom ops and drop-ins make one per call)."""
    global _LAST_CACHE
    key: tuple[Any, ...] = (k.shape, k.dtype, k.device, v.shape, v.dtype, v.device, index.shape, index.dtype,
                            index.device)
    if k_scale is not None or v_scale is not None:
        key += (_scale_key(k_scale), _scale_key(v_scale))
    if k_block_scale is not None or v_block_scale is not None or index_block_scale is not None:
        key += ("block", _scale_key(k_block_scale), _scale_key(v_block_scale), _scale_key(index_block_scale))
    last = _LAST_CACHE
    if key == last[0]:          # the last call's caches (every layer of an engine has caches of one kind)
        return last[1]  # type: ignore[return-value]
    got = _CACHE_FACTS.get(key)
    if got is None:
        if len(_CACHE_FACTS) >= 1024:
            _CACHE_FACTS.clear()
        got = _CACHE_FACTS[key] = _cache_facts(k, v, index, k_scale, v_scale, k_block_scale, v_block_scale,
                                               index_block_scale)
    _LAST_CACHE = (key, got)
    return got


def _cache_facts(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, k_scale: object, v_scale: object,
                 k_block_scale: object, v_block_scale: object, index_block_scale: object) -> CacheFacts:
    ks = TensorFacts(k_scale.shape, k_scale.dtype, k_scale.device) if isinstance(k_scale, torch.Tensor) else None
    vs = TensorFacts(v_scale.shape, v_scale.dtype, v_scale.device) if isinstance(v_scale, torch.Tensor) else None
    kb = vb = ib = None
    if k_block_scale is not None or v_block_scale is not None or index_block_scale is not None:   # NVFP4
        kb, vb, ib = (TensorFacts(s.shape, s.dtype, s.device) if isinstance(s, torch.Tensor) else None
                      for s in (k_block_scale, v_block_scale, index_block_scale))
    return CacheFacts(TensorFacts(k.shape, k.dtype, k.device), TensorFacts(v.shape, v.dtype, v.device),
                      TensorFacts(index.shape, index.dtype, index.device), ks, vs,
                      kv_format_of(k.dtype, ks is not None), index_format_of(index.dtype), kb, vb, ib)


def topk_facts(storage: torch.Tensor, layout: str) -> tuple[Any, ...]:
    """What a plan is keyed by for a top-k buffer: its layout, and its storage's dtype, device, strides
    and shape with the token axis counted as 1 or 2 (how many rows a step uses is a count)."""
    shape = list(storage.shape)
    axis = 1 if layout == "head_major" else 0
    shape[axis] = min(shape[axis], 2)
    return (layout, storage.dtype, storage.device, tuple(shape), storage.stride())


class BatchFacts(NamedTuple):
    """The batch's host ints and its tensors' facts (``context_lens``: ``None`` until derived)."""

    num_decodes: int
    decode_query_len: int
    block_size: int
    num_decode_tokens: int
    max_prefill_query_len: int
    query_start_loc: TensorFacts
    seq_lens: TensorFacts
    block_table: TensorFacts
    token_to_request: TensorFacts
    token_positions: TensorFacts
    context_lens: Optional[TensorFacts]
    #: token slots (docs/spec.md §2): the slot table and each request's row of it; ``None`` for pages
    slot_table: Optional[TensorFacts] = None
    slot_rows: Optional[TensorFacts] = None

    @property
    def num_tokens(self) -> int:
        return self.token_positions.shape[0] if len(self.token_positions.shape) == 1 else -1

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0] if len(self.seq_lens.shape) == 1 else -1


class BatchShape(NamedTuple):
    """What a batch object says of itself, worked out once when it is built (every layer of a step reads it).

    ``key``: the facts no engine's traffic changes (the block size, and each tensor's dtype, device and
    number of dims; ``None`` for context lengths the batch derives itself), part of the key of a bound
    target's plans. The counts a step compares with its plan: ``num_tokens`` (``T``),
    ``num_requests`` (``R``), ``num_decodes``, ``decode_query_len``. ``consistent``: the batch's own
    shape rules hold (``query_start_loc`` ``[R + 1]``, ``block_table`` ``[R, M]``, the per-token
    tensors ``[T]``, decodes and decode tokens that fit, a slot row per request); when not, a step runs
    every rule, which names the broken one. ``host``: the block table lives in host memory. ``kind``:
    :func:`batch_kind`. ``width``: the block table's columns (token slots: the slot table's).
    ``addressing``: ``"pages"`` or ``"slots"`` (:data:`~mm3.contract.capabilities.Addressing`).
    """

    key: tuple[Any, ...]
    num_tokens: int
    num_requests: int
    num_decodes: int
    decode_query_len: int
    kind: str
    consistent: bool
    host: bool
    #: what an error about the batch's contents names: no tensor (a fault is raised after its step, and a
    #: tensor kept past its step would be an allocation a CUDA graph's pool does not own)
    block_size: int = 0
    width: int = 0
    num_decode_tokens: int = 0
    max_prefill_query_len: int = 0
    addressing: str = "pages"


_KEYS: dict[tuple[Any, ...], tuple[Any, ...]] = {}
#: the last batch's facts and its shape: ``(facts, shape)`` (one tuple, swapped whole: a reader on another thread
#: sees one pair or the other). The layers of a step, and the two custom ops of each, build their batches of
#: the same tensors: every one after the first compares its facts with these and reads the shape back
_LAST_SHAPE: tuple[tuple[Any, ...], Optional[BatchShape]] = ((), None)
#: the shapes of the batches seen, by their facts (a few hundred bytes each; emptied when full)
_SHAPES: dict[tuple[Any, ...], BatchShape] = {}
#: how many items of a batch's facts (:func:`batch_facts_key`) come before a slot table's
BATCH_KEY_LEN = 23


def batch_facts_key(qsl: torch.Tensor, sl: torch.Tensor, bt: torch.Tensor, t2r: torch.Tensor, pos: torch.Tensor,
                    ctx: Optional[torch.Tensor], num_decodes: int, decode_query_len: int, num_decode_tokens: int,
                    block_size: int, max_prefill_query_len: int, slot_table: Optional[torch.Tensor] = None,
                    slot_rows: Optional[torch.Tensor] = None) -> tuple[Any, ...]:
    """Everything :func:`batch_shape` reads of a batch, as one tuple (compared whole, never by a tensor's
    identity): each tensor's shape, then their dtypes, then their devices (``None`` for context lengths the
    batch derives), the five host ints and, for token slots, the slot table's and rows' shape, dtype and
    device."""
    if ctx is None:
        key: tuple[Any, ...] = (qsl.shape, sl.shape, bt.shape, t2r.shape, pos.shape, None, qsl.dtype, sl.dtype,
                                bt.dtype, t2r.dtype, pos.dtype, None, qsl.device, sl.device, bt.device, t2r.device,
                                pos.device, None, num_decodes, decode_query_len, num_decode_tokens, block_size,
                                max_prefill_query_len)
    else:
        key = (qsl.shape, sl.shape, bt.shape, t2r.shape, pos.shape, ctx.shape, qsl.dtype, sl.dtype, bt.dtype,
               t2r.dtype, pos.dtype, ctx.dtype, qsl.device, sl.device, bt.device, t2r.device, pos.device, ctx.device,
               num_decodes, decode_query_len, num_decode_tokens, block_size, max_prefill_query_len)
    if slot_table is not None:
        key += (slot_table.shape, slot_table.dtype, slot_table.device,
                slot_rows.shape, slot_rows.dtype, slot_rows.device)  # type: ignore[union-attr]
    return key


def batch_shape(qsl: torch.Tensor, sl: torch.Tensor, bt: torch.Tensor, t2r: torch.Tensor, pos: torch.Tensor,
                ctx: Optional[torch.Tensor], num_decodes: int, decode_query_len: int, num_decode_tokens: int,
                block_size: int, max_prefill_query_len: int, slot_table: Optional[torch.Tensor] = None,
                slot_rows: Optional[torch.Tensor] = None) -> BatchShape:
    """A batch's :class:`BatchShape` from its tensors and host ints (``ctx``: ``None`` when derived;
    ``slot_table``/``slot_rows``: a batch of token slots): :func:`shape_of_facts` of their
    :func:`batch_facts_key`."""
    return shape_of_facts(batch_facts_key(qsl, sl, bt, t2r, pos, ctx, num_decodes, decode_query_len,
                                          num_decode_tokens, block_size, max_prefill_query_len, slot_table,
                                          slot_rows))


def shape_of_facts(key: tuple[Any, ...]) -> BatchShape:
    """The :class:`BatchShape` of a batch of facts ``key`` (:func:`batch_facts_key`): the last one's again when
    ``key`` equals the last batch's facts (item by item, no hashing), else one of the same facts seen before
    (an engine's steps come back to the same counts), else worked out from ``key`` alone."""
    global _LAST_SHAPE
    last = _LAST_SHAPE
    if key == last[0]:
        return last[1]  # type: ignore[return-value]
    got = _SHAPES.get(key)
    if got is None:
        if len(_SHAPES) >= 1024:
            _SHAPES.clear()
        got = _SHAPES[key] = _work_out(key, last[1])
    _LAST_SHAPE = (key, got)
    return got


_new_tuple = tuple.__new__


def _work_out(key: tuple[Any, ...], last: Optional[BatchShape]) -> BatchShape:
    """:class:`BatchShape` from the facts alone (:func:`batch_facts_key`'s order); ``last``: the last batch's
    shape, whose :attr:`~BatchShape.key` (and so whether the block table is in host memory) is this one's too
    when only counts changed, as from one step of an engine to the next."""
    sq, ss, sb, st, sp, sc = key[:6]
    nd, dql, ndt, block_size, mpql = key[18:BATCH_KEY_LEN]
    dq, db, dt, dp = len(sq), len(sb), len(st), len(sp)
    T = sp[0] if dp == 1 else -1
    R = ss[0] if len(ss) == 1 else -1
    # the facts no engine's traffic changes: the dtypes and devices, the block size, each tensor's dims
    static = key[6:18] + (block_size, dq, len(ss), db, dt, dp, None if sc is None else len(sc))
    slots = len(key) > BATCH_KEY_LEN
    if slots:
        sts, std, stv, srs, srd, srv = key[BATCH_KEY_LEN:]
        static += (std, stv, len(sts), srd, srv, len(srs))
    if last is not None and static == last.key:
        static, host = last.key, last.host      # one object per value: a step compares it by identity
    else:
        got = _KEYS.get(static)
        if got is None:
            if len(_KEYS) >= 1024:
                _KEYS.clear()
            got = _KEYS[static] = static
        static, host = got, key[14].type == "cpu"     # the block table's device
    consistent = (T >= 0 and R >= 0 and dq == 1 and sq[0] == R + 1 and db >= 1 and sb[0] == R and dt == 1
                  and st[0] == T and (sc is None or (len(sc) >= 1 and sc[0] == R)) and 0 <= nd <= R
                  and (not nd or dql >= 1) and 0 <= ndt <= min(T, nd * dql))
    width = sb[1] if db == 2 else 0
    if slots:
        consistent = consistent and srs == (R,) and len(sts) == 2
        width = sts[1] if len(sts) == 2 else 0
    # the fields in order, without BatchShape's keyword-taking constructor (a Python function)
    return _new_tuple(BatchShape, (static, T, R, nd, dql, batch_kind(R, nd, dql), consistent, host, block_size,
                                   width, ndt, mpql, "slots" if slots else "pages"))


class LayerFacts(NamedTuple):
    """What a layer was built for (a layer's step must match it; other entry points have none)."""

    dtype: torch.dtype
    index_dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    capacity: int
    max_decode_query_len: int
    #: the K/V and index formats when quantized (mm3.contract.quant), else "" (the dtypes above say it)
    kv_format: str = ""
    index_format: str = ""
    #: the query's dtype when it is not ``dtype`` (fp8 queries; the output stays in ``dtype``)
    q_dtype: Optional[torch.dtype] = None


class ArgNames(NamedTuple):
    """How an entry point's caller spells each input (errors name these).

    ``where_made``: where the caller's batch tensors come from, so advice about their contents
    points there (``BatchMetadata.build(...)``, or vLLM's metadata).
    """

    q: str = "q"
    index_q: str = "index_q"
    out: str = "out"
    topk: str = "the top-k buffer"
    k: str = "caches.k"
    v: str = "caches.v"
    index: str = "caches.index"
    k_scale: str = "caches.k_scale"
    v_scale: str = "caches.v_scale"
    query_start_loc: str = "batch.query_start_loc"
    seq_lens: str = "batch.seq_lens"
    context_lens: str = "batch.context_lens"
    block_table: str = "batch.block_table"
    token_to_request: str = "batch.token_to_request"
    token_positions: str = "batch.token_positions"
    where_made: str = "BatchMetadata.build(...), which checks them where they are made"
    slot_table: str = "batch.slot_table"
    slot_rows: str = "batch.slot_rows"


LAYER_NAMES = ArgNames()
"""The layer's and a bound backend's spelling (``SparseAttention.forward``, ``Backend.index_topk``)."""
OPS_NAMES = ArgNames(topk="topk", k="k", v="v", index="index", k_scale="k_scale", v_scale="v_scale",
                     query_start_loc="query_start_loc", seq_lens="seq_lens", context_lens="context_lens",
                     block_table="block_table", slot_table="slot_table", slot_rows="slot_rows",
                     token_to_request="token_to_request",
                     token_positions="token_positions",
                     where_made="mm3.runtime.ops.batch_args(batch) of a BatchMetadata")
"""``torch.ops.mm3.*``'s spelling: their schema's argument names."""


class StepFacts(NamedTuple):
    """Everything the checks of one call read (:func:`mm3.contract.checks.check`), typed.

    ``ops``: the hooks the call runs (a layer's step runs both). ``indexer`` /
    ``attention``: the bound backends of those ops (objects fixed for the
    process: their capabilities and probe answers are what the checks read);
    ``indexer`` is the one of an index op (``index_topk`` or ``index_scores``),
    ``None`` for an op no bound backend provides (the caller does its work).
    ``layer``: a layer's own promises, ``None`` for other entry points.
    ``out``: the call's output tensor (the attention's, or the block scores of
    ``index_scores``); ``topk``: the top-k buffer, ``None`` for a call that has
    none (``index_scores``). ``topk_order``: the order of the top-k rows at
    the entry point, ``"ascending"`` or ``None`` (any): what it requires of the
    rows an index op writes for it, and what it promises of the rows it hands
    an attention (SGLang's functions: ascending, their engine's convention).

    The boundary builds it only when a step's facts match no plan of its target
    (:mod:`mm3.runtime.step`): at a target's first call, and when something
    an engine's traffic does not change (a dtype, a device, a head count, the
    caches) changed.
    """

    entry: str
    names: ArgNames
    ops: tuple[str, ...]
    params: Any
    indexer: Any
    attention: Any
    layer: Optional[LayerFacts]
    index_q: Optional[TensorFacts]
    q: Optional[TensorFacts]
    out: Optional[TensorFacts]
    topk_layout: Optional[str]
    topk: Optional[TensorFacts]
    caches: CacheFacts
    batch: BatchFacts
    topk_order: Optional[str] = None

