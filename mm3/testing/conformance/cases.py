"""The conformance cases: what each one builds, runs and checks.

Every case builds a fresh random step with :func:`~mm3.testing.factories.make_case`
(N(0, 1) values, randomly permuted pages, ``-1`` in unused block-table
entries), runs the backend on it and compares with the fp64 oracle:

* **indexer** cases run ``index_topk`` into ``rows(0, T)`` of a buffer from the
  backend's own ``alloc_topk_buffer`` with spare rows filled with a sentinel,
  then check every row with :func:`~mm3.testing.oracle.check_topk` (format,
  forced blocks, tie-tolerant optimality) and that the spare rows are intact;
  the ``exact_ties*`` cases plant exact ties in the index keys (:data:`TIES`:
  every page the same, one key everywhere, duplicated pages, ties across the
  top-k boundary, NaN blocks), and they and ``nan_index_query`` require the
  oracle's selection (lowest ids first) bit for bit;
* **attention** cases give every backend the *same* selection (the oracle's,
  or the reference indexer's) and a NaN-poisoned output with spare rows, then
  compare with :func:`~mm3.testing.oracle.oracle_attention` under docs/spec.md §4's
  tolerances, require exact zeros on padding tokens and untouched spare rows;
* **composed** cases run the backend's indexer then its attention on the same
  buffer, and check both;
* **buffer** cases are docs/spec.md §5's regressions: sentinel rows past the step,
  the allocated layout, and writers/readers in different layouts.

Shapes are tiny (block 16, top-4 for the indexer, head dims 32/64) so an
interpreted GPU backend runs the quick plan (each step once, the dtypes in
turn) in a few minutes on two cores. Attention and
composed cases use top-16 (M3's value) and contexts of 300-600 tokens, so most
tokens attend to 256 keys, as most tokens of a real step attend to many keys.
This matters for docs/spec.md §4's *absolute* tolerances: with N(0, 1) inputs an
output's magnitude falls like 1/sqrt(keys), and so does the error of merely
rounding a perfect result to bf16. With top-4 of 16-token blocks that
rounding floor alone is about 3e-4, the whole bf16 mean budget; here it is
about 1e-4. Every attention result reports it as ``floor_mean``.
"""

from __future__ import annotations

import time
import traceback
import zlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from mm3.contract.buffers import TopkBuffer
from mm3.contract.params import SparseAttentionParams
from mm3.testing.conformance.oracle_cache import oracle_topk_cached
from mm3.testing.conformance.verdicts import (
    OUT_POISON, SENTINEL, TOLERANCES, CaseFailure, check_attention, check_exact_selection, check_selection,
    check_spare_rows, poisoned_out,
)
from mm3.testing.factories import Case, as_token_slots, make_case

if TYPE_CHECKING:
    from mm3.runtime.backend import Backend

__all__ = ["Step", "CaseSpec", "CaseContext", "CaseFailure", "TOLERANCES", "SENTINEL", "OUT_POISON",
           "INDEXER_STEPS", "ATTENTION_STEPS", "COMPOSED_STEPS", "LARGE_STEPS", "BUFFER_CASES"]

@dataclass(frozen=True)
class Step:
    """A step's shape: heads, sizes, policy and the batch (decode seq_lens, prefill (q, seq))."""

    H: int = 2
    G: int = 2
    D: int = 32
    Di: int = 32
    B: int = 16
    K: int = 4
    init: int = 0
    local: int = 1
    decodes: tuple[int, ...] = ()
    dq: int = 1
    prefills: tuple[tuple[int, int], ...] = ()
    padding: int = 0
    empty: int = 0
    kv_layout: str = "NHD"
    nan_tokens: tuple[int, ...] = ()
    ties: str = ""   # exact ties planted in the index keys (TIES); selections must equal the oracle's
    # "head" / "tensor" / "slot" / "unit": K/V in fp8 (kv_format), scales per head / tensor / (head, slot),
    # or the one scale 1.0 (an engine's fp8 cache without scales)
    kv_fp8: str = ""
    kv_format: str = "float8_e4m3fn"  # the fp8 format of K/V when kv_fp8 is set: float8_e4m3fn or float8_e5m2
    # the model authors' formats (docs/spec.md §1): fp8 queries, K/V in "float8_e4m3fn_unscaled" or "nvfp4",
    # an "nvfp4" index cache, and how requests map to pages (mm3.testing.factories.PAGE_ORDERS)
    q8: bool = False
    kv_quant: str = ""
    index_format: str = ""
    pages: str = "permuted"
    # "slots": the same step through token slots (mm3.testing.factories.as_token_slots): a slot table row per
    # request, a random permutation of one-token cache pages; a backend must declare addressings "slots"
    addressing: str = "pages"

    @property
    def kv_dtype(self) -> Optional[str]:
        """The K/V cache format when it is not the attention dtype (scaled fp8, unscaled e4m3, NVFP4), else ``None``."""
        return self.kv_quant or (self.kv_format if self.kv_fp8 else None)

    def params(self) -> SparseAttentionParams:
        return SparseAttentionParams(num_heads=self.H * self.G, num_kv_heads=self.H, head_dim=self.D,
                                     num_index_heads=self.H, index_head_dim=self.Di, block_size=self.B,
                                     topk=self.K, init_blocks=self.init, local_blocks=self.local)

    def build(self, dtype: str, index_dtype: str, device: torch.device, seed: int) -> Case:
        case = make_case(self.params(), decodes=self.decodes, prefills=self.prefills,
                         decode_query_len=self.dq, padding_decodes=self.padding, empty_decodes=self.empty,
                         dtype=dtype, index_dtype=self.index_format or index_dtype, kv_layout=self.kv_layout,
                         device=device, seed=seed, kv_dtype=self.kv_dtype, kv_scale=self.kv_fp8 or "head",
                         q_dtype="float8_e4m3fn" if self.q8 else None, pages=self.pages)
        for t in self.nan_tokens:
            case.index_q[t, 0, 1] = float("nan")
        if self.ties:
            TIES[self.ties](case.caches.index)
        if self.addressing == "slots":
            case = as_token_slots(case, torch.Generator().manual_seed(seed + 1))
        return case

    @property
    def exact(self) -> bool:
        """Whether equal block scores are planted: the selection must be the oracle's, bit for bit."""
        return bool(self.ties or self.nan_tokens)


def _same_pages(index: torch.Tensor) -> None:
    index.copy_(index[:1].expand_as(index))


def _all_equal(index: torch.Tensor) -> None:
    index.copy_(index[:1, :1].expand_as(index))


def _duplicated_pages(index: torch.Tensor) -> None:
    index[1::2].copy_(index[0::2][: index[1::2].shape[0]])


def _half_tied(index: torch.Tensor) -> None:
    index[0::2].copy_(index[:1].expand_as(index[0::2]))


def _nan_pages(index: torch.Tensor) -> None:
    index[index.shape[0] // 3:, 3, 0] = float("nan")     # one position poisons its block


TIES: dict[str, Callable[[torch.Tensor], None]] = {
    "same_pages": _same_pages,              # every page holds page 0's keys: all full blocks tie
    "all_equal": _all_equal,                # one key everywhere: every block, partial ones too, ties
    "duplicated_pages": _duplicated_pages,  # odd pages copy the even ones: blocks tie in pairs
    "half_tied": _half_tied,                # even pages tie, odd ones do not: ties across the top-k boundary
    "nan_pages": _nan_pages,                # a NaN key in 2/3 of the pages: those blocks rank last, tie
}
"""docs/spec.md §3.4-3.5's exact ties, planted in a step's index cache (in place)."""


@dataclass(frozen=True)
class CaseContext:
    """What a case body needs: the backend, the device and the optional reference indexer."""

    backend: "Backend"
    device: torch.device
    reference_indexer: Optional["Backend"] = None


Body = Callable[[CaseContext, "CaseSpec"], dict[str, Any]]


@dataclass(frozen=True)
class CaseSpec:
    """One case, resolved to dtypes: ``run(ctx)`` returns a pass/fail outcome.

    ``ops`` are the backend ops it needs; ``dtype`` is the attention (and
    query) dtype, ``index_dtype`` the index cache dtype.
    """

    name: str
    kind: str
    step: Step
    body: Body
    ops: frozenset[str]
    dtype: str
    index_dtype: str
    needs_any_layout: bool = False   # the backend itself must write a non-native layout
    extra: dict[str, Any] = field(default_factory=dict)
    salt: int = 0

    @property
    def seed(self) -> int:
        """The case's random seed: stable per case name, varied by ``salt`` (``run_conformance(seed=)``)."""
        return zlib.crc32(f"{self.name}#{self.salt}".encode()) & 0x7FFFFFFF

    def run(self, ctx: CaseContext) -> tuple[bool, str, dict[str, Any], float]:
        """``(passed, message, details, elapsed_s)``; exceptions from the backend fail the case."""
        t0 = time.perf_counter()
        try:
            details = self.body(ctx, self)
            return True, "", details, time.perf_counter() - t0
        except CaseFailure as e:
            return False, str(e), e.details, time.perf_counter() - t0
        except Exception as e:  # a backend crash is a failed case, not a crashed suite
            return (False, f"{type(e).__name__}: {e}", {"traceback": traceback.format_exc()},
                    time.perf_counter() - t0)


# -- helpers ------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], None]) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _alloc(ctx: CaseContext, case: Case, capacity: int) -> TopkBuffer:
    """A buffer from the backend, filled with the sentinel.

    The bound backend already refuses a wrong type, label or shape, and
    :class:`TopkBuffer` storage whose memory contradicts its label; the suite
    also wants it contiguous and on the device asked for.
    """
    p = case.params
    buf = ctx.backend.alloc_topk_buffer(capacity, p.num_index_heads, p.topk, ctx.device)
    if not buf.is_contiguous():
        raise CaseFailure(
            f"alloc_topk_buffer returned a {buf.layout} buffer whose storage is not contiguous (strides "
            f"{tuple(buf.storage.stride())} for shape {tuple(buf.storage.shape)}); allocate with "
            f"TopkBuffer.allocate(..., layout={buf.layout!r})")
    want = torch.device(ctx.device)
    # "cuda" names whichever GPU is current; the buffer reports "cuda:0": compare the index only if asked.
    if buf.device.type != want.type or (want.index is not None and buf.device.index != want.index):
        raise CaseFailure(f"alloc_topk_buffer put the buffer on {buf.device}, asked for {ctx.device}")
    return buf.fill_(SENTINEL)


def _selection(ctx: CaseContext, case: Case) -> TopkBuffer:
    """The selection every backend's attention gets: the reference indexer's, else the oracle's."""
    p, T = case.params, case.batch.num_tokens
    ref = ctx.reference_indexer
    if ref is None:
        return oracle_topk_cached(case)
    buf = ref.alloc_topk_buffer(T, p.num_index_heads, p.topk, ctx.device)
    ref.index_topk(case.index_q, case.caches, case.batch, p, buf)
    return buf


def _to_consumer(ctx: CaseContext, buf: TopkBuffer) -> TopkBuffer:
    """What the core hands the attention: a dense copy in its layout only when it asks for one."""
    caps = ctx.backend.capabilities
    return buf if caps.accepts_topk(buf.layout, buf.is_dense()) else buf.to_layout(caps.topk_layout)


def _other(layout: str) -> str:
    return "token_major" if layout == "head_major" else "head_major"


# -- case bodies ------------------------------------------------------------------------------


def indexer_body(ctx: CaseContext, spec: CaseSpec) -> dict[str, Any]:
    """Indexer into rows(0, T) of the backend's own buffer with spare sentinel rows."""
    case = spec.step.build(spec.dtype, spec.index_dtype, ctx.device, spec.seed)
    T = case.batch.num_tokens
    spare = spec.extra.get("spare_rows", 3)
    full = _alloc(ctx, case, T + spare)
    sel = full.rows(0, T)
    details: dict[str, Any] = {"tokens": T, "layout": full.layout}
    details["backend_s"] = _timed(ctx.device, lambda: ctx.backend.index_topk(
        case.index_q, case.caches, case.batch, case.params, sel))
    check_spare_rows(full, 0, T, "index_topk")
    check_selection(case, sel, details, ctx.backend.capabilities.topk_order)
    if spec.step.exact:
        check_exact_selection(case, sel)
    return details


def indexer_other_layout_body(ctx: CaseContext, spec: CaseSpec) -> dict[str, Any]:
    """Indexer writes rows(0, T) of a larger buffer in the layout it does *not* prefer."""
    case = spec.step.build(spec.dtype, spec.index_dtype, ctx.device, spec.seed)
    p, T = case.params, case.batch.num_tokens
    layout = _other(ctx.backend.capabilities.topk_layout)
    full = TopkBuffer.allocate(T + 4, p.num_index_heads, p.topk, layout, ctx.device, fill=SENTINEL)
    sel = full.rows(0, T)
    details: dict[str, Any] = {"tokens": T, "layout": layout}
    details["backend_s"] = _timed(ctx.device, lambda: ctx.backend.index_topk(
        case.index_q, case.caches, case.batch, p, sel))
    check_spare_rows(full, 0, T, "index_topk")
    check_selection(case, sel, details, ctx.backend.capabilities.topk_order)
    return details


def attention_body(ctx: CaseContext, spec: CaseSpec) -> dict[str, Any]:
    """Attention on the shared selection, delivered as ``spec.extra['delivery']`` says.

    ``own`` (default): rows(0, T) of the backend's own buffer; ``other``: rows(0, T)
    of a larger buffer in the other layout (converted first if the backend needs
    a dense buffer in its layout); ``offset``: rows(3, T+3) of a larger own-layout buffer.
    """
    case = spec.step.build(spec.dtype, spec.index_dtype, ctx.device, spec.seed)
    p, T = case.params, case.batch.num_tokens
    shared = _selection(ctx, case)
    delivery = spec.extra.get("delivery", "own")
    if delivery == "own":
        full = _alloc(ctx, case, T + 2)
        start = 0
    else:
        layout = ctx.backend.capabilities.topk_layout if delivery == "offset" else \
            _other(ctx.backend.capabilities.topk_layout)
        full = TopkBuffer.allocate(T + 6, p.num_index_heads, p.topk, layout, ctx.device, fill=SENTINEL)
        start = 3 if delivery == "offset" else 0
    given = full.rows(start, start + T).copy_(shared)
    given = _to_consumer(ctx, given)
    out = poisoned_out(case)
    details: dict[str, Any] = {"tokens": T, "topk_given": f"{given.layout}{'' if given.is_dense() else ' (strided)'}"}
    details["backend_s"] = _timed(ctx.device, lambda: ctx.backend.attention_forward(
        case.q, case.caches, given, case.batch, p, out[:T]))
    check_spare_rows(full, start, start + T, "attention_forward")
    if not torch.equal(full.rows(start, start + T).head_major().cpu(), shared.head_major().cpu()):
        raise CaseFailure("attention_forward modified the top-k buffer it was given (it must only read it)",
                          details)
    check_attention(case, shared.to_layout("head_major"), out, details)
    return details


def composed_body(ctx: CaseContext, spec: CaseSpec) -> dict[str, Any]:
    """The backend's indexer, then its attention, on rows(0, T) of its own buffer."""
    case = spec.step.build(spec.dtype, spec.index_dtype, ctx.device, spec.seed)
    p, T = case.params, case.batch.num_tokens
    full = _alloc(ctx, case, T + 3)
    sel = full.rows(0, T)
    out = poisoned_out(case)
    details: dict[str, Any] = {"tokens": T}
    details["index_s"] = _timed(ctx.device, lambda: ctx.backend.index_topk(
        case.index_q, case.caches, case.batch, p, sel))
    given = _to_consumer(ctx, sel)
    details["attention_s"] = _timed(ctx.device, lambda: ctx.backend.attention_forward(
        case.q, case.caches, given, case.batch, p, out[:T]))
    check_spare_rows(full, 0, T, "index_topk/attention_forward")
    check_selection(case, sel, details, ctx.backend.capabilities.topk_order)
    check_attention(case, sel.to_layout("head_major"), out, details)
    return details


# -- the steps ----------------------------------------------------------------------------------

MIXED_H1 = Step(H=1, G=4, decodes=(120, 65, 40), prefills=((23, 23), (31, 180)))
MIXED_H2 = Step(H=2, G=2, decodes=(100, 33), padding=1, empty=1, prefills=((20, 20), (37, 150), (5, 40)))

INDEXER_STEPS: dict[str, Step] = {
    "mixed_h1": MIXED_H1,
    "mixed_h2": MIXED_H2,
    "mixed_h4_di64": Step(H=4, G=1, Di=64, decodes=(77, 16, 200), prefills=((9, 90), (41, 41))),
    "spec_decode_q2": Step(H=1, G=4, dq=2, decodes=(90, 31, 150), prefills=((13, 70),)),
    "spec_decode_q3": Step(H=2, G=2, dq=3, decodes=(64, 200), padding=1, prefills=((11, 11), (7, 100))),
    "spec_decode_q4": Step(H=2, G=4, dq=4, decodes=(50, 170, 17), prefills=((30, 130),)),
    "padding_decodes": Step(H=2, G=2, dq=2, decodes=(80,), padding=2, empty=2, prefills=((6, 50),)),
    "init2_local0": Step(H=2, init=2, local=0, decodes=(150, 40, 20), prefills=((25, 25), (17, 120))),
    "init2_local1": Step(H=2, init=2, local=1, decodes=(150, 40, 20), prefills=((25, 25), (17, 120))),
    "init1_local2": Step(H=2, init=1, local=2, decodes=(150, 40, 20), prefills=((25, 25), (17, 120))),
    "short_contexts": Step(H=2, K=6, decodes=(1, 17, 50), prefills=((5, 5), (10, 60))),
    "nan_index_query": Step(H=2, init=1, decodes=(120, 90), prefills=((10, 100),), nan_tokens=(1, 5)),
    "exact_ties": Step(H=2, decodes=(150, 70, 20), prefills=((25, 25), (17, 120)), ties="same_pages"),
    **{f"exact_ties_{name}": Step(H=2, decodes=(150, 70, 20), prefills=((6, 120),), ties=name)
       for name in TIES if name != "same_pages"},
    "hnd_kv_cache": replace(MIXED_H2, kv_layout="HND"),
    # token slots (docs/spec.md §2): every key through a slot table; a backend must declare addressings "slots"
    "token_slots_mixed": replace(MIXED_H2, addressing="slots"),
    "token_slots_spec_decode_q3": Step(H=2, G=2, dq=3, decodes=(64, 200), padding=1, prefills=((11, 11), (7, 100)),
                                       addressing="slots"),
    "token_slots_shared_prefix": Step(H=2, decodes=(150, 70, 40), prefills=((6, 120),), pages="shared_prefix",
                                      addressing="slots"),
}

ATTENTION_STEPS: dict[str, Step] = {
    "mixed_h1_g8": Step(H=1, G=8, D=64, K=16, decodes=(600, 340, 410), padding=1,
                        prefills=((40, 520), (3, 3))),
    "mixed_h2_g2": Step(H=2, G=2, K=16, decodes=(500, 280), prefills=((4, 4), (33, 460))),
    "spec_decode_q4": Step(H=2, G=4, K=16, dq=4, decodes=(440, 360, 9), padding=1, prefills=((30, 600),)),
    "chunked_prefill": Step(H=1, G=4, D=64, K=16, decodes=(520,), prefills=((64, 640), (48, 400))),
    "hnd_kv_cache": Step(H=2, G=4, K=16, dq=2, decodes=(400, 300), prefills=((21, 360),), kv_layout="HND"),
    "padding_decodes": Step(H=1, G=4, K=16, dq=2, decodes=(360,), padding=3, empty=1,
                            prefills=((9, 400),)),
    # fp8 K/V with scales (docs/spec.md §1), compared with the oracle on the dequantized cache
    "kv_fp8_mixed": Step(H=2, G=4, K=16, decodes=(420, 300), padding=1, prefills=((6, 380),), kv_fp8="head"),
    "kv_fp8_spec_decode_hnd": Step(H=1, G=8, D=64, K=16, dq=3, decodes=(400,), prefills=((5, 330),),
                                   kv_layout="HND", kv_fp8="tensor"),
    # scales per (KV head, token slot), vLLM's [num_kv_heads, num_slots]: a backend must declare kv_slot_scales
    "kv_fp8_slot_mixed": Step(H=2, G=4, K=16, decodes=(420, 300), padding=1, prefills=((6, 380),), kv_fp8="slot"),
    "kv_fp8_slot_spec_decode_hnd": Step(H=1, G=8, D=64, K=16, dq=3, decodes=(400,), prefills=((5, 330),),
                                        kv_layout="HND", kv_fp8="slot"),
    # fp8 e5m2 K/V (vLLM's fp8_e5m2): a backend must list float8_e5m2 in kv_cache_dtypes
    "kv_e5m2_mixed": Step(H=2, G=4, K=16, decodes=(420, 300), padding=1, prefills=((6, 380),), kv_fp8="head",
                          kv_format="float8_e5m2"),
    "kv_e5m2_spec_decode_hnd": Step(H=1, G=8, D=64, K=16, dq=3, decodes=(400,), prefills=((5, 330),),
                                    kv_layout="HND", kv_fp8="tensor", kv_format="float8_e5m2"),
    "kv_e5m2_slot_mixed": Step(H=2, G=4, K=16, decodes=(420, 300), padding=1, prefills=((6, 380),), kv_fp8="slot",
                               kv_format="float8_e5m2"),
    "token_slots_mixed": Step(H=2, G=2, K=16, decodes=(500, 280), padding=1, prefills=((4, 4), (33, 460)),
                              addressing="slots"),
    "token_slots_spec_decode_q4": Step(H=2, G=4, K=16, dq=4, decodes=(440, 360, 9), padding=1,
                                       prefills=((30, 600),), addressing="slots"),
    "token_slots_chunked_prefill": Step(H=1, G=4, D=64, K=16, decodes=(520,), prefills=((64, 640), (48, 400)),
                                        pages="shared_prefix", addressing="slots"),
    "token_slots_fp8_slot_scales": Step(H=2, G=4, K=16, decodes=(420, 300), padding=1, prefills=((6, 380),),
                                    kv_fp8="slot", addressing="slots"),
    "kv_e5m2_unscaled_spec_decode": Step(H=1, G=8, D=64, K=16, dq=2, decodes=(330, 170), prefills=((7, 290),),
                                         kv_fp8="unit", kv_format="float8_e5m2"),
}

COMPOSED_STEPS: dict[str, Step] = {
    "mixed": Step(H=2, G=4, K=16, decodes=(460, 260, 80), padding=1, prefills=((3, 3), (40, 520))),
    "spec_decode_hnd": Step(H=1, G=8, D=64, Di=64, K=16, dq=3, decodes=(600, 240), prefills=((28, 400),),
                            kv_layout="HND"),
    "token_slots_mixed": Step(H=2, G=4, K=16, dq=2, decodes=(460, 260), padding=1, prefills=((3, 3), (40, 520)),
                              pages="shared_prefix", addressing="slots"),
}

LARGE_STEPS: dict[str, Step] = {
    "large": Step(H=2, G=4, D=128, Di=128, B=32, K=8, dq=2, decodes=(1500, 900, 333),
                  prefills=((12, 12), (96, 1200))),
    # fp8 K/V composed with a bf16 and an fp8 index cache (the quick plan has the fp8 attention cases)
    "large_kv_fp8": Step(H=2, G=4, D=128, Di=128, B=32, K=8, dq=2, decodes=(1400, 700), padding=1,
                         prefills=((9, 9), (80, 1100)), kv_fp8="head"),
    "large_kv_e5m2_slot": Step(H=2, G=4, D=128, Di=128, B=32, K=8, dq=2, decodes=(1300, 800), padding=1,
                               prefills=((11, 11), (70, 1000)), kv_fp8="slot", kv_format="float8_e5m2"),
}
"""Bigger shapes, added when ``quick=False`` (indexer, attention and composed)."""

BUFFER_CASES: dict[str, tuple[str, Step, dict[str, Any]]] = {
    # name: (body kind, step, extra)
    "sentinel_rows_h1": ("indexer", MIXED_H1, {"spare_rows": 61}),
    "sentinel_rows_h2": ("indexer", MIXED_H2, {"spare_rows": 70}),
    "indexer_writes_other_layout_h2": ("indexer_other", MIXED_H2, {}),
    "attention_reads_other_layout_h1": ("attention", ATTENTION_STEPS["mixed_h1_g8"], {"delivery": "other"}),
    "attention_reads_other_layout_h2": ("attention", ATTENTION_STEPS["mixed_h2_g2"], {"delivery": "other"}),
    "attention_reads_offset_rows_h2": ("attention", ATTENTION_STEPS["spec_decode_q4"], {"delivery": "offset"}),
}
"""docs/spec.md §5 regressions: sentinel rows (capacity about 2T), layouts of writer and reader."""

BODIES: dict[str, Body] = {
    "indexer": indexer_body,
    "indexer_other": indexer_other_layout_body,
    "attention": attention_body,
    "composed": composed_body,
}
