"""Both Triton plugins (cuda: token-major, rocm: head-major) against the fp64 oracle, on the CPU.

The kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest.py before any kernel import), with tiny shapes, in fp16 and fp32
(bf16, which backends/triton/interpreter.py makes right under the interpreter,
runs in tests/test_triton_conformance.py and on the GPU). Every case draws fresh
random inputs, poisons the outputs first, and covers docs/spec.md §5's regressions:
mixed batches with >= 2 decode tokens and >= 2 prefills, H = 1 and H > 1,
T not a multiple of 4, sentinel rows >= T unchanged, and writer and reader
in different layouts.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from dataclasses import dataclass, field
from types import ModuleType

import pytest
import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.errors import InputError
from mm3.contract.params import SparseAttentionParams
from mm3.runtime.backend import Backend
from mm3.runtime.registry import Registry
from mm3.testing.factories import Case, make_case
from mm3.testing.oracle import check_topk, oracle_attention, oracle_topk
from mm3_backends.cuda import plugin as cuda_plugin
from mm3_backends.rocm import plugin as rocm_plugin
from mm3_backends.triton.launch import override

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]

PLUGINS = {"cuda": cuda_plugin, "rocm": rocm_plugin}
CPU = torch.device("cpu")
SENTINEL = -7
# docs/spec.md §4 tolerances against the fp64 oracle: (max, mean)
ATTN_TOL = {torch.float16: (1e-2, 1.5e-4), torch.float32: (1e-5, 1e-5)}


def _params(h: int, g: int, d: int = 32, di: int = 32, block_size: int = 16,
            **kw: int) -> SparseAttentionParams:
    return SparseAttentionParams(num_heads=h * g, num_kv_heads=h, head_dim=d, num_index_heads=h,
                                 index_head_dim=di, block_size=block_size, topk=4, **kw)


@dataclass(frozen=True)
class Spec:
    """One interpreter case: parameters and the factory arguments of its batch."""

    params: SparseAttentionParams
    make: dict = field(default_factory=dict)


CASES = {
    # docs/spec.md §5: 3 decodes (+1 padding, +1 empty) and 3 prefills (one chunked), H > 1,
    # T = 3 + 1 + 20 + 3 + 17 = 44;
    # contexts span up to 9 blocks > topk 4, so both top-k paths must choose
    "mixed_h2_fp16_nhd": Spec(_params(2, 2), dict(
        decodes=[70, 33, 90], prefills=[(20, 130), (3, 3), (17, 17)], padding_decodes=1,
        empty_decodes=1, dtype="float16", index_dtype="float16", kv_layout="NHD")),
    # H = 1 (both layouts share a memory map, so a layout bug hides unless H > 1 is also run),
    # T = 2*3 + 13 + 2 = 21 (not a multiple of 4), spec decode rows, fp8 index cache, HND pages
    "spec3_h1_fp32_hnd_fp8": Spec(_params(1, 4, d=64), dict(
        decodes=[45, 64], prefills=[(13, 110), (2, 2)], decode_query_len=3, padding_decodes=1,
        dtype="float32", index_dtype="float8_e4m3fn", kv_layout="HND")),
    # forced init blocks, GQA group 3 (non power of two rows), bf16 index cache read as fp32,
    # block 32 = two 16-key inner tiles per block under the interpreter config
    "init1_h2_g3_b32_fp32": Spec(_params(2, 3, block_size=32, init_blocks=1), dict(
        decodes=[200, 17], prefills=[(9, 180), (30, 30)], decode_query_len=2,
        dtype="float32", index_dtype="bfloat16", kv_layout="NHD")),
}


def _case(name: str, seed: int) -> Case:
    spec = CASES[name]
    return make_case(spec.params, seed=seed, **spec.make)


def _poisoned_buffer(plugin: ModuleType, T: int, p: SparseAttentionParams, extra: int = 5) -> TopkBuffer:
    buf = plugin.alloc_topk_buffer(T + extra, p.num_kv_heads, p.topk, CPU)
    return buf.fill_(SENTINEL)


def _assert_attention_close(out: torch.Tensor, ref: torch.Tensor, T: int) -> None:
    assert not torch.isnan(out[:T]).any(), "unwritten (NaN-poisoned) output elements"
    err = (out[:T].double() - ref).abs()
    max_tol, mean_tol = ATTN_TOL[out.dtype]
    assert err.max().item() <= max_tol and err.mean().item() <= mean_tol, (
        f"attention error max {err.max().item():.3g} (tol {max_tol}), mean {err.mean().item():.3g} "
        f"(tol {mean_tol})")


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("backend", sorted(PLUGINS))
def test_step_matches_oracle(backend: str, name: str) -> None:
    """Indexer and attention of one plugin on a mixed step, each against the oracle."""
    plugin = PLUGINS[backend]
    case = _case(name, seed=zlib.crc32(f"{backend}/{name}".encode()) % 1000)
    p, T = case.params, case.batch.num_tokens
    buf = _poisoned_buffer(plugin, T, p)
    assert buf.layout == plugin.PLATFORM.topk_layout
    plugin.index_topk(case.index_q, case.caches, case.batch, p, buf.rows(0, T))

    errors = check_topk(buf.rows(0, T), case.index_q, case.caches, case.batch, p)
    assert not errors, "\n".join(map(str, errors[:5]))
    assert (buf.head_major()[:, T:] == SENTINEL).all(), "rows >= T were written"

    # attention reads the buffer this plugin's indexer wrote (its own layout) ...
    ref = oracle_attention(case.q, case.caches, buf.rows(0, T), case.batch, p)
    out = torch.full_like(case.q, float("nan"))
    plugin.attention_forward(case.q, case.caches, buf.rows(0, T), case.batch, p, out)
    _assert_attention_close(out, ref, T)


@pytest.mark.parametrize("backend", sorted(PLUGINS))
def test_reader_in_other_layout(backend: str) -> None:
    """docs/spec.md §5: the attention reads a buffer written in the other layout (the oracle's selection)."""
    plugin = PLUGINS[backend]
    case = _case("mixed_h2_fp16_nhd", seed=11)
    p, T = case.params, case.batch.num_tokens
    other = "head_major" if plugin.PLATFORM.topk_layout == "token_major" else "token_major"
    sel = oracle_topk(case.index_q, case.caches, case.batch, p)
    foreign = TopkBuffer.allocate(T + 3, p.num_kv_heads, p.topk, other, fill=SENTINEL).rows(0, T).copy_(sel)
    out = torch.full_like(case.q, float("nan"))
    plugin.attention_forward(case.q, case.caches, foreign, case.batch, p, out)
    _assert_attention_close(out, oracle_attention(case.q, case.caches, sel, case.batch, p), T)


def test_cross_plugin_buffers() -> None:
    """rocm's indexer (head-major) feeds cuda's attention and vice versa; outputs agree."""
    case = _case("spec3_h1_fp32_hnd_fp8", seed=5)
    p, T = case.params, case.batch.num_tokens
    outs = []
    for writer, reader in (("rocm", "cuda"), ("cuda", "rocm")):
        buf = _poisoned_buffer(PLUGINS[writer], T, p)
        PLUGINS[writer].index_topk(case.index_q, case.caches, case.batch, p, buf.rows(0, T))
        out = torch.full_like(case.q, float("nan"))
        PLUGINS[reader].attention_forward(case.q, case.caches, buf.rows(0, T), case.batch, p, out)
        _assert_attention_close(out, oracle_attention(case.q, case.caches, buf.rows(0, T), case.batch, p), T)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)


def test_forced_splits_and_merge() -> None:
    """Many context splits in the decode indexer and 4 flash-decoding splits with the LSE merge."""
    from mm3_backends.triton import attention, indexer

    cfg = override(cuda_plugin.NVIDIA_LAUNCH, target_programs=64, decode_index=dict(min_blocks=1, max_blocks=2),
                   prefill_index=dict(rows=16), prefill_tiles=dict(rows=16), decode_attention=dict(programs_factor=1))
    p = _params(2, 2, d=32)
    case = make_case(p, decodes=[150, 61, 33], prefills=[(5, 40), (4, 4)], decode_query_len=2,
                     padding_decodes=1, dtype="float16", index_dtype="float16", seed=21)
    T = case.batch.num_tokens
    assert cfg.decode_attention_splits(case.batch.num_decode_tokens, p.num_kv_heads, p.topk) == 4
    buf = TopkBuffer.allocate(T, p.num_kv_heads, p.topk, "head_major", fill=SENTINEL)
    indexer.index_topk(case.index_q, case.caches, case.batch, p, buf, cfg)
    errors = check_topk(buf, case.index_q, case.caches, case.batch, p)
    assert not errors, "\n".join(map(str, errors[:5]))
    out = torch.full_like(case.q, float("nan"))
    attention.attention_forward(case.q, case.caches, buf, case.batch, p, out, cfg)
    _assert_attention_close(out, oracle_attention(case.q, case.caches, buf, case.batch, p), T)


def test_attention_ignores_invalid_and_repeated_ids() -> None:
    """Out-of-range ids and repeats select nothing extra (docs/spec.md §4 treats the selection as a set)."""
    plugin = cuda_plugin
    case = _case("mixed_h2_fp16_nhd", seed=2)
    p, T = case.params, case.batch.num_tokens
    sel = oracle_topk(case.index_q, case.caches, case.batch, p)
    messy = sel.clone()
    view = messy.head_major()
    nb = (case.batch.token_positions.clamp(min=0) // p.block_size + 1)
    valid = case.batch.token_positions >= 0
    # slot 3 repeats slot 0 where the row has room, and an id past the visible range elsewhere
    view[:, :, 3] = torch.where((view[:, :, 3] == -1) & valid, view[:, :, 0], nb.to(torch.int32) + 2)
    out = torch.full_like(case.q, float("nan"))
    plugin.attention_forward(case.q, case.caches, messy, case.batch, p, out)
    # the oracle walks positions j <= p of the *set* of ids, so it is the reference for any row
    _assert_attention_close(out, oracle_attention(case.q, case.caches, messy, case.batch, p), T)


def test_pure_decode_and_pure_prefill() -> None:
    """The decode-only and prefill-only launch paths (one of the two kernels families idle)."""
    p = _params(2, 2)
    for kw in (dict(decodes=[40, 80]), dict(prefills=[(6, 6), (5, 37)])):
        case = make_case(p, dtype="float16", index_dtype="float16", seed=4, **kw)
        T = case.batch.num_tokens
        buf = _poisoned_buffer(rocm_plugin, T, p)
        rocm_plugin.index_topk(case.index_q, case.caches, case.batch, p, buf.rows(0, T))
        assert not check_topk(buf.rows(0, T), case.index_q, case.caches, case.batch, p)
        out = torch.full_like(case.q, float("nan"))
        rocm_plugin.attention_forward(case.q, case.caches, buf.rows(0, T), case.batch, p, out)
        _assert_attention_close(out, oracle_attention(case.q, case.caches, buf.rows(0, T), case.batch, p), T)


# --- the boundary: mm3's bound backend checks, the plugin adds only its own -----------------------------

def _small() -> Case:
    return make_case(_params(2, 2), decodes=[20], prefills=[(3, 3)], dtype="float16",
                     index_dtype="float16", seed=1)


def _bound(plugin: ModuleType) -> Backend:
    return Registry([plugin], entry_points=False).get(plugin.PLATFORM.name)


@pytest.mark.parametrize("mutate, match", [
    (lambda c, o: (c.q.to(torch.bfloat16), c.caches, o), "KV cache dtype"),
    (lambda c, o: (c.q[:, :2], c.caches, o), "heads"),
    (lambda c, o: (c.q, c.caches, o[:, :, :16]), "out has shape"),
    (lambda c, o: (c.q, PagedKVCache(c.caches.k[:, :, :1], c.caches.v[:, :, :1], c.caches.index), o),
     "KV heads"),
])
def test_attention_rejects_bad_inputs(mutate, match: str) -> None:
    case = _small()
    cuda = _bound(cuda_plugin)
    buf = cuda.alloc_topk_buffer(case.batch.num_tokens, 2, 4, CPU)
    q, caches, out = mutate(case, torch.empty_like(case.q))
    with pytest.raises(InputError, match="cuda.attention_forward: .*" + match):
        cuda.attention_forward(q, caches, buf, case.batch, case.params, out)


def test_index_rejects_bad_inputs() -> None:
    case = _small()
    cuda = _bound(cuda_plugin)
    T = case.batch.num_tokens
    small = cuda.alloc_topk_buffer(T - 1, 2, 4, CPU)
    with pytest.raises(InputError, match="holds 3 rows"):
        cuda.index_topk(case.index_q, case.caches, case.batch, case.params, small)
    buf = cuda.alloc_topk_buffer(T, 2, 4, CPU)
    with pytest.raises(InputError, match=r"cuda.index_topk: index_q dtype torch.int32 not in \[.bfloat16., .float16., .float32.\]: outside what backend .cuda. declares"):   # its declared dtypes, at the boundary
        cuda.index_topk(case.index_q.to(torch.int32), case.caches, case.batch, case.params, buf)
    odd = make_case(SparseAttentionParams(num_heads=2, num_kv_heads=1, head_dim=24, num_index_heads=1,
                                          index_head_dim=24, block_size=16, topk=4),
                    decodes=[20], dtype="float16", index_dtype="float16")
    # the tile sizes the capabilities declare are the ones enforced: one list, read at the boundary
    tiles = sorted(cuda.capabilities.index_head_dims or ())
    with pytest.raises(InputError, match=rf"index_head_dim 24 not in \[{', '.join(map(str, tiles))}\]"):
        cuda.index_topk(odd.index_q, odd.caches, odd.batch, odd.params, cuda.alloc_topk_buffer(1, 1, 4, CPU))
    with pytest.raises(InputError, match="block_size 512 not in"):       # a power of two, but not declared
        big = SparseAttentionParams(num_heads=2, num_kv_heads=1, head_dim=32, num_index_heads=1,
                                    index_head_dim=32, block_size=512, topk=4)
        c = make_case(big, decodes=[600], dtype="float16", index_dtype="float16")
        cuda.index_topk(c.index_q, c.caches, c.batch, big, cuda.alloc_topk_buffer(1, 1, 4, CPU))


# --- probes and capabilities ----------------------------------------------------------------------

def test_capabilities_declare_layouts() -> None:
    c, r = cuda_plugin.backend_capabilities(), rocm_plugin.backend_capabilities()
    assert (c.name, c.topk_layout, c.cuda_graph_safe) == ("cuda", "token_major", True)
    assert (r.name, r.topk_layout) == ("rocm", "head_major")
    assert c.priority > 0 and r.priority > 0 and c.max_decode_query_len == 8


def test_probe_cpu_needs_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cuda_plugin.backend_probe(CPU).available
    assert rocm_plugin.backend_probe(CPU).available
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for plugin in PLUGINS.values():
        probe = plugin.backend_probe(CPU)
        assert not probe.available and "TRITON_INTERPRET=1" in probe.reason


def test_rocm_probe_on_non_rocm_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a ROCm build the rocm probe says no and names the test-only override."""
    if torch.version.hip:
        pytest.skip("this is a ROCm build")
    monkeypatch.delenv(rocm_plugin.ALLOW_NON_ROCM_ENV, raising=False)
    probe = rocm_plugin.backend_probe(torch.device("cuda"))
    assert not probe.available and rocm_plugin.ALLOW_NON_ROCM_ENV in probe.reason


# Every kernel path a LaunchConfig can select, so none of them is only ever run on a GPU, against
# the fp64 oracle.
KERNEL_PATHS = {
    "defaults": {},
    # the rocm plugin's kernels: the grid decode attention, the token-tile prefill attention, the
    # NaN count beside the max, one decode split per program's worth of work
    "grid_decode+token_tiles": dict(algorithms=dict(decode_attention_flat=False), numerics=dict(nan_in_max=False),
                                    decode_attention=dict(programs_factor=1), prefill_attention=None),
    # the grid decode attention split over the selection (the merge kernels), a deeper pipeline,
    # many indexer splits, short prefill-index chunks
    "grid_decode_split": dict(algorithms=dict(decode_attention_flat=False),
                              decode_attention=dict(programs_factor=8, stages=3), decode_index=dict(programs_factor=4),
                              prefill_index=dict(chunk=16), prefill_attention=None),
    # persistent decode attention (items straddling programs, several splits), NaN-carrying max,
    # deeper indexer pipeline, prefill key tiles of their own size
    "flat_attention": dict(algorithms=dict(decode_attention_flat=True),
                           decode_attention=dict(flat_programs_per_sm=2), target_programs=64,
                           numerics=dict(nan_in_max=True), decode_index=dict(num_stages=3),
                           prefill_index=dict(block_n=16)),
    # the prefill indexer's visible blocks split over 2 and 4 programs per token tile, merged
    "prefill_index_splits": dict(prefill_index=dict(chunk=8, max_splits=4), target_programs=64),
    "flat_attention_one_split": dict(algorithms=dict(decode_attention_flat=True),
                                     decode_attention=dict(programs_factor=1, flat_programs_per_sm=1),
                                     numerics=dict(nan_in_max=True), target_programs=3),
}


# the default run keeps the shipped configs' paths; the other variants add minutes of interpreter time: -m slow
_SLOW_PATHS = {"grid_decode_split", "flat_attention_one_split", "prefill_index_splits"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p in _SLOW_PATHS else p
                                  for p in sorted(KERNEL_PATHS)])
def test_every_kernel_path_against_the_oracle(path: str) -> None:
    """Spec decode, padding, and a prefill long enough that the chunked top-K merges several chunks."""
    from mm3_backends.triton import attention, indexer
    base = cuda_plugin.PLATFORM.launch_config(CPU)   # the cuda plugin's, interpreted

    cfg = override(base, **KERNEL_PATHS[path])
    p = _params(2, 2, d=32, init_blocks=1)
    case = make_case(p, decodes=[150, 17, 61], prefills=[(24, 700), (5, 5)], decode_query_len=3,
                     padding_decodes=1, dtype="float16", index_dtype="float8_e4m3fn", seed=31)
    T = case.batch.num_tokens
    for layout in ("token_major", "head_major"):
        buf = TopkBuffer.allocate(T + 2, p.num_kv_heads, p.topk, layout, fill=SENTINEL)
        step = buf.rows(0, T)
        indexer.index_topk(case.index_q, case.caches, case.batch, p, step, cfg)
        assert (buf.head_major()[:, T:] == SENTINEL).all()
        errors = check_topk(step, case.index_q, case.caches, case.batch, p)
        assert not errors, "\n".join(map(str, errors[:5]))
        out = torch.full_like(case.q, float("nan"))
        attention.attention_forward(case.q, case.caches, step, case.batch, p, out, cfg)
        _assert_attention_close(out, oracle_attention(case.q, case.caches, step, case.batch, p), T)


def test_fp8_cache_dotted_in_fp16_keeps_extreme_rows() -> None:
    """bf16 index queries against an fp8 cache, dotted in fp16 (``index_fp8_as_f16``).

    Rows span magnitudes fp16 cannot hold unscaled (1e-6 .. 1e6: 1e6 overflows to inf,
    1e-6 is subnormal), so the selection only matches the oracle if the per-row
    power-of-two scaling works. Only bf16 -> fp32 conversions touch bf16 here, which
    the interpreter computes correctly.
    """
    from mm3_backends.triton import indexer
    base = cuda_plugin.PLATFORM.launch_config(CPU)   # the cuda plugin's, interpreted

    p = _params(2, 2, d=32, init_blocks=1)
    case = make_case(p, decodes=[150, 61], prefills=[(24, 300)], decode_query_len=2, padding_decodes=1,
                     dtype="float16", index_dtype="float8_e4m3fn", seed=5)
    scales = torch.tensor([1e-6, 1e6, 3e4, 1e5, 7e-5, 1.0, 2.0 ** -20, 250.0])
    rows = torch.arange(case.index_q.shape[0] * p.num_index_heads) % len(scales)
    index_q = (case.index_q.float().reshape(-1, p.index_head_dim) * scales[rows, None])
    index_q = index_q.reshape(case.index_q.shape).to(torch.bfloat16)
    T = case.batch.num_tokens
    cfg = override(base, numerics=dict(fp8_as_f16=True, nan_in_max=True))
    for layout in ("token_major", "head_major"):
        buf = TopkBuffer.allocate(T + 2, p.num_kv_heads, p.topk, layout, fill=SENTINEL)
        step = buf.rows(0, T)
        indexer.index_topk(index_q, case.caches, case.batch, p, step, cfg)
        errors = check_topk(step, index_q, case.caches, case.batch, p)
        assert not errors, "\n".join(map(str, errors[:5]))


def test_launch_heuristics_follow_their_measured_rules() -> None:
    """The shape-only rules the H200 sweeps chose (BENCHMARKS.md), on an H200-sized config."""
    cfg = cuda_plugin.NVIDIA_LAUNCH.for_device_sms(132)
    # persistent attention: the fewest splits that give each of the 264 programs an item
    assert cfg.decode_attention_splits(num_tokens=64, num_kv_heads=4, topk=16) == 1
    assert cfg.decode_attention_splits(num_tokens=8, num_kv_heads=4, topk=16) == 8
    assert cfg.decode_attention_splits(num_tokens=1, num_kv_heads=4, topk=16) == 16
    assert cfg.decode_attention_flat_items_per_program(256) == 1
    assert cfg.decode_attention_flat_items_per_program(32768) == 125
    # PDL only for small grids
    assert cfg.use_pdl(1, 4) and cfg.use_pdl(8, 4) and not cfg.use_pdl(64, 4)


# --- a bad page id reads a page of the cache, never memory outside it (docs/errors.md §2.6) ---------------

#: pages of poison on either side of the caches; more than the bad ids below reach past either end
_POISON_PAGES = 1024


def _inside_poison(values: torch.Tensor, poison: float) -> torch.Tensor:
    """``values`` as a view of a larger buffer holding ``poison`` in ``_POISON_PAGES`` pages on each
    side, so a kernel that addresses a page outside the cache reads ``poison`` (the interpreter, like
    a GPU, does not bounds-check raw pointers: this is how such a read shows)."""
    n = values.shape[0]
    buf = torch.full((n + 2 * _POISON_PAGES, *values.shape[1:]), poison, dtype=values.dtype)
    view = buf[_POISON_PAGES:_POISON_PAGES + n]
    view.copy_(values)
    return view


def _bad_page_run(index_topk, attention_forward, layout: str) -> None:
    """One decode (6 blocks) and one prefill (7 blocks) whose tables hold ``num_pages + 1000`` and
    ``-1000`` (built without ``num_pages``, so nothing refuses them before the kernels).

    Every index key in the cache is 0, so every real page scores exactly 0 and the selection is the
    forced last block plus the lowest ids; the bad blocks (second to last) are then not chosen. Keys
    outside the cache are 1 against all-positive index queries: a read there scores above every real
    block and changes the selection. K/V outside the cache are NaN: an attention read there makes its
    output NaN.
    """
    p = _params(1, 2, d=16, di=16)
    query_lens, seq_lens = [1, 4], [96, 100]
    case = make_case(p, decodes=seq_lens[:1], prefills=[(query_lens[1], seq_lens[1])], dtype="float32",
                     index_dtype="float32", seed=3)
    c, P, B, T, K = case.caches, case.caches.num_pages, p.block_size, case.batch.num_tokens, p.topk
    caches = PagedKVCache(_inside_poison(c.k, float("nan")), _inside_poison(c.v, float("nan")),
                          _inside_poison(torch.zeros_like(c.index), 1.0))
    bad_table = case.batch.block_table.clone()
    bad_table[0, 4] = P + 1000
    bad_table[1, 5] = -1000
    good, bad = (BatchMetadata.build(query_lens, seq_lens, table, block_size=B, num_decodes=1)
                 for table in (case.batch.block_table, bad_table))
    index_q = case.index_q.abs() + 0.5

    # the indexer: a bad id scores as the real page it is clamped to (0), so the selection is the good one's
    sel = {}
    for name, batch in (("good", good), ("bad", bad)):
        sel[name] = TopkBuffer.allocate(T, p.num_kv_heads, K, layout, fill=SENTINEL)
        index_topk(index_q, caches, batch, p, sel[name])
    good_sel = sel["good"].head_major()[0]
    # the premise: the bad blocks are not chosen, so a read outside the cache (which would choose them) shows
    assert not (good_sel[0] == 4).any() and not (good_sel[1:] == 5).any()
    assert torch.equal(sel["bad"].head_major(), sel["good"].head_major()), (
        "a bad page id changed the selection: the indexer read index keys outside the cache")

    # the attention, on a selection that holds the bad blocks: each token's K highest visible blocks
    nb = bad.token_positions.long() // B + 1
    top = (nb[:, None] - 1 - torch.arange(K)[None, :]).to(torch.int32)          # [T, K], every id >= 0
    assert (top[0] == 4).any() and (top[1:] == 5).any(dim=1).all(), "each token must select its bad block"
    chosen = TopkBuffer.allocate(T, p.num_kv_heads, K, layout)
    chosen.head_major().copy_(top[None])
    out = torch.full_like(case.q, float("nan"))
    attention_forward(case.q, caches, chosen, bad, p, out)
    assert torch.isfinite(out).all(), "the attention read K/V outside the cache (NaN came in)"


@pytest.mark.parametrize("backend", sorted(PLUGINS))
def test_bad_page_id_never_reads_outside_the_cache(backend: str) -> None:
    """The plugins' hooks (the paths they launch) with page ids outside ``[0, num_pages)``."""
    plugin = PLUGINS[backend]
    _bad_page_run(plugin.index_topk, plugin.attention_forward, plugin.PLATFORM.topk_layout)


@pytest.mark.parametrize("path", ["grid_decode+token_tiles", "grid_decode_split"])
def test_bad_page_id_never_reads_outside_the_cache_on_other_paths(path: str) -> None:
    """The same on the kernels the cuda plugin's config does not launch (the grid decode attention
    with and without splits, the token-tile prefill attention)."""
    from functools import partial

    from mm3_backends.triton import attention, indexer
    base = cuda_plugin.PLATFORM.launch_config(CPU)   # the cuda plugin's, interpreted

    cfg = override(base, **KERNEL_PATHS[path])
    _bad_page_run(partial(indexer.index_topk, cfg=cfg), partial(attention.attention_forward, cfg=cfg),
                  "head_major")


# --- the interpreter runs each plugin's own switches --------------------------------------------------------

def _differences(a: object, b: object, prefix: str = "") -> set[str]:
    """The dotted names of the fields where two (nested) config dataclasses differ."""
    if not dataclasses.is_dataclass(a) or not dataclasses.is_dataclass(b):
        return set() if a == b else {prefix.rstrip(".")}
    out: set[str] = set()
    for f in dataclasses.fields(a):
        out |= _differences(getattr(a, f.name), getattr(b, f.name), f"{prefix}{f.name}.")
    return out


@pytest.mark.parametrize("backend", sorted(PLUGINS))
def test_the_interpreter_config_is_the_plugins_with_small_tiles(backend: str) -> None:
    """Under the interpreter a plugin launches with its own config but for the program count and tile
    sizes, so CI runs the switches (kernel choices, numerics, rules) the plugin's GPU runs."""
    from mm3_backends.triton.interpreter_config import for_interpreter

    platform = PLUGINS[backend].PLATFORM
    cfg = platform.launch_config(CPU)
    assert cfg == for_interpreter(platform.launch) and cfg is platform.launch_config(CPU)
    sizes = {"target_programs", "decode_index.block_n", "decode_attention.block_n", "prefill_index.rows",
             "prefill_tiles.rows", "prefill_attention.rows"}
    changed = _differences(cfg, platform.launch)
    assert changed <= sizes and "target_programs" in changed, changed
    assert cfg.algorithms == platform.launch.algorithms and cfg.numerics == platform.launch.numerics


def test_what_the_interpreter_cannot_run_is_skipped_and_said() -> None:
    """The cuda plugin's config asks for direct launches and PDL (small grids) and AMD's launch options
    are the rocm plugin's: under the interpreter none of them can run, so the kernels launch through
    Triton (the fast launcher counts them as such), without PDL and without platform options."""
    from mm3_backends.triton import fast_launch, tl_utils

    cfg = cuda_plugin.PLATFORM.launch_config(CPU)
    assert cfg.algorithms.fast_launch and cfg.use_pdl(1, 1)
    assert not tl_utils.pdl_enabled(cfg, 1, 1), "PDL has no instruction under the interpreter"
    assert rocm_plugin.PLATFORM.launch_config(CPU).launch_options and \
        tl_utils.launch_options(rocm_plugin.PLATFORM.launch_config(CPU)) == {}
    before = fast_launch._DEFAULT.stats()
    case = _small()
    buf = cuda_plugin.alloc_topk_buffer(case.batch.num_tokens, 2, 4, CPU)
    cuda_plugin.index_topk(case.index_q, case.caches, case.batch, case.params, buf)
    after = fast_launch._DEFAULT.stats()
    assert after["direct"] == before["direct"], "an interpreted kernel cannot be launched directly"
    assert after["disabled"] > before["disabled"], "the fast launcher did not see the launches"
