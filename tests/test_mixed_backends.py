"""The indexer from one backend, the attention from another (docs/spec.md §5).

Every pair of the backends available on this machine runs one realistic mixed
step through ``SparseAttention(backend=A, indexer_backend=I)``:

* ``cpu_ref`` (head-major);
* mock backends declaring head-major / token-major, with and without
  ``topk_requires_contiguous`` (strict: they raise on a buffer they would
  misread, so a missing conversion cannot pass unnoticed);
* the example third-party backend ``torch_sdpa_sparse`` (attention only,
  dense token-major);
* ``cuda`` (token-major) and ``rocm`` (head-major) through Triton's
  interpreter, fp32 and fp16, on tiny shapes.

For each pair the selection the indexer wrote must be a valid top-k choice
under the fp64 oracle's scores, the output must equal the oracle's attention
on that selection within the dtype's tolerance, the rows of the persistent
buffer past the step must be untouched, and the selection trace must say
exactly when the core converted the buffer.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import torch

from mm3.contract.buffers import TopkBuffer
from mm3.runtime.config import Settings
from mm3.contract.errors import InputError, PluginError
from mm3.runtime.layer import SparseAttention
from mm3.contract.params import SparseAttentionParams
from mm3.runtime.backend import Backend
from mm3.runtime.registry import Registry
from mm3.testing.factories import Case, make_case
from mm3.testing.helpers import installed_plugin
from mm3.testing.mock import MockBackend
from mm3.testing.oracle import check_topk, oracle_attention, oracle_block_scores

EXAMPLE_SRC = Path(__file__).resolve().parents[1] / "examples" / "third_party_backend" / "src"
SENTINEL = -77
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1.5e-4)}   # (max, mean), docs/spec.md §4
INDEX_DTYPE = {torch.float32: torch.bfloat16, torch.float16: torch.float16}
INTERPRETED = ("cuda", "rocm")

# H = 2 KV heads (the layouts' memory maps differ), speculative decodes of 2 tokens, a padding
# slot between decodes, a chunked and a fresh prefill: T = 3*2 + 2 + 6 + 7 = 21 tokens.
PARAMS = SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
                               index_head_dim=16, block_size=16, topk=4)
STEP = dict(decodes=(70, 33, 150), padding_decodes=1, decode_query_len=2, prefills=((6, 40), (7, 7)))


def _mocks() -> list[MockBackend]:
    return [MockBackend(f"mock_{tag}{'_c' if contiguous else ''}", topk_layout=layout,
                        topk_requires_contiguous=contiguous)
            for (tag, layout), contiguous in itertools.product(
                (("hm", "head_major"), ("tm", "token_major")), (False, True))]


def _example_plugin() -> object:
    if str(EXAMPLE_SRC) not in sys.path:
        sys.path.insert(0, str(EXAMPLE_SRC))
    return importlib.import_module("mm3_sdpa_sparse.plugin")


@pytest.fixture(scope="module")
def registry() -> Registry:
    plugins = [installed_plugin("cpu_ref"), installed_plugin("cuda"), installed_plugin("rocm"),
               _example_plugin(), *_mocks()]
    return Registry(plugins, entry_points=False)


def _available(reg: Registry, name: str) -> bool:
    return reg.get(name).probe("cpu").available


def _pairs(indexers: list[str], attentions: list[str]) -> list[tuple[str, str]]:
    return [(i, a) for i in indexers for a in attentions]


MOCKS = ["mock_hm", "mock_hm_c", "mock_tm", "mock_tm_c"]
FP32_PAIRS = _pairs(["cpu_ref", *MOCKS, *INTERPRETED],
                    ["cpu_ref", *MOCKS, "torch_sdpa_sparse", *INTERPRETED])
FP16_PAIRS = _pairs(["cpu_ref", *INTERPRETED], ["cpu_ref", "torch_sdpa_sparse", *INTERPRETED])


@dataclass
class Oracle:
    """One step and its oracle answers, computed once per dtype (the oracle is slow on purpose)."""

    case: Case
    scores: list[torch.Tensor]
    attention: dict[str, torch.Tensor]

    def attention_for(self, sel: TopkBuffer) -> torch.Tensor:
        hm = sel.head_major().contiguous()
        key = hashlib.sha1(hm.numpy().tobytes()).hexdigest()
        if key not in self.attention:
            self.attention[key] = oracle_attention(self.case.q, self.case.caches, sel, self.case.batch,
                                                   self.case.params)
        return self.attention[key]


@pytest.fixture(scope="module")
def oracles() -> dict[torch.dtype, Oracle]:
    out = {}
    for dtype in TOL:
        case = make_case(PARAMS, dtype=dtype, index_dtype=INDEX_DTYPE[dtype], seed=17, **STEP)
        scores = oracle_block_scores(case.index_q, case.caches, case.batch, PARAMS)
        out[dtype] = Oracle(case, scores, {})
    return out


def _expect_conversion(indexer: Backend, attention: Backend) -> bool:
    a, i = attention.capabilities, indexer.capabilities
    return a.topk_requires_contiguous and a.topk_layout != i.topk_layout


def _run_pair(registry: Registry, oracle: Oracle, indexer: str, attention: str,
              dtype: torch.dtype, settings: Optional[Settings] = None) -> Optional[str]:
    """Run one pair and check everything; returns the conversion note (or None).

    ``settings`` default to the environment's (the suite may turn the contract guard on).
    """
    for name in (indexer, attention):
        if not _available(registry, name):
            pytest.skip(f"{name}: {registry.get(name).probe('cpu').reason}")
    case = oracle.case
    T = case.batch.num_tokens
    layer = SparseAttention(PARAMS, dtype=dtype, index_dtype=INDEX_DTYPE[dtype], max_num_tokens=T + 5,
                            max_decode_query_len=2, backend=attention, indexer_backend=indexer,
                            registry=registry, settings=settings)
    sel = layer.selection
    assert (sel.indexer.name, sel.attention.name) == (indexer, attention)
    full = layer.topk_buffer.fill_(SENTINEL)
    for be in (sel.indexer, sel.attention):
        if isinstance(be.plugin, MockBackend):
            be.plugin.reset()

    out = layer(case.q, case.index_q, case.caches, case.batch)

    # The buffer belongs to the indexer's layout; rows past the step are nobody's business.
    assert full.layout == sel.indexer.capabilities.topk_layout
    assert bool((full.head_major()[:, T:] == SENTINEL).all()), \
        f"{indexer} -> {attention} wrote rows past the step's {T}"
    written = full.rows(0, T)
    bad = check_topk(written, case.index_q, case.caches, case.batch, PARAMS, scores=oracle.scores)
    assert not bad, f"{indexer} wrote invalid top-k rows: {[str(b) for b in bad[:3]]}"

    ref = oracle.attention_for(written)
    err = (out.double() - ref).abs()
    max_tol, mean_tol = TOL[dtype]
    assert err.max() <= max_tol and err.mean() <= mean_tol, \
        f"{indexer} -> {attention} ({dtype}): max {err.max():.3g}, mean {err.mean():.3g}"

    # What the attention received: its own layout when it needs one, converted by the core.
    att = sel.attention
    if isinstance(att.plugin, MockBackend):
        (call,) = att.plugin.calls_to("attention_forward")
        given: TopkBuffer = call.args["topk"]
        if att.capabilities.topk_requires_contiguous:
            assert given.layout == att.capabilities.topk_layout and given.is_dense()
        else:
            assert given.storage.data_ptr() == written.storage.data_ptr(), "copied without need"

    expected = _expect_conversion(sel.indexer, att)
    explain = layer.explain()
    assert (sel.topk_conversion is not None) == expected, sel.topk_conversion
    assert ("top-k conversion:" in explain) == expected, explain
    if expected:
        assert (f"indexer {indexer!r} writes a {sel.indexer.capabilities.topk_layout} top-k buffer"
                in explain)
        assert f"attention {attention!r} requires a contiguous {att.capabilities.topk_layout}" in explain
    return sel.topk_conversion


@pytest.mark.parametrize("indexer,attention", FP32_PAIRS, ids=[f"{i}->{a}" for i, a in FP32_PAIRS])
def test_pair_fp32(registry: Registry, oracles: dict, indexer: str, attention: str) -> None:
    _run_pair(registry, oracles[torch.float32], indexer, attention, torch.float32)


@pytest.mark.slow   # the fp32 pairs cover every layout pairing in the default run; fp16 adds the dtype
@pytest.mark.parametrize("indexer,attention", FP16_PAIRS, ids=[f"{i}->{a}" for i, a in FP16_PAIRS])
def test_pair_fp16(registry: Registry, oracles: dict, indexer: str, attention: str) -> None:
    _run_pair(registry, oracles[torch.float16], indexer, attention, torch.float16)


def test_the_matrix_covers_every_layout_combination(registry: Registry) -> None:
    seen = set()
    for i, a in FP32_PAIRS:
        ci, ca = registry.get(i).capabilities, registry.get(a).capabilities
        seen.add((ci.topk_layout, ca.topk_layout, ca.topk_requires_contiguous))
    layouts = ("head_major", "token_major")
    assert seen == set(itertools.product(layouts, layouts, (False, True)))


def test_strict_reader_rejects_an_unconverted_buffer(registry: Registry, oracles: dict) -> None:
    """Without the core's conversion a dense-token-major reader fails: the check above has teeth."""
    case = oracles[torch.float32].case
    T = case.batch.num_tokens
    head_major = TopkBuffer.allocate(T, PARAMS.num_kv_heads, PARAMS.topk, "head_major")
    out = torch.empty_like(case.q)
    for name in ("mock_tm_c", "torch_sdpa_sparse"):
        with pytest.raises(InputError, match="token_major"):
            registry.get(name).attention_forward(case.q, case.caches, head_major, case.batch, PARAMS, out)


def test_a_mislabelled_buffer_is_caught(oracles: dict) -> None:
    """vLLM's bug (storage in one layout, labelled as the other) cannot even be allocated for H > 1.

    The contract guard is off here: TopkBuffer itself refuses the storage.
    """
    liar = MockBackend("liar", ops={"index_topk"}, topk_layout="token_major", fault="wrong_layout")
    reg = Registry([installed_plugin("cpu_ref"), liar], entry_points=False)
    with pytest.raises(PluginError, match="'liar'.*alloc_topk_buffer built an invalid top-k buffer"):
        _run_pair(reg, oracles[torch.float32], "liar", "cpu_ref", torch.float32,
                  settings=Settings(check_contracts=False))
