"""Every tensor of a step must be on the caches' device: one on another is refused, naming it and the device.

One tensor at a time is moved to the ``meta`` device (everything else on the
CPU) and the step is called through each entry point that takes that tensor:
the layer, the custom ops (``torch.ops.mm3.*``: the two, and the step op a
compiled layer calls) and a bound backend's own op methods. Each must raise :class:`~mm3.InputError` naming the tensor as its
caller spells it and the device, before any hook runs (a custom op with a
``meta`` argument reaches its fake kernel, which refuses it there).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import mm3
from mm3.runtime.ops import batch_args
from mm3.runtime.registry import default_registry
from mm3.testing.factories import Case, make_case

P = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2, index_head_dim=16,
                              block_size=16, topk=4)
BATCH_TENSORS = ("block_table", "query_start_loc", "seq_lens", "token_positions", "token_to_request")
TENSORS = BATCH_TENSORS + ("q", "index_q", "out", "topk")
ENTRIES = ("layer", "custom ops", "step op", "bound backend")

#: how each entry point names a tensor in its errors (the layer judges its batch as a whole by seq_lens)
NAMES = {
    "layer": {**{t: f"batch.{t}" for t in BATCH_TENSORS}, "seq_lens": r"batch(\.seq_lens)?",
              "q": "q", "index_q": "index_q", "out": "out"},
    "custom ops": {**{t: t for t in BATCH_TENSORS}, "q": "q", "index_q": "index_q", "out": "out", "topk": "topk"},
    "step op": {**{t: t for t in BATCH_TENSORS}, "q": "q", "index_q": "index_q", "out": "out", "topk": "topk"},
    "bound backend": {**{t: f"batch.{t}" for t in BATCH_TENSORS}, "q": "q", "index_q": "index_q", "out": "out",
                      "topk": "the top-k buffer"},
}


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def _batch(case: Case, moved: str) -> mm3.BatchMetadata:
    b = case.batch
    t = {f: getattr(b, f) for f in (*BATCH_TENSORS, "context_lens")}
    if moved in t:
        t[moved] = _meta(t[moved])
    return mm3.BatchMetadata.assemble(t["query_start_loc"], t["seq_lens"], t["context_lens"], t["block_table"],
                                      t["token_to_request"], t["token_positions"], num_decodes=b.num_decodes,
                                      decode_query_len=b.decode_query_len, num_decode_tokens=b.num_decode_tokens,
                                      max_prefill_query_len=b.max_prefill_query_len, block_size=b.block_size)


def _call(entry: str, moved: str, attention: bool = False) -> Callable[[], Any]:
    """The step through ``entry``, with ``moved`` (if any) on the meta device: the op that takes it (the
    attention for ``q`` and ``out``, else the indexer; ``attention``: the attention anyway)."""
    case = make_case(P, decodes=[70, 40], prefills=[(9, 30)], dtype="float32", seed=0)
    layer = mm3.SparseAttention(P, dtype=torch.float32, max_num_tokens=32, backend="cpu_ref")
    batch, c = _batch(case, moved), case.caches
    q, index_q, out = case.q, case.index_q, torch.zeros_like(case.q)
    q, index_q, out = (_meta(t) if moved == name else t for name, t in (("q", q), ("index_q", index_q), ("out", out)))
    attention = attention or moved in ("q", "out")
    if entry == "layer":
        return lambda: layer(q, index_q, c, batch, out=out)
    if entry == "custom ops":
        storage = layer.topk_buffer.storage
        topk = _meta(storage) if moved == "topk" else storage
        args, target = batch_args(batch), layer.op_target      # the call holds the target: its handle lives
        if attention:
            return lambda: torch.ops.mm3.attention(q, c.k, c.v, c.index, topk, *args, target.handle, out)
        return lambda: torch.ops.mm3.index_topk(index_q, c.k, c.v, c.index, topk, *args, target.handle)
    if entry == "step op":
        storage = layer.topk_buffer.storage
        topk = _meta(storage) if moved == "topk" else storage
        args, target = batch_args(batch), layer.op_target
        return lambda: torch.ops.mm3.sparse_attention(q, index_q, c.k, c.v, c.index, topk, *args, target.handle, out)
    be = default_registry().get("cpu_ref")
    rows = mm3.TopkBuffer.allocate(batch.num_tokens, P.num_index_heads, P.topk, be.capabilities.topk_layout,
                                   device="meta" if moved == "topk" else "cpu")
    if attention:
        return lambda: be.attention_forward(q, c, rows, batch, P, out)
    return lambda: be.index_topk(index_q, c, batch, P, rows)


CASES = [pytest.param(entry, moved, id=f"{entry}-{moved}") for entry in ENTRIES for moved in TENSORS
         if moved in NAMES[entry]]


@pytest.mark.parametrize("entry,moved", CASES)
def test_a_tensor_on_another_device_is_refused_by_name(entry: str, moved: str) -> None:
    call = _call(entry, moved)
    where = r"^torch\.ops\.mm3\.sparse_attention: " if entry == "step op" else "(^|: )"
    with pytest.raises(mm3.InputError, match=rf"{where}{NAMES[entry][moved]} is (\S+ )?on meta\b"):
        call()


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("attention", [False, True], ids=["indexer", "attention"])
def test_the_same_calls_run_with_everything_on_one_device(entry: str, attention: bool) -> None:
    """The calls above with nothing moved run: the refusals come from the move alone."""
    _call(entry, "", attention)()


def test_custom_ops_on_meta_tensors_alone_propagate_shapes() -> None:
    """Every tensor on ``meta``: shape propagation (the fake kernel's own use), not a mixed-device call."""
    case = make_case(P, decodes=[70, 40], prefills=[(9, 30)], dtype="float32", seed=0)
    layer = mm3.SparseAttention(P, dtype=torch.float32, max_num_tokens=32, backend="cpu_ref")
    c, b = case.caches, case.batch
    args = [_meta(t) if isinstance(t, torch.Tensor) else t for t in batch_args(b)]
    meta = [_meta(t) for t in (case.index_q, c.k, c.v, c.index, layer.topk_buffer.storage)]
    torch.ops.mm3.index_topk(*meta, *args, layer.op_target.handle)
    torch.ops.mm3.attention(_meta(case.q), *meta[1:], *args, layer.op_target.handle, _meta(case.q))
    torch.ops.mm3.sparse_attention(_meta(case.q), *meta, *args, layer.op_target.handle, _meta(case.q))


@pytest.mark.parametrize("scale", ["k_block_scale", "v_block_scale", "index_block_scale"])
@pytest.mark.parametrize("attention", [False, True, "step"], ids=["indexer", "attention", "step op"])
def test_an_nvfp4_block_scale_on_another_device_is_refused_by_the_custom_ops(scale: str, attention: object) -> None:
    """A custom op whose only ``meta`` argument is one of NVFP4's block scales reaches its fake kernel, which
    must refuse it by name: a fake kernel that returned would leave the op's output unwritten, silently."""
    case = make_case(P, decodes=[70, 40], prefills=[(9, 30)], dtype="float32", kv_dtype="nvfp4",
                     index_dtype="nvfp4", seed=0)
    layer = mm3.SparseAttention(P, dtype=torch.float32, kv_dtype="nvfp4", index_dtype="nvfp4", max_num_tokens=32,
                                backend="cpu_ref")
    c, args, target = case.caches, batch_args(case.batch), layer.op_target
    blocks = [_meta(getattr(c, n)) if n == scale else getattr(c, n)
              for n in ("k_block_scale", "v_block_scale", "index_block_scale")]
    storage = layer.topk_buffer.storage
    with pytest.raises(mm3.InputError, match=rf": {scale} is on meta\b"):
        if attention == "step":
            torch.ops.mm3.sparse_attention(case.q, case.index_q, c.k, c.v, c.index, storage, *args, target.handle,
                                           torch.zeros_like(case.q), c.k_scale, c.v_scale, *blocks)
        elif attention:
            torch.ops.mm3.attention(case.q, c.k, c.v, c.index, storage, *args, target.handle,
                                    torch.zeros_like(case.q), c.k_scale, c.v_scale, *blocks)
        else:
            torch.ops.mm3.index_topk(case.index_q, c.k, c.v, c.index, storage, *args, target.handle,
                                     c.k_scale, c.v_scale, *blocks)
