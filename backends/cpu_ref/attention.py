"""Reference block-sparse attention (docs/spec.md §4), vectorized, fp32 accumulation.

Two strategies compute the same thing; the choice is only about speed:

* ``gather`` (any tokens, any mix of requests): for a chunk of tokens, gather
  the K/V of exactly the blocks each token selected (``[tokens, Hkv, K*B, D]``)
  and attend to them. Work per token is ``K*B`` keys whatever the context.
* ``dense`` (one prefill request at a time): gather the request's K/V once,
  attend every query token of a chunk to all of its keys as one large matmul,
  masking keys outside the token's selected blocks. Work per token is the
  whole context, but it is one GEMM with no per-token gather, which is faster
  on a CPU while the context is a small multiple of ``K*B``.

``strategy="auto"`` sends decodes to ``gather`` and picks per prefill request
(``dense`` while its context is at most :data:`DENSE_MAX_BLOCKS_PER_TOPK`
times ``topk`` blocks).

fp8 K/V caches (``float8_e4m3fn`` or ``float8_e5m2`` with scales) are widened to fp32 (exact) and
multiplied by their scale (per head, or per head and token slot) as they are
gathered, then the same math runs: the reference reads the dequantized cache
(docs/spec.md §1). Unscaled e4m3 K/V are widened as they are, NVFP4 K/V unpacked and multiplied
by their per-16 e4m3 scales (exact in fp32), and fp8 queries widened (exact); the output is
written in ``out``'s dtype.

Semantics follow docs/spec.md §4 and the oracle literally: a token attends to
positions ``j <= p`` inside the *set* of valid selected blocks (duplicates
count once; ``-1``, negative ids and ids ``>= nb`` select nothing). A token
with nothing to attend to (padding) outputs zeros. Selected blocks are read
through the block table only for valid ids; unused block-table entries are
never dereferenced (their ids are replaced before the lookup).

Example:
    >>> import torch
    >>> from mm3 import SparseAttentionParams
    >>> from mm3.testing.factories import make_case
    >>> from mm3.testing.oracle import oracle_topk, oracle_attention
    >>> p = SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16,
    ...     num_index_heads=2, index_head_dim=16, block_size=16, topk=4)
    >>> case = make_case(p, decodes=[70], prefills=[(9, 40)], dtype="float32")
    >>> sel = oracle_topk(case.index_q, case.caches, case.batch, p)
    >>> out = torch.empty_like(case.q)
    >>> attention_forward(case.q, case.caches, sel, case.batch, p, out)
    >>> ref = oracle_attention(case.q, case.caches, sel, case.batch, p)
    >>> bool((out.double() - ref).abs().max() < 1e-5)
    True
"""

from __future__ import annotations

from typing import Callable, Literal

import torch

from mm3.plugin import BatchMetadata
from mm3.plugin import PagedKVCache, TopkBuffer
from mm3.plugin import InputError
from mm3.plugin import SparseAttentionParams

from ._common import DEFAULT_MAX_ELEMENTS, block_rows, first_block_rows, first_blocks, widened

__all__ = ["attention_forward", "Strategy", "DENSE_MAX_BLOCKS_PER_TOPK"]

Strategy = Literal["auto", "gather", "dense"]

DENSE_MAX_BLOCKS_PER_TOPK = 8
"""``auto`` runs a prefill densely while its blocks <= this many times ``topk``.

Measured on 2 CPU cores, M3 TP8 (8 query heads, 1 KV head, D=128, B=128,
top-16), bf16, 256 new tokens: dense/gather 66/326 ms on a 4K context,
141/333 ms on 8K, 293/367 ms on 16K, 580/356 ms on 32K. Gather costs a fixed
K*B keys per token but pays for a per-token copy of those keys; dense is one
GEMM over the whole context. The crossover is near 10x ``topk`` blocks.
(Both strategies were timed back to back on a shared machine: absolute times
vary several-fold with load, the ratio is what sets this constant.)
"""


def _softmax_attend(logits: torch.Tensor, keep: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(logits) @ v`` over the kept keys; rows that keep nothing give zeros.

    ``logits`` ``[..., M, N]`` (fp32, scale applied), ``keep`` broadcastable to
    it, ``v`` ``[..., N, D]`` with zeros wherever ``keep`` is False for every
    row (so garbage in unused cache slots can never reach the output as
    ``0 * NaN``).
    """
    logits = logits.masked_fill_(~keep, float("-inf"))
    m = logits.amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), 0.0, m)
    p = torch.exp(logits.sub_(m))
    denom = p.sum(dim=-1, keepdim=True)
    o = torch.matmul(p, v)
    # A row that kept at least one key has denom >= 1 (its max contributes
    # exp(0)); an empty row has denom 0 and o == 0, so clamping to 1 gives 0.
    return o.div_(denom.clamp_(min=1.0))


def _dequantized(values: torch.Tensor, scale: object, shape: tuple[int, ...],
                 slots: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """fp32 ``values`` read from an fp8 K or V cache times their ``scale`` (docs/spec.md §1), in place.

    ``scale`` is ``None`` for an unscaled cache, ``[Hkv]`` (viewed as ``shape`` against
    ``values``) or ``[Hkv, num_slots]``: then ``slots()`` gives the (KV head, cache slot)
    index of every key of ``values`` (``values`` without its last axis).
    """
    if not isinstance(scale, torch.Tensor):
        return values
    if scale.dim() == 1:
        return values.mul_(scale.view(shape))
    return values.mul_(scale[slots()].unsqueeze(-1))


def _valid_ids(ids: torch.Tensor, nb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted ids and a mask of those that select a block: in ``[0, nb)`` and not repeated."""
    ids = ids.sort(dim=-1).values
    valid = (ids >= 0) & (ids < nb)
    dup = torch.zeros_like(valid)
    dup[..., 1:] = ids[..., 1:] == ids[..., :-1]
    return ids, valid & ~dup


def _gather_chunk(q: torch.Tensor, pos: torch.Tensor, req: torch.Tensor, ids: torch.Tensor,
                  caches: PagedKVCache, batch: BatchMetadata,
                  params: SparseAttentionParams) -> torch.Tensor:
    """Attention for ``C`` tokens of any requests, reading only their selected blocks.

    ``q`` ``[C, Hq, D]``, ``pos``/``req`` ``[C]`` (long), ``ids`` ``[C, Hkv, K]``
    (long). Returns ``[C, Hq, D]`` fp32.
    """
    C, Hq, D = q.shape
    Hkv, K = ids.shape[1], ids.shape[2]
    B, G = params.block_size, params.gqa_group
    dev = q.device
    nb = (pos // B + 1).view(C, 1, 1)
    ids, valid = _valid_ids(ids, nb)
    safe = torch.where(valid, ids, 0)
    head = torch.arange(Hkv, device=dev).view(1, Hkv, 1)
    if batch.slots is None:
        pages = batch.block_table[req.view(C, 1, 1), safe].to(torch.long).clamp_(0, caches.num_pages - 1)
    else:   # token slots: the cache row of every key of every chosen block
        keys = safe.unsqueeze(-1) * B + torch.arange(B, device=dev)
        rows = block_rows(batch, req.view(C, 1, 1, 1), keys, caches)
    # Advanced indices on dims 0 and 2 around a slice (pages; token slots: around row 0 of a one-token
    # page): result [C, Hkv, K, B, D], whose strides depend on the device's index kernel (hence reshape).

    def slots() -> tuple[torch.Tensor, torch.Tensor]:   # per-slot scales: slot = page * B + offset, or the row
        if batch.slots is not None:
            return head, rows.reshape(C, Hkv, K * B)
        return head, (pages.unsqueeze(-1) * B + torch.arange(B, device=dev)).reshape(C, Hkv, K * B)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t[pages, :, head] if batch.slots is None else t[rows, 0, head.unsqueeze(-1)]

    kb = _dequantized(widened(caches.k, caches.k_block_scale, pick).reshape(C, Hkv, K * B, D), caches.k_scale,
                      (1, Hkv, 1, 1), slots)
    vb = _dequantized(widened(caches.v, caches.v_block_scale, pick).reshape(C, Hkv, K * B, D), caches.v_scale,
                      (1, Hkv, 1, 1), slots)
    j = safe.unsqueeze(-1) * B + torch.arange(B, device=dev)
    keep = (valid.unsqueeze(-1) & (j <= pos.view(C, 1, 1, 1))).view(C, Hkv, K * B)
    vb.masked_fill_(~keep.unsqueeze(-1), 0.0)
    qf = q.float().reshape(C, Hkv, G, D) * params.softmax_scale
    logits = torch.matmul(qf, kb.transpose(-1, -2))                      # [C, Hkv, G, K*B]
    o = _softmax_attend(logits, keep.unsqueeze(2), vb)
    return o.reshape(C, Hq, D)


def _dense_chunk(q: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor, kr: torch.Tensor,
                 vr: torch.Tensor, params: SparseAttentionParams) -> torch.Tensor:
    """Attention for ``C`` tokens of one request against all its keys, masked to the selection.

    ``kr``/``vr`` ``[Hkv, S, D]`` fp32 (``vr`` zero past ``seq_len``), ``S`` a
    multiple of the block size covering the chunk's last position.
    """
    C, Hq, D = q.shape
    Hkv, S = kr.shape[0], kr.shape[1]
    B, G = params.block_size, params.gqa_group
    nblk = S // B
    dev = q.device
    nb = (pos // B + 1).view(C, 1, 1)
    ids, valid = _valid_ids(ids, nb)
    chosen = torch.zeros(C, Hkv, nblk + 1, dtype=torch.bool, device=dev)
    chosen.scatter_(2, torch.where(valid, ids, nblk), True)              # invalid -> spare column
    keep = chosen[..., :nblk].repeat_interleave(B, dim=-1)              # [C, Hkv, S]
    keep &= torch.arange(S, device=dev) <= pos.view(C, 1, 1)
    keep = keep.permute(1, 0, 2).unsqueeze(2)                            # [Hkv, C, 1, S]
    qf = (q.float() * params.softmax_scale).reshape(C, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, C * G, D)
    logits = torch.matmul(qf, kr.transpose(1, 2)).reshape(Hkv, C, G, S)
    p_v = vr.unsqueeze(1)                                                # [Hkv, 1, S, D]
    o = _softmax_attend(logits, keep, p_v)                               # [Hkv, C, G, D]
    return o.permute(1, 0, 2, 3).reshape(C, Hq, D)


@torch.no_grad()
def attention_forward(q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer, batch: BatchMetadata,
                      params: SparseAttentionParams, out: torch.Tensor, *, strategy: Strategy = "auto",
                      max_elements: int = DEFAULT_MAX_ELEMENTS) -> None:
    """Write the block-sparse attention of the step's ``T`` tokens into ``out[:T]``.

    ``topk`` is read through ``topk.head_major()``, so either layout and any
    strides work. ``out`` (``[>= T, Hq, D]``, any floating dtype, any strides)
    gets q's values cast to its dtype; rows past ``T`` are never touched.
    ``strategy`` forces one code path (tests use it); ``max_elements`` bounds
    the largest fp32 intermediate.
    """
    # The bound backend (mm3.runtime.backend.Backend) has checked every argument against the contract.
    Hq, Hkv, D = params.num_heads, params.num_kv_heads, params.head_dim
    T = batch.num_tokens
    if strategy not in ("auto", "gather", "dense"):
        raise InputError(f"cpu_ref.attention_forward: strategy must be 'auto', 'gather' or 'dense', "
                         f"got {strategy!r}")
    if T == 0:
        return

    sel = topk.head_major()                                                 # [Hkv, >=T, K]
    K, B = topk.topk, params.block_size
    positions = batch.token_positions.to(torch.long)
    requests = batch.token_to_request.to(torch.long)
    starts = [0]
    for n in batch.query_lens:
        starts.append(starts[-1] + n)

    def run_gather(a: int, b: int) -> None:
        chunk = max(1, max_elements // (Hkv * K * B * max(D, params.gqa_group)))
        for s in range(a, b, chunk):
            e = min(b, s + chunk)
            ids = sel[:, s:e].permute(1, 0, 2).to(torch.long)
            o = _gather_chunk(q[s:e], positions[s:e], requests[s:e], ids, caches, batch, params)
            out[s:e] = o.to(out.dtype)

    def run_dense(r: int) -> None:
        a, b = starts[r], starts[r + 1]
        seq = batch.seq_lens_host[r]
        nblk = -(-seq // B)
        req = torch.tensor([r], device=q.device)

        def pages(t: torch.Tensor) -> torch.Tensor:
            return first_blocks(t, batch, req, nblk, caches)[0]

        kr = widened(caches.k, caches.k_block_scale, pages)   # [nblk * B, Hkv, D] fp32
        vr = widened(caches.v, caches.v_block_scale, pages)

        def slots() -> tuple[torch.Tensor, torch.Tensor]:   # the rows the gather read
            return torch.arange(Hkv, device=q.device)[:, None], first_block_rows(batch, req, nblk, caches)

        kr = _dequantized(kr.reshape(nblk * B, Hkv, D).permute(1, 0, 2), caches.k_scale, (Hkv, 1, 1), slots)
        vr = _dequantized(vr.reshape(nblk * B, Hkv, D).permute(1, 0, 2), caches.v_scale, (Hkv, 1, 1), slots)
        vr[:, seq:] = 0.0  # slots past seq_len are unwritten: never let them reach a matmul
        ctx = seq - (b - a)
        chunk = max(1, max_elements // (Hq * nblk * B))
        for s in range(a, b, chunk):
            e = min(b, s + chunk)
            last = ctx + (e - a) - 1
            S = (last // B + 1) * B
            ids = sel[:, s:e].permute(1, 0, 2).to(torch.long)
            o = _dense_chunk(q[s:e], positions[s:e], ids, kr[:, :S], vr[:, :S], params)
            out[s:e] = o.to(out.dtype)

    nd = batch.num_decode_tokens
    if caches.num_pages == 0:  # nothing was ever written: every token is padding
        out.zero_()
        return
    if nd:
        if strategy == "dense":
            for r in range(batch.num_decodes):
                if batch.query_lens[r] and batch.seq_lens_host[r]:
                    run_dense(r)
                elif batch.query_lens[r]:
                    out[starts[r]:starts[r + 1]] = 0  # padding decode: nothing to attend to
        else:
            run_gather(0, nd)
    for r in range(batch.num_decodes, batch.num_requests):
        nblk = -(-batch.seq_lens_host[r] // B)
        dense = strategy == "dense" or (strategy == "auto" and nblk <= DENSE_MAX_BLOCKS_PER_TOPK * K)
        if dense:
            run_dense(r)
        else:
            run_gather(starts[r], starts[r + 1])
