"""The custom ops' host path, and ``BatchMetadata.build`` on a device.

Each call of ``torch.ops.mm3.index_topk`` / ``.attention`` / ``.sparse_attention`` builds, before the boundary
(:meth:`~mm3.runtime.step.OpTarget.run`), the batch, caches and top-k buffer of its arguments,
reading every tensor's shape, dtype and device once and comparing them, whole, with the last
call's (:mod:`mm3.runtime.ops`, :func:`mm3.contract.facts.shape_of_facts`):

* what it hands the boundary is what :meth:`~mm3.BatchMetadata.assemble`,
  :meth:`~mm3.PagedKVCache.rewrap` and :meth:`~mm3.runtime.step.OpTarget.topk_of` make, field for field;
* a fact that changed — even of the same tensor object, changed in place — is seen: bad input after
  good input raises exactly what it raises in a fresh process;
* nothing of a call (no tensor) is kept past it.

``BatchMetadata.build(..., device=...)`` builds and judges its contents in host memory, then moves
the tensors (no device read: on a GPU, no synchronisation), raising what a host build raises.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional, Union

import pytest
import torch

import mm3
import mm3.contract.batch as batch_mod
from mm3.contract import buffers, facts
from mm3.contract.buffers import TopkBuffer
from mm3.contract.slots import TokenSlots
from mm3.runtime import ops
from mm3.runtime.ops import batch_args, batch_from_args
from mm3.testing.factories import make_case

P = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2, index_head_dim=16,
                              block_size=16, topk=4)
STEPS = {
    "decode": dict(decodes=[40, 33]),
    "mixed": dict(decodes=[40, 33], prefills=[(5, 20)]),
    "speculative": dict(decodes=[40, 33], decode_query_len=2, prefills=[(3, 30)]),
    "padding": dict(decodes=[40], padding_decodes=1, prefills=[(4, 9)]),
    "prefill": dict(prefills=[(6, 6), (3, 40)]),
}
KINDS = {"bf16": {}, "fp8": dict(kv_dtype="float8_e4m3fn"), "nvfp4": dict(kv_dtype="nvfp4", index_dtype="nvfp4")}


def _forget() -> None:
    """Empty every memo of the last call's facts: what a fresh process starts with."""
    facts._LAST_SHAPE = ((), None)
    facts._SHAPES.clear()
    facts._LAST_CACHE = ((), None)
    buffers._LAST_VIEW = ((), None)


def _layer(kind: str = "bf16") -> mm3.SparseAttention:
    kw: dict[str, Any] = {"bf16": {}, "fp8": dict(kv_dtype=torch.float8_e4m3fn),
                          "nvfp4": dict(kv_dtype="nvfp4", index_dtype="nvfp4")}[kind]
    return mm3.SparseAttention(P, dtype=torch.float32, max_num_tokens=32, max_decode_query_len=2, backend="cpu_ref",
                               **kw)


def _case(step: str = "mixed", kind: str = "bf16", seed: int = 0) -> Any:
    return make_case(P, dtype="float32", seed=seed, **STEPS[step], **KINDS[kind])


def _scales(c: mm3.PagedKVCache) -> tuple[Any, ...]:
    return (c.k_scale, c.v_scale, c.k_block_scale, c.v_block_scale, c.index_block_scale)


def _call(layer: mm3.SparseAttention, case: Any, attention: Union[bool, str], topk: Optional[torch.Tensor] = None,
          args: Optional[tuple[Any, ...]] = None, caches: Optional[mm3.PagedKVCache] = None) -> None:
    """One op of a step: the indexer (``attention`` False), the attention (True) or the step op (``"step"``)."""
    c = caches or case.caches
    st = layer.topk_buffer.storage if topk is None else topk
    a, h = batch_args(case.batch) if args is None else args, layer.op_target.handle
    if attention == "step":
        torch.ops.mm3.sparse_attention(case.q, case.index_q, c.k, c.v, c.index, st, *a, h, torch.zeros_like(case.q),
                                       *_scales(c))
    elif attention:
        torch.ops.mm3.attention(case.q, c.k, c.v, c.index, st, *a, h, torch.zeros_like(case.q), *_scales(c))
    else:
        torch.ops.mm3.index_topk(case.index_q, c.k, c.v, c.index, st, *a, h, *_scales(c))


def _recorded(monkeypatch: pytest.MonkeyPatch, layer: mm3.SparseAttention) -> list[dict[str, Any]]:
    """The keyword arguments of every ``run`` of ``layer``'s target from here on (the call still runs)."""
    target, seen = layer.op_target, []
    real = target.run

    def run(*a: Any, **kw: Any) -> None:     # the objects' fields as they come (the hooks cache more on them)
        seen.append({**kw, "fields": {k: dict(vars(kw[k])) for k in ("batch", "caches")}})
        real(*a, **kw)
    monkeypatch.setattr(target, "run", run)
    return seen


def _same_fields(g: dict[str, Any], want: object) -> None:
    """The fields ``g`` are ``want``'s: the same tensor objects, equal other values."""
    w = vars(want)
    assert sorted(g) == sorted(w)
    for name, value in w.items():
        if isinstance(value, torch.Tensor):
            assert g[name] is value, name
        else:
            assert g[name] == value, name


# -- what the ops hand the boundary --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("attention", [False, True, "step"], ids=["index_topk", "attention", "sparse_attention"])
def test_the_ops_hand_the_boundary_what_the_constructors_make(monkeypatch: pytest.MonkeyPatch, kind: str, step: str,
                                                             attention: Union[bool, str]) -> None:
    layer, case = _layer(kind), _case(step, kind)
    seen = _recorded(monkeypatch, layer)
    for _ in range(2):      # a call of new facts, then one of the same facts (read back)
        _call(layer, case, attention)
    args, c = batch_args(case.batch), case.caches
    want_batch = batch_from_args(*args)             # made before anything reads it
    want_caches = mm3.PagedKVCache.rewrap(c.k, c.v, c.index, c.k_scale, c.v_scale, k_block_scale=c.k_block_scale,
                                          v_block_scale=c.v_block_scale, index_block_scale=c.index_block_scale)
    for kw in seen:
        _same_fields(kw["fields"]["batch"], want_batch)
        assert kw["batch"].facts.key is want_batch.facts.key        # one object per value: compared by identity
        _same_fields(kw["fields"]["caches"], want_caches)
        assert kw["caches"].facts is want_caches.facts
        assert kw["topk"] is layer.topk_buffer
        assert kw.get("graph") is None and kw["names"] is mm3.contract.facts.OPS_NAMES   # run asks the queries
    assert seen[0]["batch"] is not seen[1]["batch"] and seen[0]["caches"] is not seen[1]["caches"]


@pytest.mark.parametrize("memory", ["token_major", "head_major", "own storage, another tensor"])
def test_a_callers_topk_memory_is_wrapped_as_topk_of_wraps_it(monkeypatch: pytest.MonkeyPatch, memory: str) -> None:
    layer, case = _layer(), _case("decode")
    T, own = case.batch.num_tokens, layer.topk_buffer.storage
    if memory == "token_major":
        view = torch.full((T, 2, P.topk), -1, dtype=torch.int32).permute(1, 0, 2)
    elif memory == "head_major":
        view = torch.full((2, T, P.topk), -1, dtype=torch.int32)
    else:
        view = own.view(own.shape)        # the owner's memory, address, shape and strides: the owner's buffer
    seen = _recorded(monkeypatch, layer)
    for attention in (False, True, False):
        _call(layer, case, attention, topk=view)
    want = layer.op_target.topk_of(view, "x")
    for kw in seen:
        got = kw["topk"]
        assert (got is layer.topk_buffer) == (memory == "own storage, another tensor") == (want is layer.topk_buffer)
        assert (got.layout, got.facts, got.num_tokens) == (want.layout, want.facts, want.num_tokens)
        assert got.storage.data_ptr() == want.storage.data_ptr() and got.storage.stride() == want.storage.stride()


# -- a changed fact is seen, whatever was called before ----------------------------------------------------

def _with(args: tuple[Any, ...], i: int, value: Any) -> tuple[Any, ...]:
    return args[:i] + (value,) + args[i + 1:]


#: bad calls: (name, the call given a layer and a case); each is refused, naming what is wrong
BAD: dict[str, Callable[[mm3.SparseAttention, Any], None]] = {
    "token_positions int64": lambda l, c: _call(l, c, False, args=_with(batch_args(c.batch), 5,
                                                                         c.batch.token_positions.long())),
    "token_to_request a row short": lambda l, c: _call(l, c, True, args=_with(batch_args(c.batch), 4,
                                                                             c.batch.token_to_request[:-1])),
    "block_table 1-D": lambda l, c: _call(l, c, False, args=_with(batch_args(c.batch), 3,
                                                                  c.batch.block_table.flatten())),
    "context_lens a request short": lambda l, c: _call(l, c, False, args=_with(batch_args(c.batch), 2,
                                                                              c.batch.context_lens[:-1])),
    "seq_lens float": lambda l, c: _call(l, c, True, args=_with(batch_args(c.batch), 1, c.batch.seq_lens.float())),
    "more decodes than requests": lambda l, c: _call(l, c, False, args=_with(batch_args(c.batch), 6, 9)),
    "a decode query length past the layer's": lambda l, c: _call(l, c, False, args=_with(batch_args(c.batch), 7,
                                                                                        3)),
    "v cache float64": lambda l, c: _call(l, c, True, caches=mm3.PagedKVCache.rewrap(
        c.caches.k, c.caches.v.double(), c.caches.index)),
    "index cache of other pages": lambda l, c: _call(l, c, False, caches=mm3.PagedKVCache.rewrap(
        c.caches.k, c.caches.v, c.caches.index[:-1])),
    "topk int64": lambda l, c: _call(l, c, False, topk=l.topk_buffer.storage.long()),
    "q of another head count": lambda l, c: torch.ops.mm3.attention(
        c.q[:, :2], c.caches.k, c.caches.v, c.caches.index, l.topk_buffer.storage, *batch_args(c.batch),
        l.op_target.handle, torch.zeros_like(c.q)),
}


def _refusal(call: Callable[[], None]) -> str:
    with pytest.raises(mm3.InputError) as e:
        call()
    return str(e.value)


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_input_after_good_input_raises_what_it_raises_first(bad: str) -> None:
    """The ops compare each call's facts with the last call's: a bad call after good ones (of a layer, and of
    the process) must raise the very error it raises in a fresh process."""
    case = _case()
    _forget()
    fresh = _refusal(lambda: BAD[bad](_layer(), case))
    layer = _layer()
    for attention in (False, True, False, True):
        _call(layer, case, attention)
    assert _refusal(lambda: BAD[bad](layer, case)) == fresh
    _call(layer, case, True)                                 # and good input after it runs again
    other = _layer()
    _call(other, case, False)
    assert _refusal(lambda: BAD[bad](other, case)) == fresh


def test_a_tensor_changed_in_place_is_seen() -> None:
    """The same tensor objects, one of them resized in place between two calls: no fact is keyed on a
    tensor's identity, so the second call sees the new shape and names it."""
    layer, case = _layer(), _case()
    args = batch_args(case.batch)
    _call(layer, case, False, args=args)
    _call(layer, case, True, args=args)
    T = args[5].shape[0]
    args[5].resize_(T - 1)                   # token_positions, one token short, the same object
    with pytest.raises(mm3.InputError, match=rf"has shape \({T},\), expected \({T - 1},\) for .* {T - 1} tokens"):
        _call(layer, case, True, args=args)


def _tensors_in(obj: object, depth: int = 0) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if depth > 6:
        return 0
    if isinstance(obj, dict):
        return sum(_tensors_in(v, depth + 1) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_tensors_in(v, depth + 1) for v in obj)
    return 0


def test_nothing_of_a_call_is_kept_past_it() -> None:
    """The memos hold facts only (shapes, dtypes, devices, ints), never a tensor: a tensor kept past its call
    would be an allocation a CUDA graph's pool does not own (and an engine refills them in place)."""
    layer = _layer("fp8")
    for step in ("decode", "mixed"):
        case = _case(step, "fp8")
        _call(layer, case, False)
        _call(layer, case, True, topk=torch.full((case.batch.num_tokens, 2, P.topk), -1,
                                                 dtype=torch.int32).permute(1, 0, 2))
        _call(layer, case, "step")
    for memo in (facts._LAST_SHAPE, facts._LAST_CACHE, buffers._LAST_VIEW):
        assert memo[0] and _tensors_in(memo) == 0


def test_a_dead_handle_is_named_and_its_entry_dropped() -> None:
    layer, case = _layer(), _case()
    handle = layer.op_target.handle
    args, c = batch_args(case.batch), case.caches
    storage = layer.topk_buffer.storage
    assert ops.lookup(handle) is layer.op_target
    del layer
    gc.collect()
    assert handle not in ops._TARGETS
    with pytest.raises(mm3.InputError, match=f"mm3 op handle {handle} names no live layer"):
        torch.ops.mm3.index_topk(case.index_q, c.k, c.v, c.index, storage, *args, handle)
    with pytest.raises(mm3.InputError, match="mm3 op handle 0 names no live layer"):
        ops.lookup(0)


# -- the facts worked out once per new batch ---------------------------------------------------------------

def _want_shape(b: mm3.BatchMetadata) -> tuple[Any, ...]:
    """A BatchShape's counts and verdicts, worked out here from the batch's tensors."""
    R, T = b.seq_lens.shape[0], b.token_positions.shape[0]
    return (T, R, b.num_decodes, b.decode_query_len, mm3.contract.facts.batch_kind(R, b.num_decodes,
                                                                                    b.decode_query_len),
            True, b.block_table.device.type == "cpu", b.block_size, b.block_table.shape[1], b.num_decode_tokens,
            b.max_prefill_query_len, "pages")


@pytest.mark.parametrize("step", list(STEPS))
def test_a_batch_says_what_it_is_whichever_batch_came_before(step: str) -> None:
    b = _case(step).batch
    for before in (None, *STEPS):
        _forget()
        if before is not None:
            batch_from_args(*batch_args(_case(before).batch))
        got = batch_from_args(*batch_args(b)).facts
        assert tuple(got[1:]) == _want_shape(b)
    shapes = [batch_from_args(*batch_args(x.batch)).facts for x in (_case("decode"), _case("mixed"))]
    assert shapes[0].key is shapes[1].key          # only counts differ: one key object
    assert batch_from_args(*batch_args(b.to("meta"))).facts.key != shapes[0].key


def test_an_inconsistent_batch_is_said_to_be() -> None:
    b = _case("mixed").batch
    args = batch_args(b)
    assert batch_from_args(*args).facts.consistent
    for i, bad in ((0, b.query_start_loc[:-1]), (3, b.block_table[:-1]), (4, b.token_to_request[:-1]),
                   (2, b.context_lens[:-1]), (0, b.query_start_loc[None])):
        assert not batch_from_args(*_with(args, i, bad)).facts.consistent
    assert not batch_from_args(*_with(args, 8, 99)).facts.consistent        # decode tokens past the tokens


def test_a_topk_view_is_judged_whatever_view_came_before() -> None:
    good = torch.zeros(2, 6, 4, dtype=torch.int32)
    TopkBuffer(good)
    for bad, match in ((good.long(), "must be int32"), (good[0], "3-D"),
                       (torch.zeros(6, 2, 4, dtype=torch.int32).permute(1, 0, 2)[:, :, :2].transpose(0, 2),
                        "not laid out")):
        with pytest.raises(mm3.InputError, match=match):
            TopkBuffer(bad)
        TopkBuffer(good)
    tm = torch.zeros(6, 2, 4, dtype=torch.int32).permute(1, 0, 2)
    for _ in range(2):
        buf = TopkBuffer(tm)
        assert (buf.layout, buf.num_tokens, buf.storage.shape) == ("token_major", 6, (6, 2, 4))
        assert buf.facts == ("token_major", torch.int32, tm.device, (2, 2, 4), (8, 4, 1))


# -- BatchMetadata.build on a device -------------------------------------------------------------------------

LENS = dict(query_lens=[1, 1, 5], seq_lens=[300, 129, 5], block_size=128, num_decodes=2)


def _table() -> torch.Tensor:
    return torch.arange(12, dtype=torch.int32).reshape(3, 4)


def test_build_on_a_device_judges_its_contents_in_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """``meta`` stands in for a device: before, ``build`` judged the batch it had made on the device (a
    device sync, and on ``meta`` no data at all); now it judges the host batch, then moves it."""
    judged: list[set[str]] = []
    real = batch_mod.check_on_host

    def check(batch: mm3.BatchMetadata, *a: Any, **k: Any) -> None:
        judged.append({getattr(batch, f).device.type for f in batch_mod._TENSORS})
        real(batch, *a, **k)
    monkeypatch.setattr(batch_mod, "check_on_host", check)
    on_host = mm3.BatchMetadata.build(**LENS, block_table=_table(), num_pages=12)
    moved = mm3.BatchMetadata.build(**LENS, block_table=_table(), num_pages=12, device="meta")
    assert judged == [{"cpu"}, {"cpu"}]
    assert {getattr(moved, f).device.type for f in batch_mod._TENSORS} == {"meta"}
    for name in (*batch_mod._HOST_INTS, "query_lens", "seq_lens_host", "host_lens", "num_tokens", "kind"):
        assert getattr(moved, name) == getattr(on_host, name), name
    assert tuple(moved.facts[1:]) == tuple(on_host.facts[1:7]) + (False,) + tuple(on_host.facts[8:])
    for f in batch_mod._TENSORS:
        t = getattr(moved, f)
        assert (t.dtype, t.shape, t.is_contiguous()) == (torch.int32, getattr(on_host, f).shape, True), f


def test_build_on_a_device_raises_what_a_host_build_raises() -> None:
    bad = _table()
    bad[1, 1] = 40
    for kw in (dict(num_pages=12), dict(num_pages=12, device="meta")):
        with pytest.raises(mm3.InputError, match=r"BatchMetadata.build: request 1, block 1: block_table\[1, 1\] = 40 "
                                                 r"is not a page id in \[0, 12\)"):
            mm3.BatchMetadata.build(**LENS, block_table=bad, **kw)


def test_build_of_token_slots_on_a_device_moves_them() -> None:
    table = torch.randperm(8, dtype=torch.int32).view(2, 4)
    b = mm3.BatchMetadata.build([1], [3], torch.zeros(1, 0, dtype=torch.int32), block_size=2,
                                slots=TokenSlots.of(table, torch.tensor([1])), num_pages=8, device="meta")
    assert b.slots.table.device.type == b.slots.rows.device.type == b.seq_lens.device.type == "meta"
    assert (b.facts.addressing, b.facts.width) == ("slots", 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_build_on_cuda_never_synchronises() -> None:
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        b = mm3.BatchMetadata.build(**LENS, block_table=_table(), num_pages=12, device=dev)
        bad = _table()
        bad[1, 1] = 40
        with pytest.raises(mm3.InputError, match=r"block_table\[1, 1\] = 40 is not a page id"):
            mm3.BatchMetadata.build(**LENS, block_table=bad, num_pages=12, device=dev)
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    want = mm3.BatchMetadata.build(**LENS, block_table=_table(), num_pages=12)
    for f in batch_mod._TENSORS:
        assert getattr(b, f).is_cuda and torch.equal(getattr(b, f).cpu(), getattr(want, f)), f
    # a table already on the device is used as it is (read back once, to judge it)
    on_dev = _table().to(dev)
    assert mm3.BatchMetadata.build(**LENS, block_table=on_dev, num_pages=12).block_table is on_dev


def test_the_layers_storage_seen_as_another_dtype_is_refused() -> None:
    """The owner's top-k storage is recognised by its address, dtype, shape and strides: the same memory
    viewed as float32 is not the layer's buffer, and is refused by name."""
    layer, case = _layer(), _case("decode")
    wrong = layer.topk_buffer.storage.view(torch.float32)
    with pytest.raises(mm3.InputError, match="torch.ops.mm3.index_topk: topk: .*int32"):
        _call(layer, case, False, topk=wrong)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_build_on_cuda_from_pinned_memory_takes_the_table_it_judged() -> None:
    """A pinned host table moved without waiting would be read when the copy runs, after the caller refilled
    it for its next step: the batch must hold the table ``build`` judged."""
    table = _table().pin_memory()
    want = table.clone()
    torch.cuda._sleep(10_000_000)            # the stream busy, so a queued copy would run late
    b = mm3.BatchMetadata.build(**LENS, block_table=table, num_pages=12, device="cuda")
    table.fill_(7)                           # the caller's next step
    torch.cuda.synchronize()
    assert torch.equal(b.block_table.cpu(), want)
