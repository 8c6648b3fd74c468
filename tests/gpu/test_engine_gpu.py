"""Engine-readiness on the GPU: compiled graphs with the ``cuda`` backend, CUDA graphs, no host sync.

Run on a CUDA machine (skips elsewhere)::

    pytest tests/gpu/test_engine_gpu.py -s -q

* **fullgraph**: a model of two ``SparseAttention`` layers at M3 TP8 shapes, compiled
  with Inductor and ``fullgraph=True`` (a graph break fails), equals the eager model
  on a mixed batch (decodes with a draft token, a chunked prefill);
* **reduce-overhead**: the same model's decode step compiled with
  ``mode="reduce-overhead"`` (Inductor's CUDA graphs) and replayed over steps of one
  shape class with new lengths, positions and pages equals eager at every step;
* **no sync**: building the step's metadata from device tensors
  (``BatchMetadata.from_device`` / ``update_from_device_``) and running an eager
  decode forward under ``torch.cuda.set_sync_debug_mode("error")``: any
  device-to-host copy raises.
"""

from __future__ import annotations

import pytest
import torch

import mm3
from mm3.runtime.config import Settings
from mm3.testing.factories import make_case

GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")

P = mm3.SparseAttentionParams.minimax_m3(tp_size=8)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = [mm3.SparseAttention(P, device="cuda", max_num_tokens=512, backend="cuda",
                                           max_decode_query_len=2) for _ in range(2)]

    def forward(self, q: torch.Tensor, index_q: torch.Tensor, caches: mm3.PagedKVCache,
                batch: mm3.BatchMetadata) -> torch.Tensor:
        h = q
        for layer in self.layers:
            h = layer(h, index_q, caches, batch) + h  # pointwise only: bitwise equal to eager
        return h

    def mark_static(self, caches: mm3.PagedKVCache) -> None:
        """What an engine does for CUDA graphs: persistent tensors keep their address."""
        for t in (caches.k, caches.v, caches.index, *(layer.topk_buffer.storage for layer in self.layers)):
            torch._dynamo.mark_static_address(t)


def _from_device(case: object) -> mm3.BatchMetadata:
    b = case.batch  # type: ignore[attr-defined]
    return mm3.BatchMetadata.from_device(b.query_start_loc, b.seq_lens, b.block_table, num_decodes=b.num_decodes,
                                         num_tokens=b.num_tokens, max_query_len=b.max_query_len,
                                         block_size=b.block_size, decode_query_len=b.decode_query_len,
                                         num_decode_tokens=b.num_decode_tokens)


def test_fullgraph_inductor_matches_eager() -> None:
    torch.manual_seed(0)
    model = _Model()
    compiled = torch.compile(model, fullgraph=True)
    case = make_case(P, decodes=[3000, 700, 4000], prefills=[(300, 1500)], decode_query_len=2, device="cuda", seed=1)
    with torch.no_grad():
        want = model(case.q, case.index_q, case.caches, case.batch)
        got = compiled(case.q, case.index_q, case.caches, _from_device(case))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    print(f"\nFIGURES fullgraph: max |compiled - eager| = {(got - want).abs().max().item():.3g}")


def test_reduce_overhead_decode_replays_match_eager() -> None:
    torch.manual_seed(0)
    model = _Model()
    # one cache for every step (as in an engine): 64 pages of 128 tokens, decodes of 4 requests
    base = make_case(P, decodes=[1000, 1000, 1000, 1000], device="cuda", seed=0, extra_pages=40)
    caches = base.caches
    model.mark_static(caches)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator(device="cpu").manual_seed(3)
    width = base.batch.block_table.shape[1]
    steps = 6
    with torch.no_grad():
        for step in range(steps):
            seqs = torch.randint(1, width * P.block_size, (4,), generator=g)
            seqs[step % 4] = 0 if step % 3 == 2 else seqs[step % 4]  # a padding decode now and then
            bt = torch.randperm(caches.num_pages, generator=g)[:4 * width].reshape(4, width).to(torch.int32)
            batch = mm3.BatchMetadata.build([1] * 4, seqs.tolist(), bt, block_size=P.block_size,
                                            num_decodes=4, device="cuda")
            q = torch.randn(4, P.num_heads, P.head_dim, device="cuda", dtype=torch.bfloat16)
            iq = torch.randn(4, P.num_index_heads, P.index_head_dim, device="cuda", dtype=torch.bfloat16)
            want = model(q, iq, caches, batch).clone()
            got = compiled(q, iq, caches, batch).clone()
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step}")
    print(f"\nFIGURES reduce-overhead: {steps} decode steps replayed, equal to eager")


def test_metadata_and_decode_forward_never_copy_to_the_host() -> None:
    # the default "first" mode (the suite runs "always", whose guard reads results on the host)
    layer = mm3.SparseAttention(P, device="cuda", max_num_tokens=64, backend="cuda", max_decode_query_len=2,
                                settings=Settings(check_contracts="first"))
    case = make_case(P, decodes=[3000, 1700, 900], padding_decodes=1, decode_query_len=2, device="cuda", seed=4)
    b = case.batch
    qsl, sl, bt = b.query_start_loc.clone(), b.seq_lens.clone(), b.block_table.clone()
    want = layer(case.q, case.index_q, case.caches, b).clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = mm3.BatchMetadata.from_device(qsl, sl, bt, num_decodes=b.num_decodes, num_tokens=b.num_tokens,
                                              max_query_len=2, block_size=P.block_size, decode_query_len=2,
                                              num_decode_tokens=b.num_decode_tokens)
        got = layer(case.q, case.index_q, case.caches, batch)
        batch.update_from_device_(qsl, sl + 0, bt)  # the next step, in place
        again = layer(case.q, case.index_q, case.caches, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    assert batch.validate() is batch  # the host check, once per shape class (syncs: outside the block)
