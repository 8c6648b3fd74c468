"""GPU-side fp64 references for real M3 shapes, where the CPU oracle is too slow.

``mm3.testing.oracle`` converts the *whole* caches to fp64 on the CPU and walks
positions in Python: fine for tiny shapes, hopeless at 128K contexts. These
helpers compute the same docs/spec.md §3/§4 quantities for a chosen subset of tokens,
in float64 on the GPU, gathering only the pages each token can see. Like the
oracle, they share no code with any backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.kv_scales import FP8_KV_DTYPES
from mm3.contract.params import SparseAttentionParams
from mm3.testing.factories import make_case

__all__ = ["GpuCase", "build_case", "combined_kv", "block_scores", "selection_errors", "attention_reference",
           "sample_tokens", "run_hooks_step", "assert_step_right", "assert_replays_match", "POISON_TOPK"]

#: what :func:`run_hooks_step` fills the top-k buffer with first (a row left so was not written)
POISON_TOPK = -7

FORCED_INIT, FORCED_LOCAL, NAN_SCORE = 1e30, 1e29, -1e30


@dataclass
class GpuCase:
    params: SparseAttentionParams
    q: torch.Tensor
    index_q: torch.Tensor
    caches: PagedKVCache
    batch: BatchMetadata


def build_case(params: SparseAttentionParams, *, decodes: Sequence[int], prefills: Sequence[tuple[int, int]],
               decode_query_len: int = 1, padding_decodes: int = 0, dtype: torch.dtype = torch.bfloat16,
               index_dtype: torch.dtype = torch.bfloat16, kv_layout: str = "NHD", seed: int = 0,
               width: Optional[int] = None, num_pages: Optional[int] = None,
               device: str = "cuda", kv_dtype: Optional[torch.dtype] = None, kv_scale: str = "head") -> GpuCase:
    """A random mixed step whose caches and queries are generated on ``device``.

    The batch (decode-first order, padding decodes between real ones, permuted
    pages, ``-1`` in unused table entries) comes from ``make_case`` run with
    16-wide heads, whose CPU-made caches are tiny; the real caches are drawn
    here on the GPU, ``num_pages`` of them (at least what the batch uses).
    ``width`` (block-table columns) defaults to the longest request's blocks + 3.
    An fp8 ``kv_dtype`` (``torch.float8_e4m3fn``, ``torch.float8_e5m2``) stores K/V as ``value / scale`` with a
    random scale per KV head (K) and one per tensor (V); with ``kv_scale="slot"``
    both scales are random per KV head and token slot (``[Hkv, num_pages * block_size]``).
    """
    B = params.block_size
    need = max([-(-s // B) for s in list(decodes) + [s for _, s in prefills]])
    shape_only = SparseAttentionParams(num_heads=1, num_kv_heads=1, head_dim=16, num_index_heads=1,
                                       index_head_dim=16, block_size=B, topk=params.topk,
                                       init_blocks=params.init_blocks, local_blocks=params.local_blocks)
    batch = make_case(shape_only, decodes=decodes, prefills=prefills, decode_query_len=decode_query_len,
                      padding_decodes=padding_decodes, dtype="float32", index_dtype="float32", seed=seed,
                      extra_block_columns=(width or need + 3) - need, device=device).batch
    pages = max(num_pages or 0, int(batch.block_table.max()) + 1)
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    fp8 = kv_dtype in FP8_KV_DTYPES
    Hkv = params.num_kv_heads
    shapes = ((Hkv, pages * B), (Hkv, pages * B)) if kv_scale == "slot" else ((Hkv,), (1,))
    scales = tuple(0.02 + 0.03 * torch.rand(sh, device=dev, generator=g) for sh in shapes) if fp8 else (None, None)
    caches = PagedKVCache.allocate(pages, B, params.num_kv_heads, params.head_dim, params.index_head_dim,
                                   kv_dtype or dtype, index_dtype, kv_layout, dev, *scales)
    for t, sc in ((caches.k, caches.k_scale), (caches.v, caches.v_scale)):
        if not fp8:
            t.copy_(torch.randn(t.shape, device=dev, generator=g, dtype=torch.float32))
            continue
        for a in range(0, t.shape[0], 4096):   # in slices: no full-size fp32 temporary
            x = torch.randn(t[a:a + 4096].shape, device=dev, generator=g, dtype=torch.float32)
            n = x.shape[0]
            per = (sc.view(Hkv, pages, B)[:, a:a + n].permute(1, 2, 0) if sc.dim() == 2 else sc.view(1, 1, -1))
            t[a:a + 4096] = x / per.unsqueeze(-1)
    caches.index.copy_(torch.randn(caches.index.shape, device=dev, generator=g).to(index_dtype))
    T = batch.num_tokens
    q = torch.randn(T, params.num_heads, params.head_dim, device=dev, generator=g).to(dtype)
    index_q = torch.randn(T, params.num_index_heads, params.index_head_dim, device=dev, generator=g).to(dtype)
    return GpuCase(params, q, index_q, caches, batch)


def combined_kv(caches: PagedKVCache) -> torch.Tensor:
    """vLLM's one KV cache of ``caches``: K then V in the last axis of ``[num_blocks, Hkv, B, 2 * D]``."""
    k, v = caches.k, caches.v
    N, B, H, D = k.shape
    kv = torch.empty((N, H, B, 2 * D), dtype=k.dtype, device=k.device)
    kv[..., :D].copy_(k.permute(0, 2, 1, 3))
    kv[..., D:].copy_(v.permute(0, 2, 1, 3))
    return kv


def capture(run: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """``run`` once on a side stream (compiles and warms up outside the capture), then captured."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def replay_step(graph: torch.cuda.CUDAGraph, q: torch.Tensor, index_q: torch.Tensor, batch: BatchMetadata,
                out: torch.Tensor, step: object) -> None:
    """Refill a captured step's inputs in place from ``step`` (a case: q, index_q, batch), poison
    ``out`` and replay ``graph``."""
    q.copy_(step.q)  # type: ignore[attr-defined]
    index_q.copy_(step.index_q)  # type: ignore[attr-defined]
    batch.update_(step.batch)  # type: ignore[attr-defined]
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


def sample_tokens(batch: BatchMetadata, per_prefill: int = 24) -> list[int]:
    """All decode tokens, and for each prefill its first, last and ``per_prefill`` spread tokens."""
    toks = list(range(batch.num_decode_tokens))
    qsl = batch.query_start_loc.tolist()
    for r in range(batch.num_decodes, batch.num_requests):
        a, b = qsl[r], qsl[r + 1]
        step = max(1, (b - a) // per_prefill)
        toks.extend(sorted(set(range(a, b, step)) | {a, b - 1}))
    return toks


def _visible(batch: BatchMetadata, caches: PagedKVCache, t: int, host: dict) -> tuple[int, int, torch.Tensor]:
    """(request, position, page of each visible block) of token ``t``."""
    r, p = host["req"][t], host["pos"][t]
    nb = p // batch.block_size + 1
    return r, p, batch.block_table[r, :nb].long()


def _host(batch: BatchMetadata) -> dict:
    return {"req": batch.token_to_request.tolist(), "pos": batch.token_positions.tolist()}


def block_scores(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                 params: SparseAttentionParams, tokens: Iterable[int]) -> dict[int, torch.Tensor]:
    """docs/spec.md §3.3-3.4 block scores S ``[H, nb]`` (fp64, forced blocks applied) for each token in ``tokens``."""
    host, B = _host(batch), params.block_size
    out: dict[int, torch.Tensor] = {}
    for t in tokens:
        if host["pos"][t] < 0:
            out[t] = torch.empty(params.num_index_heads, 0, dtype=torch.float64)
            continue
        r, p, pages = _visible(batch, caches, t, host)
        # gather as bytes: advanced indexing of float8 tensors is not available everywhere
        raw = caches.index.view(torch.uint8) if caches.index.dtype == torch.float8_e4m3fn else caches.index
        keys = raw[pages].view(caches.index.dtype).float().to(torch.float64).reshape(-1, params.index_head_dim)
        s = index_q[t].to(torch.float64) @ keys.T                                          # [H, nb*B]
        s[:, p + 1:] = float("-inf")
        S = s.view(s.shape[0], -1, B).amax(dim=2)
        S = torch.nan_to_num(S, nan=NAN_SCORE, posinf=float("inf"), neginf=float("-inf"))
        nb = S.shape[1]
        S[:, :min(params.init_blocks, nb)] = FORCED_INIT
        S[:, max(nb - params.local_blocks, 0):] = FORCED_LOCAL
        out[t] = S.cpu()
    return out


def selection_errors(buf: TopkBuffer, scores: dict[int, torch.Tensor], params: SparseAttentionParams,
                     rel_tol: float = 1e-3) -> list[str]:
    """docs/spec.md §3's row rules (format, forced blocks, tie-tolerant optimality) for the sampled tokens."""
    view = buf.head_major()
    errors: list[str] = []
    K = params.topk
    for t, S in scores.items():
        rows = view[:, t].cpu().tolist()
        nb = S.shape[1]
        for h, row in enumerate(rows):
            where = f"token {t} head {h}: row {row}"
            if nb == 0:
                if any(x != -1 for x in row):
                    errors.append(f"{where}: padding token must be all -1")
                continue
            k = min(K, nb)
            valid = row[:k]
            if any(x == -1 for x in valid) or any(x != -1 for x in row[k:]):
                errors.append(f"{where}: expected {k} ids then -1")
            elif len(set(valid)) != k or not all(0 <= x < nb for x in valid):
                errors.append(f"{where}: duplicate or out-of-range id (nb={nb})")
            else:
                chosen = torch.zeros(nb, dtype=torch.bool)
                chosen[valid] = True
                Sh = S[h]
                if bool(((Sh >= FORCED_LOCAL) & ~chosen).any()):
                    errors.append(f"{where}: a forced block is missing")
                elif not bool(chosen.all()):
                    free = Sh[(Sh < FORCED_LOCAL) & (Sh > NAN_SCORE)]
                    tol = rel_tol * (float(free.abs().max()) if free.numel() else 1.0)
                    lo, hi = float(Sh[chosen].min()), float(Sh[~chosen].max())
                    if lo < hi - tol:
                        errors.append(f"{where}: selected {lo:.6g} < unselected {hi:.6g} - {tol:.3g}")
    return errors


def attention_reference(q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer, batch: BatchMetadata,
                        params: SparseAttentionParams, tokens: Iterable[int]) -> dict[int, torch.Tensor]:
    """docs/spec.md §4 output ``[Hq, D]`` (fp64) of each token in ``tokens``, for the selection in ``topk``."""
    host, B, G = _host(batch), params.block_size, params.gqa_group
    view = topk.head_major()
    out: dict[int, torch.Tensor] = {}
    # fp8 K/V: the reference reads the dequantized values (docs/spec.md §1)
    ones = torch.ones(params.num_kv_heads, dtype=torch.float64, device=q.device)
    k_scale, v_scale = ((caches.k_scale.double(), caches.v_scale.double()) if caches.kv_scaled else (ones, ones))
    for t in tokens:
        res = torch.zeros(params.num_heads, params.head_dim, dtype=torch.float64, device=q.device)
        if host["pos"][t] >= 0:
            r, p, pages = _visible(batch, caches, t, host)
            for h in range(params.num_kv_heads):
                ids = sorted({b for b in view[h, t].tolist() if 0 <= b < pages.numel()})
                if not ids:
                    continue
                js = torch.cat([torch.arange(b * B, min(b * B + B, p + 1), device=q.device) for b in ids])
                pg = pages[js // B]
                if caches.slot_scaled:    # [Hkv, num_slots]: slot = page * B + offset
                    slots = pg * B + js % B
                    kf, vf = k_scale[h, slots][:, None], v_scale[h, slots][:, None]
                else:
                    kf, vf = k_scale[h], v_scale[h]
                keys = caches.k[pg, js % B, h].to(torch.float64) * kf
                vals = caches.v[pg, js % B, h].to(torch.float64) * vf
                qs = q[t, h * G:(h + 1) * G].to(torch.float64)
                w = torch.softmax(params.softmax_scale * (qs @ keys.T), dim=1)
                res[h * G:(h + 1) * G] = w @ vals
        out[t] = res
    return out


def run_hooks_step(hooks: Any, params: SparseAttentionParams, case: Any, topk: TopkBuffer,
                   out: torch.Tensor) -> None:
    """A plugin's two hooks on ``case``'s step, into a poisoned top-k buffer and output (rows past
    the step's tokens stay poisoned)."""
    T = case.batch.num_tokens
    topk.fill_(POISON_TOPK)
    out.fill_(float("nan"))
    rows = topk.rows(0, T)
    hooks.index_topk(index_q=case.index_q, caches=case.caches, batch=case.batch, params=params, out=rows)
    hooks.attention_forward(q=case.q, caches=case.caches, topk=rows, batch=case.batch, params=params, out=out[:T])


def assert_step_right(case: Any, params: SparseAttentionParams, topk_storage: torch.Tensor, out: torch.Tensor,
                      name: str, layout: str = "token_major", tol: float = 2e-2) -> None:
    """A :func:`run_hooks_step` result against the fp64 references, on every decode token and a
    spread of prefill tokens: the selection, the attention within ``tol``, and the rows past the
    step's tokens untouched."""
    T = case.batch.num_tokens
    sel = TopkBuffer._wrap(topk_storage, layout).rows(0, T)
    toks = sample_tokens(case.batch)
    errors = selection_errors(sel, block_scores(case.index_q, case.caches, case.batch, params, toks), params)
    assert not errors, f"{name}: " + "\n".join(errors[:5])
    ref = attention_reference(case.q, case.caches, sel, case.batch, params, toks)
    err = max((out[t].double() - ref[t]).abs().max().item() for t in toks)
    assert err <= tol, f"{name}: {err} from the fp64 reference"
    assert torch.isnan(out[T:]).all(), f"{name}: output rows past the step's tokens were written"
    assert (TopkBuffer._wrap(topk_storage, layout).head_major()[:, T:] == POISON_TOPK).all(), \
        f"{name}: top-k rows past the step's tokens were written"


def assert_replays_match(graph: torch.cuda.CUDAGraph, case: Any, params: SparseAttentionParams, topk: TopkBuffer,
                         out: torch.Tensor, reference_hooks: Any, draw: Callable[[int], Any],
                         seeds: Iterable[int]) -> None:
    """Replay ``graph``, a captured :func:`run_hooks_step` on ``case``'s tensors, once per seed on new
    data and pages of the same shapes (``draw(seed)``, copied into ``case`` in place): each replay's
    top-k and output bits equal ``reference_hooks`` run eagerly on the same step."""
    T = case.batch.num_tokens
    for seed in seeds:
        new = draw(seed)
        case.batch.update_(new.batch)
        for mine, theirs in ((case.q, new.q), (case.index_q, new.index_q), (case.caches.k, new.caches.k),
                             (case.caches.v, new.caches.v), (case.caches.index, new.caches.index)):
            mine.copy_(theirs)
        graph.replay()
        ref_topk = TopkBuffer.allocate(T, params.num_kv_heads, params.topk, layout=topk.layout, device=out.device)
        ref_out = torch.empty_like(out)
        run_hooks_step(reference_hooks, params, new, ref_topk, ref_out)
        torch.cuda.synchronize()
        assert torch.equal(topk.storage, ref_topk.storage), f"replay {seed}: top-k rows differ"
        assert torch.equal(out.view(torch.int16), ref_out.view(torch.int16)), f"replay {seed}: outputs differ"
