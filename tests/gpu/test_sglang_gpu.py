"""SGLang's decode entry point on the cuda backend: no device sync after its first call, and captured in a CUDA graph.

SGLang captures its decode steps in CUDA graphs with ``req_to_token``,
``slot_ids`` and ``seq_lens`` as persistent device tensors it rewrites in place
between replays (its page table's backing must stay the one captured: PR
#34843). Here a decode step of scattered 16-token pages runs through
``mm3.integrations.sglang.minimax_sparse_decode``:

* after one eager call, the same call under ``torch.cuda.set_sync_debug_mode("error")``:
  any device-to-host copy or synchronisation inside it raises;
* captured in one CUDA graph, then replayed after the pages were moved (``req_to_token``
  rewritten in place) and new queries copied in: the ids (ascending, SGLang's order) and the
  outputs are checked against the fp64 oracle of the moved step;
* the same with ``page_size=1`` (token slots: every token on a slot of its own, read by the
  cuda plugin's kernels through ``req_to_token``), eager, then captured and replayed after
  every token moved to another slot.

The CPU counterparts are tests/test_sglang_dropin.py and the SGLang rows of
tests/test_stream_host_reads.py. Run on a CUDA machine (skips elsewhere)::

    pytest tests/gpu/test_sglang_gpu.py -q
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu_reference import capture
from mm3 import SparseAttentionParams
from mm3.integrations import sglang as sg
from mm3.integrations import targets
from mm3.runtime.config import Settings
from sglang_steps import (SglangStep, assert_output_right, assert_topk_right, fill_req_to_token, sglang_slot_step,
                          sglang_step)

GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")

P = SparseAttentionParams(num_heads=8, num_kv_heads=2, head_dim=64, num_index_heads=2, index_head_dim=64,
                          block_size=16, topk=4, init_blocks=1, local_blocks=1)
B = P.block_size


class DeviceDecode:
    """A decode step's SGLang tensors on the GPU, persistent, and the call on them."""

    def __init__(self, s: SglangStep, page_size: int = B) -> None:
        c, dev = s.case, "cuda"
        self.page_size = page_size
        self.q, self.index_q = c.q.to(dev), c.index_q.to(dev)
        self.k, self.v, self.idx_k = s.k_cache.to(dev), s.v_cache.to(dev), s.idx_k_cache.to(dev)
        self.req_to_token, self.slots = s.req_to_token.to(dev), s.row_slots.to(dev)
        self.seq_lens = s.row_seq_lens.to(dev)
        self.max_seq_len = c.batch.max_seq_len + 64     # a bound for every step the graph replays
        self.ids = torch.full((P.num_kv_heads, c.batch.num_tokens, P.topk), -7, dtype=torch.int32, device=dev)
        self.out: Any = None

    def __call__(self) -> None:
        _, self.out = sg.minimax_sparse_decode(
            self.q, None, self.k, self.v, self.index_q, None, self.idx_k, None, self.req_to_token, self.slots,
            self.seq_lens, self.max_seq_len, 1, B, P.topk, P.init_blocks, P.local_blocks, page_size=self.page_size,
            disable_index_value=True, topk_out=self.ids)

    def load(self, s: SglangStep) -> None:
        """Refill the persistent tensors in place from ``s`` (a step of the same shapes)."""
        self.q.copy_(s.case.q)
        self.index_q.copy_(s.case.index_q)
        self.req_to_token.copy_(s.req_to_token)
        self.slots.copy_(s.row_slots)
        self.seq_lens.copy_(s.row_seq_lens)
        self.ids.fill_(-7)


def _step(seed: int) -> SglangStep:
    return sglang_step(P, decodes=(700, 33, 1300, 96), padding=1, dtype="bfloat16", seed=seed)


@pytest.fixture(autouse=True)
def _cuda_backend():
    targets.configure(Settings(backend="cuda", check_contracts="first"))
    yield
    targets.configure()


def test_no_device_sync_after_the_first_call() -> None:
    s = _step(3)
    run = DeviceDecode(s)
    run()                                           # the choice's first call: its one host check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    targets.check_page_ids()
    assert_topk_right(s, run.ids.cpu())
    assert_output_right(s, run.ids.cpu(), run.out.float().cpu(), dtype=torch.bfloat16)


def test_decode_captured_and_replayed_after_pages_move_in_place() -> None:
    first = _step(4)
    run = DeviceDecode(first)
    run()                                           # eager: selection, binding, the host check
    graph = capture(run)
    moved = _step(4)
    # the same requests on other pages: req_to_token rewritten in place, as SGLang's allocator does
    perm = torch.randperm(moved.k_cache.shape[0] // B, generator=torch.Generator().manual_seed(5))
    table = perm[moved.case.batch.block_table.long().clamp(min=0)].to(torch.int32)
    table[moved.case.batch.block_table < 0] = -1
    k = moved.k_cache.view(-1, B, *moved.k_cache.shape[1:]).clone()
    v = moved.v_cache.view(-1, B, *moved.v_cache.shape[1:]).clone()
    ix = moved.idx_k_cache.view(-1, B, *moved.idx_k_cache.shape[1:]).clone()
    for cache, src in ((k, moved.k_cache), (v, moved.v_cache), (ix, moved.idx_k_cache)):
        cache[perm] = src.view_as(cache)
    moved.k_cache.copy_(k.view_as(moved.k_cache))
    moved.v_cache.copy_(v.view_as(moved.v_cache))
    moved.idx_k_cache.copy_(ix.view_as(moved.idx_k_cache))
    moved.case.caches.k.copy_(k)
    moved.case.caches.v.copy_(v)
    moved.case.caches.index.copy_(ix.view_as(moved.case.caches.index))   # SGLang's keys keep a head dim of 1
    moved.case.batch.block_table.copy_(table)
    fill_req_to_token(moved.req_to_token, moved.req_slots, table, list(moved.case.batch.seq_lens_host), B)
    _replay_and_check(run, graph, moved)


def _replay_and_check(run: DeviceDecode, graph: Any, moved: SglangStep) -> None:
    """Load ``moved`` into the captured call's inputs (its caches copied into the captured ones), replay, and
    hold the replay to the oracle."""
    run.load(moved)
    for dst, src in ((run.k, moved.k_cache), (run.v, moved.v_cache), (run.idx_k, moved.idx_k_cache)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    targets.check_page_ids()
    assert_topk_right(moved, run.ids.cpu())
    assert_output_right(moved, run.ids.cpu(), run.out.float().cpu(), dtype=torch.bfloat16)


def _slot_step(seed: int) -> SglangStep:
    return sglang_slot_step(P, decodes=(700, 33, 1300, 96), padding=1, dtype="bfloat16", seed=seed)


def test_page_size_1_decode_eager_then_captured_and_replayed_after_every_token_moved() -> None:
    """Token slots on the GPU: the cuda plugin serves the call (not cpu_ref) and its kernels gather each key
    through ``req_to_token``; the captured graph reads the table as it is at each replay."""
    first = _slot_step(6)
    run = DeviceDecode(first, page_size=1)
    run()                                           # eager: selection, binding, the host check
    torch.cuda.synchronize()
    targets.check_page_ids()
    assert_topk_right(first, run.ids.cpu())
    assert_output_right(first, run.ids.cpu(), run.out.float().cpu(), dtype=torch.bfloat16)
    assert {(x.indexer.name, x.attention.name) for x in targets.selections()} == {("cuda", "cuda")}
    graph = capture(run)
    moved = _slot_step(7)                           # new queries, keys, slots and slot rows; the same shapes
    # every token to another slot, as SGLang's allocator may: the pool permuted, req_to_token rewritten in place
    # (moved's views share their storage with its case, so the oracle sees the same move)
    perm = torch.randperm(moved.k_cache.shape[0], generator=torch.Generator().manual_seed(8))
    for cache in (moved.k_cache, moved.v_cache, moved.idx_k_cache):
        shuffled = torch.empty_like(cache)
        shuffled[perm] = cache
        cache.copy_(shuffled)
    table = moved.req_to_token
    table.copy_(torch.where(table >= 0, perm[table.long().clamp(min=0)].to(table.dtype), table))
    _replay_and_check(run, graph, moved)
