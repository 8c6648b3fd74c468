"""Safe defaults on the GPU (docs/errors.md §2.1, §2.6): bad page ids raise on the cuda backend.

* the first step of a shape class is checked on the host and raises at once, naming request, block and id;
* in steady state the check runs on the device without a sync and raises at the next step
  (or at ``SparseAttention.check_page_ids()``), and the layer stays usable;
* under CUDA-graph capture the check is captured: a replay with a bad id in the refreshed
  table raises at ``check_page_ids()``; capture itself never runs the guard.
"""

from __future__ import annotations

import pytest
import torch

from mm3 import BatchMetadata, SparseAttentionParams
from mm3.runtime.config import Settings
from mm3.contract.errors import InputError
import mm3.debug.guard as guard_mod
from mm3.runtime.layer import SparseAttention
from mm3.testing.factories import Case, make_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _params() -> SparseAttentionParams:
    return SparseAttentionParams(num_heads=8, num_kv_heads=1, head_dim=128, num_index_heads=1,
                                 index_head_dim=128, block_size=128, topk=16)


def _case(seed: int = 0) -> Case:
    return make_case(_params(), decodes=[3000, 1700, 900, 5000], device="cuda", seed=seed)


def _bad(case: Case, page: int) -> BatchMetadata:
    b = case.batch
    bt = b.block_table.clone()
    bt[1, 2] = page
    return BatchMetadata.build(b.query_lens, b.seq_lens_host, bt, block_size=b.block_size,
                               num_decodes=b.num_decodes)


def _layer(cuda_graph: bool = False) -> SparseAttention:
    return SparseAttention(_params(), device="cuda", max_num_tokens=64, backend="cuda",
                           settings=Settings(check_contracts="first", backend="cuda"), cuda_graph=cuda_graph)


@pytest.mark.parametrize("page", [-1, 1 << 20])
def test_bad_page_id_on_the_first_step_raises_at_once(page: int) -> None:
    layer, case = _layer(), _case()
    with pytest.raises(InputError, match=rf"request 1, block 2: batch.block_table\[1, 2\] = {page} is not a page id"):
        layer(case.q, case.index_q, case.caches, _bad(case, page))


@pytest.mark.parametrize("page", [-3, 1 << 20])
def test_bad_page_id_in_steady_state_raises_at_the_next_step(page: int) -> None:
    layer, case = _layer(), _case()
    layer(case.q, case.index_q, case.caches, case.batch)                  # "decode" checked
    layer(case.q, case.index_q, case.caches, _bad(case, page))            # device flag, no sync
    torch.cuda.synchronize()
    with pytest.raises(InputError, match=r"request 1, block 2: batch.block_table\[1, 2\] is not a page id .*found on the device"):
        layer(case.q, case.index_q, case.caches, case.batch)
    good = layer(case.q, case.index_q, case.caches, case.batch)            # usable again
    assert torch.isfinite(good).all()
    layer.check_page_ids()                                                 # nothing pending


def test_graph_capture_skips_the_guard_and_replays_check_page_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, case = _layer(cuda_graph=True), _case()
    layer(case.q, case.index_q, case.caches, case.batch)                  # eager warm-up, guarded
    guarded: list[int] = []
    real = guard_mod.checked_call
    monkeypatch.setattr(guard_mod, "checked_call", lambda *a, **k: guarded.append(1) or real(*a, **k))
    b = case.batch
    static = BatchMetadata.build(b.query_lens, b.seq_lens_host, b.block_table.clone(), block_size=b.block_size,
                                 num_decodes=b.num_decodes)
    out = torch.empty_like(case.q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(case.q, case.index_q, case.caches, static, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(case.q, case.index_q, case.caches, static, out=out)
    assert guarded == []
    graph.replay()
    layer.check_page_ids()                                                 # a good table: nothing
    static.update_(_bad(case, 1 << 20))
    graph.replay()
    with pytest.raises(InputError, match=r"request 1, block 2: batch.block_table\[1, 2\] is not a page id"):
        layer.check_page_ids()


def test_the_page_id_word_is_host_memory_the_kernels_write() -> None:
    """The flag's word is pinned host memory mapped into the GPU: the indexer's store lands where the
    host reads, so an eager step makes no copy (a word left on the device would cost one per step)."""
    from mm3.contract.contents import FaultFlag

    for device in ("cuda", torch.device("cuda", torch.cuda.current_device())):
        flag = FaultFlag(device)
        assert flag.shared and flag.word.is_cuda and flag.word.data_ptr() == flag._host.data_ptr(), device
    layer, case = _layer(), _case()
    assert layer._flag.shared
    layer(case.q, case.index_q, case.caches, case.batch)                  # guarded first step
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        layer(case.q, case.index_q, case.caches, case.batch)
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if "Memcpy" in e.name or "memcpy" in e.name]
    assert not copies, copies
