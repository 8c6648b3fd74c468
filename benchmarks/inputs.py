"""Benchmark inputs: one random paged-cache pool per shape, rotated decode sets, prefill chunks.

All data is random N(0, 1) (never zeros) generated on the device. Every
request's pages are a random sample of the pool, so block tables look like a
real paged cache's; rotated sets of one configuration use disjoint pages.

Example:
    >>> import torch
    >>> from mm3.contract import SparseAttentionParams
    >>> p = SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
    ...                           index_head_dim=16, block_size=16, topk=4)
    >>> pool = Pool(p, num_pages=64, device=torch.device("cpu"), seed=0)
    >>> sets = decode_sets(pool, batch=2, context=100, qlen=1, num_sets=3, index_dtype="bfloat16")
    >>> len(sets), sets[0].batch.num_tokens, sets[0].q.shape
    (3, 2, torch.Size([2, 4, 16]))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from mm3.contract import BatchMetadata
from mm3.contract import PagedKVCache
from mm3.contract import SparseAttentionParams

__all__ = ["Pool", "StepInputs", "decode_sets", "prefill_inputs", "dense_kv", "page_bytes",
           "INDEX_DTYPES"]

INDEX_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}

QUANT_KV = ("float8_e4m3fn_unscaled", "nvfp4")
"""The model authors' K/V formats (docs/spec.md §1): copies of the pool's K/V made on first use."""


FP8_KV_SCALE = 1.0 / 64
"""Scale of the pool's fp8 K/V copy: N(0, 1) values / scale stay well inside e4m3's +-448."""


def _to_fp8(t: torch.Tensor, pages_per_pass: int = 4096) -> torch.Tensor:
    """``t / FP8_KV_SCALE`` in float8_e4m3fn, a few thousand pages at a time (no full-size fp32 copy)."""
    out = torch.empty(t.shape, dtype=torch.float8_e4m3fn, device=t.device)
    for a in range(0, t.shape[0], pages_per_pass):
        out[a:a + pages_per_pass] = t[a:a + pages_per_pass].float() / FP8_KV_SCALE
    return out


def page_bytes(p: SparseAttentionParams, *, kv_elt: int = 2, with_fp8_index: bool = True,
               with_fp8_kv: bool = True) -> int:
    """Bytes of one page in the pool: K + V + bf16 index (+ fp8 index copy, + fp8 K/V copy)."""
    kv = 2 * p.block_size * p.num_kv_heads * p.head_dim * (kv_elt + (1 if with_fp8_kv else 0))
    idx = p.block_size * p.index_head_dim * (2 + (1 if with_fp8_index else 0))
    return kv + idx


class Pool:
    """Random K/V and index caches of ``num_pages`` pages (bf16 index and an fp8 copy)."""

    def __init__(self, p: SparseAttentionParams, num_pages: int, device: torch.device, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.params = p
        self.num_pages = num_pages
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        caches = PagedKVCache.allocate(num_pages, p.block_size, p.num_kv_heads, p.head_dim,
                                       p.index_head_dim, dtype, torch.bfloat16, "NHD", device)
        for t in (caches.k, caches.v, caches.index):
            t.normal_(generator=self.generator)
        self.caches = {"bfloat16": caches,
                       "float8_e4m3fn": PagedKVCache(caches.k, caches.v,
                                                     caches.index.to(torch.float8_e4m3fn))}
        self._fp8_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._quant: dict[str, PagedKVCache] = {}

    def caches_for(self, index_dtype: str, kv_dtype: str = "bfloat16") -> PagedKVCache:
        """The pool's caches with this index dtype, K/V in bf16 or in fp8 (made on first use).

        The fp8 K/V hold the bf16 values divided by :data:`FP8_KV_SCALE` (the
        scales dequantize them back), so both read the same logical keys and values.
        """
        if kv_dtype in QUANT_KV:
            return self._quantized(index_dtype, kv_dtype)
        c = self.caches[index_dtype]
        if kv_dtype == "bfloat16":
            return c
        if kv_dtype != "float8_e4m3fn":
            raise ValueError(f"K/V dtype {kv_dtype!r}: use 'bfloat16' or 'float8_e4m3fn'")
        if self._fp8_kv is None:
            self._fp8_kv = (_to_fp8(c.k), _to_fp8(c.v))
        k, v = self._fp8_kv
        scale = torch.tensor([FP8_KV_SCALE], device=self.device)
        return PagedKVCache(k, v, c.index, scale, scale.clone())

    def _quantized(self, index_dtype: str, kv_dtype: str, pages_per_pass: int = 4096) -> PagedKVCache:
        """The pool's K/V (and index keys, for ``index_dtype="nvfp4"``) in one of :data:`QUANT_KV`: unscaled
        e4m3 holds the N(0, 1) values as they are, NVFP4 their per-16 quantization (made a few thousand
        pages at a time, kept)."""
        from mm3.contract.quant import quantize_nvfp4

        key = f"{kv_dtype}+{index_dtype}"
        if key not in self._quant:
            src = self.caches["bfloat16"]
            p = self.params
            c = PagedKVCache.allocate(self.num_pages, p.block_size, p.num_kv_heads, p.head_dim, p.index_head_dim,
                                      device=self.device, kv_format=kv_dtype,
                                      index_format="nvfp4" if index_dtype == "nvfp4" else None,
                                      index_dtype=INDEX_DTYPES.get(index_dtype, torch.bfloat16))
            for a in range(0, self.num_pages, pages_per_pass):
                z = slice(a, a + pages_per_pass)
                for name in ("k", "v", "index"):
                    fmt = kv_dtype if name != "index" else index_dtype
                    if fmt == "nvfp4":
                        packed, scales = quantize_nvfp4(getattr(src, name)[z])
                        getattr(c, name)[z] = packed
                        getattr(c, f"{name}_block_scale")[z] = scales
                    else:
                        getattr(c, name)[z] = getattr(src, name)[z].to(getattr(c, name).dtype)
            self._quant[key] = c
        return self._quant[key]

    def sample_pages(self, n: int) -> torch.Tensor:
        """``n`` distinct random page ids (int32)."""
        if n > self.num_pages:
            raise ValueError(f"need {n} pages, pool has {self.num_pages}")
        perm = torch.randperm(self.num_pages, device=self.device, generator=self.generator)
        return perm[:n].to(torch.int32)

    def randn(self, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, generator=self.generator).to(dtype)


@dataclass
class StepInputs:
    """One step's inputs and persistent outputs (one rotated set)."""

    q: torch.Tensor
    index_q: torch.Tensor
    caches: PagedKVCache
    batch: BatchMetadata
    out: torch.Tensor
    context: int
    qlen: int


def decode_sets(pool: Pool, *, batch: int, context: int, qlen: int, num_sets: int,
                index_dtype: str, kv_dtype: str = "bfloat16", q_dtype: str = "bfloat16") -> list[StepInputs]:
    """``num_sets`` decode steps of ``batch`` requests of ``context`` tokens each, on disjoint pages.

    ``q_dtype="float8_e4m3fn"``: fp8 queries, the output in bf16."""
    p = pool.params
    nb = -(-context // p.block_size)
    pages = pool.sample_pages(num_sets * batch * nb).view(num_sets, batch, nb)
    caches = pool.caches_for(index_dtype, kv_dtype)
    T = batch * qlen
    sets = []
    for s in range(num_sets):
        meta = BatchMetadata.build([qlen] * batch, [context] * batch, pages[s].contiguous(),
                                   block_size=p.block_size, num_decodes=batch, decode_query_len=qlen,
                                   device=pool.device)
        q = pool.randn(T, p.num_heads, p.head_dim)
        iq = pool.randn(T, p.num_index_heads, p.index_head_dim)
        sets.append(StepInputs(q.to(_Q[q_dtype]), iq, caches, meta, torch.empty_like(q), context, qlen))
    return sets


_Q = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}


def prefill_inputs(pool: Pool, *, chunk: int, context: int, index_dtype: str,
                   locality: float = 0.0, kv_dtype: str = "bfloat16", q_dtype: str = "bfloat16") -> StepInputs:
    """One prefill request: ``chunk`` new tokens after ``context`` cached ones.

    ``locality`` in [0, 1): the index query of every token is
    ``locality * c + sqrt(1 - locality^2) * noise`` for one random direction
    ``c`` per index head, so tokens of the request rank blocks alike (as real
    attention's heavy hitters make them do); 0 gives independent queries, the
    worst case for sharing blocks between neighbouring tokens.
    """
    p = pool.params
    seq = context + chunk
    nb = -(-seq // p.block_size)
    pages = pool.sample_pages(nb).view(1, nb)
    meta = BatchMetadata.build([chunk], [seq], pages, block_size=p.block_size, num_decodes=0,
                               device=pool.device)
    q = pool.randn(chunk, p.num_heads, p.head_dim)
    noise = torch.randn(chunk, p.num_index_heads, p.index_head_dim, device=pool.device,
                        generator=pool.generator)
    if locality > 0:
        c = torch.randn(1, p.num_index_heads, p.index_head_dim, device=pool.device, generator=pool.generator)
        noise = locality * c + math.sqrt(1.0 - locality ** 2) * noise
    iq = noise.to(torch.bfloat16)
    return StepInputs(q.to(_Q[q_dtype]), iq, pool.caches_for(index_dtype, kv_dtype), meta, torch.empty_like(q), seq,
                      chunk)


def dense_kv(caches: PagedKVCache, block_table: torch.Tensor, num_blocks: int,
             length: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous ``[R, Hkv, L, D]`` K and V of each request's first ``num_blocks`` pages.

    This is what a dense-attention peer runs on: the same keys and values,
    stored the way SDPA/FlexAttention want them (no paging).
    """
    pages = block_table[:, :num_blocks].long()
    out = []
    for t in (caches.k, caches.v):
        g = t[pages]                                   # [R, nb, B, Hkv, D]
        R, nb, B, H, D = g.shape
        d = g.permute(0, 3, 1, 2, 4).reshape(R, H, nb * B, D)
        out.append(d[:, :, :length].contiguous() if length is not None else d.contiguous())
    return out[0], out[1]
