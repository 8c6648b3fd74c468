"""One rule decides whether the core converts the top-k buffer, and the trace says what runs.

For every pair of layouts (indexer's, attention's), with an attention that
does or does not require a dense buffer in its own layout, and an indexer
whose buffer is dense or padded: the layer copies the buffer exactly when
its selection trace says so, and exactly when the contract's rule says it must.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mm3 import SparseAttention
from mm3.plugin import TopkBuffer, hookimpl
from mm3.runtime.config import Settings
from mm3.runtime.registry import Registry
from mm3.testing.factories import make_case
from mm3.testing.helpers import default_params
from mm3.testing.mock import MockBackend

LAYOUTS = ("head_major", "token_major")


class PaddedIndexer(MockBackend):
    """An indexer whose buffers are honest but not dense: every row padded to twice its slots."""

    @hookimpl
    def alloc_topk_buffer(self, num_tokens: int, num_heads: int, topk: int,
                          device: torch.device) -> TopkBuffer:
        layout = self.capabilities.topk_layout
        outer = (num_heads, num_tokens) if layout == "head_major" else (num_tokens, num_heads)
        padded = torch.full((*outer, 2 * topk), -1, dtype=torch.int32, device=device)
        return TopkBuffer._wrap(padded[..., :topk], layout)


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "padded"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["strict", "strided"])
@pytest.mark.parametrize("idx_layout,att_layout", list(itertools.product(LAYOUTS, LAYOUTS)),
                         ids=lambda v: v.split("_")[0])
def test_trace_and_layer_agree(idx_layout: str, att_layout: str, contiguous: bool, dense: bool) -> None:
    indexer = (MockBackend if dense else PaddedIndexer)("idx", ops={"index_topk"}, topk_layout=idx_layout)
    attention = MockBackend("att", ops={"attention"}, topk_layout=att_layout,
                            topk_requires_contiguous=contiguous)
    p = default_params()
    case = make_case(p, decodes=[70, 33], prefills=[(9, 40)], dtype="float32")
    layer = SparseAttention(p, dtype=torch.float32, max_num_tokens=64, backend="att", indexer_backend="idx",
                            registry=Registry([indexer, attention], entry_points=False),
                            settings=Settings(check_contracts=False))
    assert layer.topk_buffer.is_dense() == dense
    layer(case.q, case.index_q, case.caches, case.batch)

    written: TopkBuffer = indexer.calls_to("index_topk")[-1].args["out"]
    given: TopkBuffer = attention.calls_to("attention_forward")[-1].args["topk"]
    copied = given.storage.data_ptr() != written.storage.data_ptr()
    trace_says = "top-k conversion:" in layer.explain()
    assert copied == trace_says == layer.selection.converts_topk, layer.explain()
    # ... and it is the contract's rule: a strict reader gets a dense buffer in its own layout
    assert copied == (contiguous and (idx_layout != att_layout or not dense))
    if copied:
        assert given.layout == att_layout and given.is_dense()
        assert ("non-dense" in layer.selection.topk_conversion) == (not dense)
