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

from typing import Callable, Optional

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


def topk_view(fn: str, name: str, view: torch.Tensor) -> TopkBuffer:
    try:
        return TopkBuffer(view)
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
# values only once the graph replays, so it cannot serve eager calls.
_KEPT: dict[tuple[object, ...], tuple[torch.Tensor, ...]] = {}
#: constant tensors kept before the cache starts over (one set per batch size and device)
MAX_KEPT = 4096


def kept(key: tuple[object, ...], graph: bool, make: Callable[..., tuple[torch.Tensor, ...]],
          *args: object) -> tuple[torch.Tensor, ...]:
    """The constants ``make(*args)`` kept under ``key`` (made anew inside capture, and then not kept)."""
    got = _KEPT.get(key)
    if got is None:
        got = make(*args)
        if not graph:
            if len(_KEPT) >= MAX_KEPT:
                _KEPT.clear()
            _KEPT[key] = got
    return got


def _decode_constants(R: int, dql: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    i32 = dict(dtype=torch.int32, device=device)
    return (torch.arange(R + 1, **i32) * dql, torch.arange(R * dql, **i32) // dql,
            torch.arange(dql, **i32) - dql)


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
    two with draft tokens)."""
    sl = int32_arg(fn, "seq_lens", seq_lens, 1, "[num_reqs]")
    bt = int32_arg(fn, "block_table", block_table, 2, "[num_reqs, max_blocks]")
    R, dql = sl.shape[0], decode_query_len
    if bt.shape[0] != R:
        raise InputError(f"{fn}: block_table has {bt.shape[0]} rows for {R} requests (seq_lens)")
    if not isinstance(dql, int) or dql < 1 or num_tokens != R * dql:
        raise InputError(f"{fn}: {num_tokens} query tokens for {R} requests of decode_query_len={dql}; a decode "
                         f"batch holds num_reqs * decode_query_len tokens")
    dev = sl.device
    qsl, tok_req, offsets = kept(("decode", R, dql, dev), graph, _decode_constants, R, dql, dev)
    # position of draft i of request r: seq_len - dql + i; below 0 is padding (-1), as vLLM's kernels read it.
    # Each small kernel costs about a microsecond of a captured step (and one of host time): with one query
    # token seq_len - 1 is -1 for a padding request (seq_len 0) already, so one op and no clamp, and the
    # context lengths, which no decode kernel reads, are derived only if something asks for them
    if dql == 1:
        pos = sl - 1
    else:
        pos = torch.add(sl.unsqueeze(1), offsets).clamp_(min=-1).view(num_tokens)
    return BatchMetadata.assemble(qsl, sl, None, bt, tok_req, pos, num_decodes=R, decode_query_len=dql,
                                  num_decode_tokens=num_tokens, max_prefill_query_len=0, block_size=block_size,
                                  max_query_len=dql if R else 0)


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
    P, B, Di = index_cache.shape
    dev, shape = index_cache.device, (P, B, heads, Di)
    # an indexer reads the index cache only
    (kv,) = kept(("stand-in", dtype, dev, shape), graph, stand_in, dtype, dev, shape)
    return PagedKVCache.rewrap(kv, kv, index_cache)


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
