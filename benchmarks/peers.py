"""What users would otherwise run, on the same inputs: dense SDPA and FlexAttention.

* Dense ``scaled_dot_product_attention`` over the whole context, one SDPA
  backend at a time (flash, cuDNN, memory-efficient). Decode folds the GQA
  group into the query axis (``q [R, Hkv, G*Lq, D]`` against ``k [R, Hkv, S, D]``,
  no mask) - the flash-decoding trick, exact for ``Lq = 1``; for ``Lq > 1`` it
  skips the causal mask among the last ``Lq - 1`` keys, which changes nothing
  in the cost. Prefill uses ``enable_gqa`` and a causal mask (lower-right
  aligned after a cached context); a backend that refuses GQA gets K/V
  expanded to all query heads.
* FlexAttention with a :class:`BlockMask` built from *the same selection*
  mm3's indexer produced: per 128-row query tile, the union of the blocks its
  tokens selected; blocks every row selected and sees entirely are "full"
  (no mask_mod), the rest go through a mask_mod that looks the (token, block)
  pair up in a selection bitmap and applies causality. Its output is checked
  against mm3's.

Example (CPU, eager FlexAttention):
    >>> import torch
    >>> sel = torch.tensor([[[[True, False, True]]]])     # [R=1, Hkv=1, L=1, nb=3]
    >>> fm = flex_block_mask(sel, offset=40, kv_len=48, group=2, block_size=16, q_block=16)
    >>> fm.block_mask.shape[:2]
    (1, 2)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["SDPA_BACKENDS", "sdpa_decode_fn", "sdpa_prefill_fn", "FlexMask", "flex_block_mask",
           "selection_bitmap", "flex_fn", "fold_decode_q", "unfold_decode_out"]


def _sdpa_backends() -> dict[str, object]:
    from torch.nn.attention import SDPBackend
    names = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
    return {k: getattr(SDPBackend, v) for k, v in names.items() if hasattr(SDPBackend, v)}


SDPA_BACKENDS = ("flash", "cudnn", "efficient")


def fold_decode_q(q: torch.Tensor, batch: int, qlen: int, num_kv_heads: int) -> torch.Tensor:
    """``[R*Lq, Hq, D]`` -> ``[R, Hkv, G*Lq, D]`` (the GQA group folded into the query axis)."""
    T, Hq, D = q.shape
    G = Hq // num_kv_heads
    return q.view(batch, qlen, num_kv_heads, G, D).permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, G * qlen, D)


def unfold_decode_out(o: torch.Tensor, batch: int, qlen: int) -> torch.Tensor:
    """Inverse of :func:`fold_decode_q` for the output."""
    R, Hkv, GL, D = o.shape
    G = GL // qlen
    return o.view(R, Hkv, G, qlen, D).permute(0, 3, 1, 2, 4).reshape(R * qlen, Hkv * G, D)


def _with_backend(name: Optional[str], call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    if name is None:
        return call
    from torch.nn.attention import sdpa_kernel
    backend = _sdpa_backends()[name]

    def run() -> torch.Tensor:
        with sdpa_kernel([backend]):
            return call()
    return run


def sdpa_decode_fn(qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   backend: Optional[str]) -> Callable[[], torch.Tensor]:
    """Dense decode over the whole context; ``qf`` from :func:`fold_decode_q`."""
    return _with_backend(backend, lambda: F.scaled_dot_product_attention(qf, k, v, scale=scale))


def sdpa_prefill_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, context: int,
                    backend: Optional[str]) -> tuple[Callable[[], torch.Tensor], str]:
    """Dense causal prefill of ``q`` ``[1, Hq, L, D]`` after ``context`` cached tokens.

    Returns the function and a note (how GQA and the causal offset were handled).
    Tries ``enable_gqa`` first and falls back to expanded K/V.
    """
    L, S = q.shape[2], k.shape[2]
    if context == 0:
        mask_kw: dict = {"is_causal": True}
        how = "causal"
    else:
        from torch.nn.attention.bias import causal_lower_right
        mask_kw = {"attn_mask": causal_lower_right(L, S)}
        how = "causal_lower_right"
    gqa = q.shape[1] != k.shape[1]

    def gqa_call() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True, **mask_kw)
    fn = _with_backend(backend, gqa_call if gqa else
                       (lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, **mask_kw)))
    try:
        fn()
        return fn, how + (", enable_gqa" if gqa else "")
    except RuntimeError:
        if not gqa:
            raise
    rep = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    fn = _with_backend(backend, lambda: F.scaled_dot_product_attention(q, ke, ve, scale=scale, **mask_kw))
    fn()
    return fn, how + ", K/V expanded to all heads (backend refused enable_gqa)"


def selection_bitmap(sel_hm: torch.Tensor, num_requests: int, rows_per_request: int,
                     num_blocks: int) -> torch.Tensor:
    """``[R, H, L, nb]`` bool: which blocks each (request, head, row) selected (``sel_hm`` ``[H, R*L, K]``)."""
    H, T, K = sel_hm.shape
    ids = sel_hm.long().view(H, num_requests, rows_per_request, K).permute(1, 0, 2, 3)
    bm = torch.zeros(num_requests, H, rows_per_request, num_blocks + 1, dtype=torch.bool, device=sel_hm.device)
    bm.scatter_(3, torch.where(ids >= 0, ids, num_blocks).clamp(max=num_blocks), True)
    return bm[..., :num_blocks].contiguous()


@dataclass
class FlexMask:
    block_mask: object
    union_blocks_per_tile: float     # mean blocks a (request, head, q tile) touches
    full_fraction: float             # of those, the share that need no mask_mod


def _to_kv_list(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool ``[..., nb]`` -> (count ``[...]`` int32, ids ``[..., nb]`` int32 with the True ids first)."""
    num = mask.sum(-1).to(torch.int32)
    order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return num, order.contiguous()


def flex_block_mask(bitmap: torch.Tensor, *, offset: int, kv_len: int, group: int, block_size: int,
                    q_block: int = 128) -> FlexMask:
    """A FlexAttention ``BlockMask`` for queries at positions ``offset + q_idx``.

    ``bitmap`` ``[R, Hkv, L, nb]``: the selection (row ``q_idx`` of request ``r``
    attends keys in the selected blocks with ``kv_idx <= offset + q_idx``).
    The mask is per query head (``Hkv * group`` heads) as FlexAttention's GQA wants.
    """
    from torch.nn.attention.flex_attention import BlockMask

    R, H, L, nb = bitmap.shape
    nqb = -(-L // q_block)
    pad = nqb * q_block - L
    bm = torch.cat([bitmap, bitmap.new_zeros(R, H, pad, nb)], dim=2) if pad else bitmap
    tiles = bm.view(R, H, nqb, q_block, nb)
    union = tiles.any(3)
    real = torch.arange(nqb * q_block, device=bitmap.device).view(nqb, q_block) < L
    every = (tiles | ~real.view(1, 1, nqb, q_block, 1)).all(3)
    first_pos = offset + torch.arange(nqb, device=bitmap.device) * q_block
    blk_end = (torch.arange(nb, device=bitmap.device) + 1) * block_size - 1
    seen = (blk_end.view(1, nb) <= first_pos.view(nqb, 1)) & (blk_end.view(1, nb) < kv_len)
    full = every & seen.view(1, 1, nqb, nb)
    partial = union & ~full
    num_p, idx_p = _to_kv_list(partial)
    num_f, idx_f = _to_kv_list(full)
    num_p, idx_p, num_f, idx_f = (t.repeat_interleave(group, dim=1) for t in (num_p, idx_p, num_f, idx_f))
    bmf = bm

    def mask_mod(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return bmf[b, h // group, q_idx, kv_idx // block_size] & (kv_idx <= q_idx + offset)

    kwargs = dict(BLOCK_SIZE=(q_block, block_size), mask_mod=mask_mod)
    params = inspect.signature(BlockMask.from_kv_blocks).parameters
    if "seq_lengths" in params:
        kwargs["seq_lengths"] = (L, kv_len)
    if "compute_q_blocks" in params:
        kwargs["compute_q_blocks"] = False
    mask = BlockMask.from_kv_blocks(num_p, idx_p, num_f, idx_f, **kwargs)
    touched = float(union.sum().item()) / max(1, union[..., 0].numel())
    fullf = float(full.sum().item()) / max(1.0, float(union.sum().item()))
    return FlexMask(mask, touched, fullf)


_COMPILED: dict[str, Callable] = {}


def flex_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlexMask, scale: float,
            compiled: bool) -> Callable[[], torch.Tensor]:
    """FlexAttention over dense ``k``/``v`` ``[R, Hkv, S, D]`` with ``q`` ``[R, Hq, L, D]``."""
    from torch.nn.attention.flex_attention import flex_attention

    fa = flex_attention
    if compiled:
        fa = _COMPILED.get("flex")
        if fa is None:
            import torch._dynamo
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            fa = _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    bm = mask.block_mask
    gqa = q.shape[1] != k.shape[1]
    return lambda: fa(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa)
