"""vLLM's MiniMax-M3 arguments as mm3's objects: the step's batch, the caches, the top-k views.

What :mod:`mm3.integrations.vllm` builds from the tensors vLLM passes, without copying them and
without a device-to-host copy (so each is safe inside CUDA-graph capture): a decode batch from
``seq_lens`` and ``decode_query_len``, a prefill batch from ``cu_seqlens_q`` and ``seq_lens``
(:meth:`~mm3.BatchMetadata.from_device`), the K and V views of vLLM's combined
``[num_blocks, num_kv_heads, B, 2 * head_dim]`` cache, its scales, and
:class:`~mm3.TopkBuffer` wrappers of the caller's top-k views. Every error is an
:class:`~mm3.InputError` naming the function and the argument.

Example:
    >>> import torch
    >>> sl = torch.tensor([40, 0, 17], dtype=torch.int32)           # the middle request is padding
    >>> b = decode_batch("f", sl, torch.zeros(3, 4, dtype=torch.int32), 2, 6, 16, graph=False)
    >>> b.token_positions.tolist(), b.context_lens.tolist()
    ([38, 39, -1, -1, 15, 16], [38, 0, 15])
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.errors import InputError
from mm3.contract.facts import ArgNames
from mm3.contract.kv_scales import check_kv_dtype, is_slot_scale, kv_scale_view

__all__ = ["FP8_DTYPES", "VLLM_NAMES", "DECODE_NAMES", "cdiv", "tensor_arg", "int32_arg", "check_heads", "topk_view",
           "out_rows", "decode_batch", "prefill_batch", "index_caches", "attention_caches", "kept", "MAX_KEPT",
           "stand_in"]

FP8_DTYPES = {d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                                             "float8_e5m2fnuz")) if d is not None}
"""The fp8 dtypes vLLM's ops accept (mm3 reads ``float8_e4m3fn`` and ``float8_e5m2`` K/V, says so for the others)."""


VLLM_NAMES = ArgNames(q="q", index_q="idx_q", out="output", topk="topk_idx", k="kv_cache", v="kv_cache",
                      index="index_kv_cache", k_scale="k_scale", v_scale="v_scale", query_start_loc="cu_seqlens_q",
                      seq_lens="seq_lens", context_lens="prefix_lens", block_table="block_table",
                      token_to_request="the tokens' requests (from cu_seqlens_q)",
                      token_positions="the tokens' positions (from seq_lens and cu_seqlens_q)",
                      where_made="the attention metadata vLLM built for this step")
"""vLLM's spelling of the prefill ops' arguments (errors name these)."""
DECODE_NAMES = VLLM_NAMES._replace(query_start_loc="decode_query_len (the tokens of each request)",
                                   token_positions="the tokens' positions (from seq_lens and decode_query_len)")
"""vLLM's spelling of the decode ops' arguments (their batch is ``seq_lens.shape[0]`` requests of
``decode_query_len`` tokens)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- arguments ---------------------------------------------------------------------------------

def tensor_arg(fn: str, name: str, t: object, dim: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != dim:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise InputError(f"{fn}: {name} must be a {dim}-D tensor {what}, got {got}")
    return t


def int32_arg(fn: str, name: str, t: object, dim: int, what: str) -> torch.Tensor:
    t = tensor_arg(fn, name, t, dim, what)
    if t.dtype != torch.int32:
        raise InputError(f"{fn}: {name} must be int32, got {t.dtype} (pass {name}.to(torch.int32))")
    return t


def check_heads(fn: str, name: str, got: int, num_kv_heads: int) -> None:
    if got != num_kv_heads:
        raise InputError(f"{fn}: {name} has {got} heads but num_kv_heads={num_kv_heads}; MiniMax-M3 has one "
                         f"index head per KV head")


def topk_view(fn: str, name: str, view: object) -> TopkBuffer:
    """``view`` (the logical ``[H, T, K]`` view of the caller's top-k memory) as a :class:`~mm3.TopkBuffer`,
    its errors named as vLLM's argument ``name`` of ``fn``."""
    try:
        return TopkBuffer(view)  # type: ignore[arg-type]
    except InputError as e:
        raise InputError(f"{fn}: {name}: {e}") from None


def out_rows(fn: str, out: Optional[torch.Tensor], heads: int, num_tokens: int, topk: int,
              device: torch.device) -> torch.Tensor:
    """``out[:, :num_tokens]`` (vLLM's stable-address top-k output), or a new head-major tensor."""
    if out is None:
        return torch.empty((heads, num_tokens, topk), dtype=torch.int32, device=device)
    tensor_arg(fn, "out", out, 3, f"[num_kv_heads={heads}, >= {num_tokens} tokens, topk={topk}]")
    if out.shape[0] != heads or out.shape[1] < num_tokens or out.shape[2] != topk:
        raise InputError(f"{fn}: out has shape {tuple(out.shape)}, needs [{heads}, >= {num_tokens}, {topk}] "
                         f"(num_kv_heads, tokens, topk)")
    return out if out.shape[1] == num_tokens else out[:, :num_tokens]   # a slice is a torch op: host time


# -- device-resident constants -----------------------------------------------------------------
# Kept only when made outside CUDA-graph capture: a tensor filled by a captured kernel holds its
# values only once the graph replays, so it cannot serve eager calls. One read inside capture pins an
# entry for the process: the graph reads its tensors at every replay, so they must never be freed.
_KEPT: dict[tuple[object, ...], Any] = {}
_PINNED: dict[tuple[object, ...], Any] = {}
#: constants and templates kept before the cache starts over (the pinned ones stay)
MAX_KEPT = 4096
_I32 = torch.int32
_new = object.__new__


def _keep(key: tuple[object, ...], value: Any) -> None:
    if len(_KEPT) >= MAX_KEPT:
        _KEPT.clear()
    _KEPT[key] = value


def _kept(key: tuple[object, ...], graph: bool) -> Any:
    """What is kept under ``key`` (``None``: nothing); read inside capture (``graph``), it is pinned."""
    got = _KEPT.get(key)
    if got is None:
        return _PINNED.get(key)
    if graph:
        _PINNED[key] = got
    return got


def kept(key: tuple[object, ...], graph: bool, make: Callable[..., tuple[torch.Tensor, ...]],
          *args: object) -> tuple[torch.Tensor, ...]:
    """The constants ``make(*args)`` kept under ``key`` (made anew inside capture, and then not kept)."""
    got = _kept(key, graph)
    if got is None:
        got = make(*args)
        if not graph:
            _keep(key, got)
    return got


def stand_in(dtype: torch.dtype, device: torch.device, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """One element, never read, seen as ``shape``: the cache an op does not use (K/V of an index op...); kept
    with :func:`kept` by its dtype, device and shape."""
    return (torch.zeros(1, dtype=dtype, device=device).expand(shape),)


def _unit_scale(device: torch.device) -> tuple[torch.Tensor, ...]:
    return (torch.ones(1, dtype=torch.float32, device=device),)


# -- the step's metadata -----------------------------------------------------------------------

def decode_batch(fn: str, seq_lens: object, block_table: object, decode_query_len: int, num_tokens: int,
                  block_size: int, graph: bool) -> BatchMetadata:
    """``R = seq_lens.shape[0]`` decodes of ``decode_query_len`` tokens, built on the device (one small kernel,
    two with draft tokens).

    Every call of a pair builds one, so the host work is what a new shape needs and no more: the arguments
    in one test (their messages only when it fails), and the batch as a copy of a template kept per
    ``(R, decode_query_len, block_size, block-table width, devices)`` (its constants and its facts, which
    are the same for every batch of that description; the index and the attention call of a step share
    it), given this call's ``seq_lens``, ``block_table`` and positions."""
    sl: Any = seq_lens
    bt: Any = block_table
    try:
        (R,) = sl.shape
        rows, W = bt.shape
        ok = sl.dtype is _I32 and bt.dtype is _I32
    except (AttributeError, TypeError, ValueError):
        ok = False
    dql = decode_query_len
    if not (ok and rows == R and type(dql) is int and dql >= 1 and num_tokens == R * dql):
        R, W = _decode_args(fn, sl, bt, dql, num_tokens)
    key = ("decode", R, dql, block_size, W, sl.device, bt.device)
    got = _kept(key, graph)
    if got is None:
        got = _decode_template(sl, bt, R, dql, num_tokens, block_size, graph)
        if not graph:
            _keep(key, got)
    template, offsets = got
    # position of draft i of request r: seq_len - dql + i; below 0 is padding (-1), as vLLM's kernels read it.
    # Each small kernel costs about a microsecond of a captured step (and one of host time): with one query
    # token seq_len - 1 is -1 for a padding request (seq_len 0) already, so one op and no clamp, and the
    # context lengths, which no decode kernel reads, are derived only if something asks for them
    if dql == 1:
        pos = sl - 1
    else:
        pos = torch.add(sl.unsqueeze(1), offsets).clamp_(min=-1).view(num_tokens)  # type: ignore[arg-type]
    batch = _new(BatchMetadata)
    batch.__dict__.update(template, seq_lens=sl, block_table=bt, token_positions=pos)
    return batch


def _decode_args(fn: str, seq_lens: object, block_table: object, dql: object, num_tokens: int) -> tuple[int, int]:
    """:func:`decode_batch`'s arguments checked one by one (each message names what is wrong): ``(R, width)``."""
    sl = int32_arg(fn, "seq_lens", seq_lens, 1, "[num_reqs]")
    bt = int32_arg(fn, "block_table", block_table, 2, "[num_reqs, max_blocks]")
    R = sl.shape[0]
    if bt.shape[0] != R:
        raise InputError(f"{fn}: block_table has {bt.shape[0]} rows for {R} requests (seq_lens)")
    if not isinstance(dql, int) or dql < 1 or num_tokens != R * dql:
        raise InputError(f"{fn}: {num_tokens} query tokens for {R} requests of decode_query_len={dql}; a decode "
                         f"batch holds num_reqs * decode_query_len tokens")
    return R, bt.shape[1]


def _decode_template(sl: torch.Tensor, bt: torch.Tensor, R: int, dql: int, T: int, block_size: int,
                     graph: bool) -> tuple[dict[str, object], Optional[torch.Tensor]]:
    """What every decode batch of this description holds but its ``seq_lens``, ``block_table`` and positions
    (:meth:`~mm3.BatchMetadata.assemble`'s fields, those three left empty), and the draft offsets."""
    dev = sl.device
    if dql == 1:    # views of one kept arange (per power of two of requests): no kernel for a new R
        (ar,) = kept(("arange", 1 << R.bit_length(), dev), graph, _arange, 1 << R.bit_length(), dev)
        qsl, tok_req, offsets = ar[:R + 1], ar[:R], None
    else:
        qsl = torch.arange(R + 1, dtype=_I32, device=dev) * dql
        tok_req = torch.arange(T, dtype=_I32, device=dev) // dql
        offsets = torch.arange(dql, dtype=_I32, device=dev) - dql
    # the token requests stand in for the positions: what a batch's facts read of them is the same
    made = BatchMetadata.assemble(qsl, sl, None, bt, tok_req, tok_req, num_decodes=R, decode_query_len=dql,
                                  num_decode_tokens=T, max_prefill_query_len=0, block_size=block_size,
                                  max_query_len=dql if R else 0)
    return _emptied(made, ("seq_lens", "block_table", "token_positions")), offsets


def _arange(n: int, device: torch.device) -> tuple[torch.Tensor]:
    return (torch.arange(n, dtype=_I32, device=device),)


def _emptied(made: object, per_call: tuple[str, ...]) -> dict[str, object]:
    """``made``'s fields as a template: the per-call ones emptied (no tensor of a call kept past it)."""
    template = dict(made.__dict__)
    template.update(dict.fromkeys(per_call))
    return template


def prefill_batch(fn: str, cu_seqlens_q: object, seq_lens: object, block_table: torch.Tensor, num_tokens: int,
                   max_query_len: int, block_size: int, prefix_lens: Optional[torch.Tensor] = None) -> BatchMetadata:
    """A prefill batch on the device; ``prefix_lens`` become its context lengths (checked against
    ``seq_lens`` and ``cu_seqlens_q`` with the step's contents)."""
    try:
        return BatchMetadata.from_device(cu_seqlens_q, seq_lens, block_table, num_decodes=0,  # type: ignore[arg-type]
                                         num_tokens=num_tokens, max_query_len=max_query_len, block_size=block_size,
                                         context_lens=prefix_lens)
    except InputError as e:
        raise InputError(f"{fn}: {e} (query_start_loc is cu_seqlens_q, context_lens is prefix_lens)") from None


# -- caches --------------------------------------------------------------------------------------

def index_caches(index_cache: torch.Tensor, heads: int, dtype: torch.dtype, graph: bool) -> PagedKVCache:
    """The caches of an index op: ``index_cache`` with a one-element K/V stand-in (an indexer reads the index
    cache only), a copy of a template kept per ``index_cache``'s shape, dtype and device."""
    key = ("index caches", dtype, heads, index_cache.shape, index_cache.dtype, index_cache.device)
    template = _kept(key, graph)
    if template is None:
        P, B, Di = index_cache.shape
        dev, shape = index_cache.device, (P, B, heads, Di)
        (kv,) = kept(("stand-in", dtype, dev, shape), graph, stand_in, dtype, dev, shape)
        made = PagedKVCache.rewrap(kv, kv, index_cache)
        if graph:
            return made
        template = _emptied(made, ("index",))
        _keep(key, template)
    caches = _new(PagedKVCache)
    caches.__dict__.update(template, index=index_cache)
    return caches


def _scale(fn: str, name: str, scale: object, heads: int, slots: int, device: torch.device) -> torch.Tensor:
    """``scale`` as a cache keeps it (its values are checked where a step's contents are)."""
    if isinstance(scale, torch.Tensor) and scale.dim() == 2 and scale.shape[0] == heads and scale.shape[1] > slots:
        scale = scale[:, :slots]         # vLLM's buffer may hold more slots than the cache has
    try:
        return kv_scale_view(name, scale, num_kv_heads=heads, num_slots=slots, device=device)
    except InputError as e:
        raise InputError(f"{fn}: {e}") from None


def attention_caches(fn: str, kv_cache: torch.Tensor, k_scale: object, v_scale: object, q: torch.Tensor,
                      graph: bool) -> PagedKVCache:
    """vLLM's ``[num_blocks, num_kv_heads, B, 2 * head_dim]`` cache as K and V views ``[N, B, H, D]`` (HND
    pages, no copy), with a stand-in index cache (no attention reads it) and the scales of an fp8 cache.

    Without scales (a 16-bit cache, or fp8 values as stored) the caches are a copy of a template kept per
    ``kv_cache``'s shape, strides, dtype and device (and ``q``'s dtype), given this call's K and V: two
    views of ``kv_cache`` at the template's strides."""
    if k_scale is None and v_scale is None:
        key = ("kv caches", kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device, q.dtype)
        got = _kept(key, graph)
        if got is None:
            made = _attention_caches(fn, kv_cache, None, None, q, graph)
            if graph:
                return made
            k = made.k
            got = (_emptied(made, ("k", "v")), tuple(k.shape), k.stride(), made.v.storage_offset() - k.storage_offset())
            _keep(key, got)
        template, size, stride, v_at = got
        at = kv_cache.storage_offset()
        caches = _new(PagedKVCache)
        caches.__dict__.update(template, k=kv_cache.as_strided(size, stride, at),
                               v=kv_cache.as_strided(size, stride, at + v_at))
        return caches
    return _attention_caches(fn, kv_cache, k_scale, v_scale, q, graph)


def _attention_caches(fn: str, kv_cache: torch.Tensor, k_scale: object, v_scale: object, q: torch.Tensor,
                      graph: bool) -> PagedKVCache:
    N, H, B, D2 = kv_cache.shape
    if D2 % 2:
        raise InputError(f"{fn}: kv_cache's last axis ({D2}) must hold K then V: 2 * head_dim")
    k, v = kv_cache.transpose(1, 2).chunk(2, dim=-1)         # [N, B, H, D] views: HND pages
    dev, shape = kv_cache.device, (N, B, D2 // 2)
    (index,) = kept(("stand-in", q.dtype, dev, shape), graph, stand_in, q.dtype, dev, shape)  # no attention reads it
    if kv_cache.dtype not in FP8_DTYPES:
        return PagedKVCache.rewrap(k, v, index)              # vLLM reads scales of fp8 caches only
    if (k_scale is None) != (v_scale is None):
        raise InputError(f"{fn}: k_scale and v_scale must both be given or both be None")
    try:
        check_kv_dtype(kv_cache.dtype, 1.0, 1.0)
    except InputError as e:
        raise InputError(f"{fn}: kv_cache: {e}") from None
    if k_scale is None:                                      # an fp8 cache without scales: values as stored
        (unit,) = kept(("unit", kv_cache.device), graph, _unit_scale, kv_cache.device)
        ks = vs = unit.expand(H)
    else:
        ks, vs = (_scale(fn, n, s, H, N * B, kv_cache.device) for n, s in (("k_scale", k_scale),
                                                                            ("v_scale", v_scale)))
        if is_slot_scale(ks) != is_slot_scale(vs):
            raise InputError(f"{fn}: k_scale {tuple(ks.shape)} and v_scale {tuple(vs.shape)}: both per token slot "
                             f"([num_kv_heads, num_slots]) or neither")
    return PagedKVCache.rewrap(k, v, index, ks, vs)
