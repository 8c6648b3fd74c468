"""The drop-ins' per-call host path: what a call of a kind seen before skips, and that it still checks everything.

vLLM's decode pair keeps, per kind of call (its host values but the token count),
what a call works out once: its target, its caches' template; a decode batch is a
copy of a template kept per request count; a top-k view wraps as ``TopkBuffer``
wrapped the first of its shape class. SGLang's page check runs as few torch ops
as it can. Here: each of those equals what the checked path builds; a call of a
kept kind still raises, for every bad argument, the very error the first call of
that kind raises; a kind follows the backend names in force; the steady state
runs the torch ops it needs and no more; and the page check finds what the
per-slot rule finds, on tables made to break it.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mm3
from mm3 import InputError, SparseAttentionParams
from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import TopkBuffer
from mm3.contract.contents import NO_FAULT
from mm3.integrations import sglang_inputs as si
from mm3.integrations import targets, vllm_calls, vllm_inputs
from mm3.integrations import vllm as ops
from mm3.runtime.config import Settings
from mm3.runtime.step import OpTarget
from mm3.testing.oracle import oracle_attention
from vllm_steps import vllm_step

P = SparseAttentionParams(num_heads=8, num_kv_heads=2, head_dim=16, num_index_heads=2, index_head_dim=16,
                          block_size=16, topk=4, init_blocks=1, local_blocks=1)


@pytest.fixture(autouse=True)
def _fresh():
    """Each test from nothing kept: no choice, no kind, no template."""
    targets.configure(Settings(backend="cpu_ref"))
    vllm_inputs._KEPT.clear()
    yield
    targets.configure()
    vllm_inputs._KEPT.clear()


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _decode_args(s: Any, nd: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The decode pair's positional arguments for the first ``nd`` decodes of ``s`` (one query token each)."""
    c, td = s.case, nd * s.dql
    view = s.topk_view[:, :td]
    index = (c.index_q[:td], c.caches.index, s.block_table[:nd], s.seq_lens[:nd], 200, P.topk, P.init_blocks,
             P.local_blocks, P.num_kv_heads, s.dql, s.dql)
    attn = (c.q[:td], s.kv_cache, view, s.block_table[:nd], s.seq_lens[:nd], P.num_kv_heads, P.softmax_scale,
            s.output[:td], s.dql)
    return index, attn


def _pair(s: Any, nd: int) -> None:
    index, attn = _decode_args(s, nd)
    ops.minimax_m3_index_decode(*index, out=s.topk_view[:, :nd * s.dql])
    ops.minimax_m3_sparse_attn_decode(*attn)


# -- what the kept path builds equals what the checked path builds ------------------------------------------

@pytest.mark.parametrize("dql", [1, 3])
def test_a_decode_batch_is_what_assemble_builds(dql: int) -> None:
    """The template's copy holds every field ``BatchMetadata.assemble`` sets, with this call's tensors: the
    first batch of a shape (made from assemble) and a later one (a copy) alike."""
    bt = torch.arange(15, dtype=torch.int32).reshape(5, 3)
    for sl in (torch.tensor([40, 0, 17, 33, 2], dtype=torch.int32), torch.tensor([9, 8, 7, 6, 5], dtype=torch.int32)):
        got = vllm_inputs.decode_batch("f", sl, bt, dql, 5 * dql, 16, graph=False)
        qsl = torch.arange(6, dtype=torch.int32) * dql
        req = torch.arange(5 * dql, dtype=torch.int32) // dql
        pos = (sl.unsqueeze(1) - dql + torch.arange(dql, dtype=torch.int32)).clamp(min=-1).view(-1)
        ref = BatchMetadata.assemble(qsl, sl, None, bt, req, pos, num_decodes=5, decode_query_len=dql,
                                     num_decode_tokens=5 * dql, max_prefill_query_len=0, block_size=16,
                                     max_query_len=dql)
        assert set(got.__dict__) == set(ref.__dict__)
        for k, v in ref.__dict__.items():
            mine = got.__dict__[k]
            assert (torch.equal(mine, v) if isinstance(v, torch.Tensor) else mine == v), k
        assert got.seq_lens is sl and got.block_table is bt
        assert got.context_lens.tolist() == ref.context_lens.tolist()   # derived on demand, as assemble's


def test_the_template_keeps_no_tensor_of_a_call() -> None:
    sl, bt = torch.tensor([5, 6], dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32)
    vllm_inputs.decode_batch("f", sl, bt, 1, 2, 16, graph=False)
    templates = [v[0] for k, v in vllm_inputs._KEPT.items() if k[0] == "decode"]
    assert templates and all(t["seq_lens"] is None and t["block_table"] is None and t["token_positions"] is None
                             for t in templates)


def _views() -> list[torch.Tensor]:
    """Top-k views of every layout class: head-major and token-major memory, one head, 0, 1 and more tokens,
    a slice of a longer buffer, a transposed copy of the rows."""
    hm = torch.full((3, 9, 4), -1, dtype=torch.int32)
    tm = torch.full((9, 3, 4), -1, dtype=torch.int32).permute(1, 0, 2)
    one = torch.full((9, 1, 4), -1, dtype=torch.int32).permute(1, 0, 2)
    return [v[:, :t] for v in (hm, tm, one) for t in (0, 1, 2, 5, 9)]


def test_a_topk_view_wraps_as_topk_buffer_does() -> None:
    for v in _views():
        for _ in range(2):  # each view twice: judged, then read back from TopkBuffer's memo of the last view
            mine, ref = vllm_inputs.topk_view("f", "out", v), TopkBuffer(v)
            for slot in TopkBuffer.__slots__:
                a, b = getattr(mine, slot), getattr(ref, slot)
                if isinstance(b, torch.Tensor):
                    assert a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                else:
                    assert a == b, slot


def test_a_view_of_memory_judged_before_still_refuses_rows_that_overlap() -> None:
    """Head-major memory of several heads: whether rows stay apart depends on the token count, so a view of
    more tokens of memory wrapped just before (at a count that fits) is judged again, and refused."""
    memory = torch.zeros(2 * 6 * 4, dtype=torch.int32)
    fits = memory.as_strided((2, 3, 4), (12, 4, 1))
    vllm_inputs.topk_view("f", "out", fits)
    overlapping = memory.as_strided((2, 5, 4), (12, 4, 1))           # head 0's rows run into head 1's
    with pytest.raises(InputError) as kept_err:
        vllm_inputs.topk_view("f", "out", overlapping)
    with pytest.raises(InputError) as ref_err:
        TopkBuffer(overlapping)
    assert str(kept_err.value) == f"f: out: {ref_err.value}"


def test_kinds_and_results_equal_the_checked_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second step, of another request count, takes the kept path, and its top-k and output are right."""
    s = vllm_step(P, decodes=(70, 33, 100, 20), prefills=(), padding=1, seed=3)
    calls: list[str] = []
    for name in ("_index_decode", "_attn_decode"):
        def spy(*a: Any, _real: Callable[..., Any] = getattr(ops, name), _name: str = name) -> Any:
            calls.append(_name)
            return _real(*a)
        monkeypatch.setattr(ops, name, spy)
    _pair(s, 2)
    assert calls == ["_index_decode", "_attn_decode"]
    _pair(s, s.num_decodes)                   # another request count: the kinds serve it
    assert calls == ["_index_decode", "_attn_decode"]
    b, T = s.case.batch, s.decode_tokens
    ref = oracle_attention(s.case.q[:T], s.case.caches, TopkBuffer(s.topk_view[:, :T]), b, P)
    assert float((s.output[:T].double() - ref).abs().max()) < 1e-5


def test_a_kind_follows_the_backend_names_in_force() -> None:
    """A kind serves the backend names, settings and registry it was bound under: another scope binds again."""
    s = vllm_step(P, decodes=(70, 33), prefills=(), seed=4)
    _pair(s, 2)
    (kind,) = vllm_calls.ATTENTION_KINDS.values()
    assert kind.context[0] is None
    with mm3.use_backend("cpu_ref") as scope:
        _pair(s, 2)
        (kind,) = vllm_calls.ATTENTION_KINDS.values()
        assert kind.context[0] is scope
    _pair(s, 2)
    (kind,) = vllm_calls.ATTENTION_KINDS.values()
    assert kind.context[0] is None
    targets.configure(Settings(backend="cpu_ref"))
    assert not vllm_calls.ATTENTION_KINDS and not vllm_calls.INDEX_KINDS      # forgotten with the choices


# -- a kept kind still checks everything ---------------------------------------------------------------------

def _bad_index(args: tuple[Any, ...], kw: dict[str, Any]) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    idx_q, cache, bt, sl = args[:4]
    rep = lambda i, v: args[:i] + (v,) + args[i + 1:]   # noqa: E731
    return [
        ("seq_lens int64", rep(3, sl.long()), kw),
        ("seq_lens 2-D", rep(3, sl.view(-1, 1)), kw),
        ("seq_lens a list", rep(3, sl.tolist()), kw),
        ("block_table int64", rep(2, bt.long()), kw),
        ("block_table rows", rep(2, bt[:1]), kw),
        ("tokens for requests", rep(0, idx_q[:1]), kw),
        ("dql 0", rep(9, 0), kw),
        ("dql float", rep(9, 1.0), kw),
        ("dql above max", rep(9, 2), kw),
        ("heads", rep(8, 3), kw),
        ("idx_q 2-D", rep(0, idx_q[:, 0]), kw),
        ("index cache 2-D", rep(1, cache[:, 0]), kw),
        ("out shape", args, {"out": kw["out"][:, :, :2]}),
        ("out not a tensor", args, {"out": [0]}),
        ("out int64", args, {"out": kw["out"].long()}),
        ("topk 0", rep(5, 0), kw),
        ("idx_q dtype", rep(0, idx_q.double()), kw),
    ]


def _bad_attention(args: tuple[Any, ...]) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    q, kv, topk, bt, sl = args[:5]
    rep = lambda i, v: args[:i] + (v,) + args[i + 1:]   # noqa: E731
    return [
        ("seq_lens int64", rep(4, sl.long()), {}),
        ("block_table rows", rep(3, bt[:1]), {}),
        ("tokens for requests", rep(0, q[:1]), {}),
        ("heads", rep(5, 3), {}),
        ("topk 2-D", rep(2, topk[0]), {}),
        ("topk int64", rep(2, topk.long()), {}),
        ("topk rows", rep(2, topk[:, :1]), {}),
        ("q 2-D", rep(0, q[:, 0]), {}),
        ("kv 3-D", rep(1, kv[0]), {}),
        ("output dtype", rep(7, args[7].double()), {}),
        ("output rows", rep(7, args[7][:1]), {}),
        ("dql 0", rep(8, 0), {}),
    ]


def _error(call: Callable[[], object]) -> tuple[type, str]:
    try:
        call()
    except Exception as e:   # noqa: BLE001 (what each path raises is the point)
        return type(e), str(e)
    return type(None), ""


def test_every_bad_argument_raises_what_the_checked_path_raises() -> None:
    """For each bad argument: the error of a call of a kind never seen (the checked path) and of the same
    call after a good one kept its kind (the kept path) are the same error."""
    s = vllm_step(P, decodes=(70, 33), prefills=(), seed=5)
    index, attn = _decode_args(s, 2)
    kw = {"out": s.topk_view[:, :2]}
    cases = [("index " + n, ops.minimax_m3_index_decode, a, k) for n, a, k in _bad_index(index, kw)]
    cases += [("attention " + n, ops.minimax_m3_sparse_attn_decode, a, k) for n, a, k in _bad_attention(attn)]
    fresh: dict[str, tuple[type, str]] = {}
    for name, fn, a, k in cases:
        targets.configure(Settings(backend="cpu_ref"))
        vllm_inputs._KEPT.clear()
        fresh[name] = _error(lambda: fn(*a, **k))
    targets.configure(Settings(backend="cpu_ref"))
    ops.minimax_m3_index_decode(*index, **kw)
    ops.minimax_m3_sparse_attn_decode(*attn)
    assert vllm_calls.INDEX_KINDS and vllm_calls.ATTENTION_KINDS
    for name, fn, a, k in cases:
        got = _error(lambda: fn(*a, **k))
        assert got == fresh[name], name
        assert issubclass(got[0], InputError), (name, got)


def test_a_kept_kind_refuses_a_captured_call_of_a_backend_not_graph_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    s = vllm_step(P, decodes=(70, 33), prefills=(), seed=6)
    index, attn = _decode_args(s, 2)
    _pair(s, 2)
    monkeypatch.setattr(ops, "capturing", lambda t: True)
    for call in (lambda: ops.minimax_m3_index_decode(*index), lambda: ops.minimax_m3_sparse_attn_decode(*attn)):
        with pytest.raises(mm3.BackendUnavailableError, match="is not CUDA-graph safe"):
            call()


def test_a_tensor_for_a_number_keeps_no_kind() -> None:
    """A kind is kept by its numbers' values: a tensor would be kept by its identity, whatever it holds next."""
    s = vllm_step(P, decodes=(70, 33), prefills=(), seed=7)
    index, attn = _decode_args(s, 2)
    ops.minimax_m3_sparse_attn_decode(*attn[:6], torch.tensor(P.softmax_scale), *attn[7:])
    assert not vllm_calls.ATTENTION_KINDS


# -- the steady state's torch ops --------------------------------------------------------------------------

def test_the_decode_pair_runs_four_torch_ops_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond the target's run (its own business): the positions of each call's batch and the K and V views,
    and, for token-major top-k memory of several heads (vLLM's buffer), the storage-order view each
    ``TopkBuffer`` holds; nothing else. A request count never seen adds two views (its batch's constants:
    slices of a kept arange), and no kernel."""
    s = vllm_step(P, decodes=(70, 33, 100, 20), prefills=(), seed=8)
    _pair(s, 2)
    monkeypatch.setattr(OpTarget, "run", lambda self, *a, **k: None)
    for nd, new in ((2, 0), (3, 2), (3, 0)):
        (index, attn), out = _decode_args(s, nd), s.topk_view[:, :nd]
        with _Ops() as seen:
            ops.minimax_m3_index_decode(*index, out=out)
            ops.minimax_m3_sparse_attn_decode(*attn)
        expected = ["aten.sub.Tensor"] * 2 + ["aten.as_strided.default"] * 2 + ["aten.permute.default"] * 2
        assert sorted(seen.ops) == sorted(expected + ["aten.slice.Tensor"] * new), (nd, seen.ops)


def test_the_kv_views_are_transpose_and_chunk() -> None:
    kv = torch.randn(4, 3, 16, 10)[:, :, :, :8]          # a strided cache: its last axis sliced
    q = torch.zeros(1, 3, 4)
    for _ in range(2):
        c = vllm_inputs.attention_caches("f", kv, None, None, q, graph=False)
        k, v = kv.transpose(1, 2).chunk(2, dim=-1)
        for mine, ref in ((c.k, k), (c.v, v)):
            assert mine.shape == ref.shape and mine.stride() == ref.stride()
            assert mine.data_ptr() == ref.data_ptr() and torch.equal(mine, ref)


# -- SGLang's page check -------------------------------------------------------------------------------------

def _reference_word(r2t: torch.Tensor, sid: torch.Tensor, B: int, max_seqlen: int, sl: torch.Tensor) -> int:
    """The per-slot rule, one slot at a time: the first (request, block) with a slot below seq_len that is not
    ``B * page + offset`` (page = the block's first slot // B)."""
    cols = -(-min(max(max_seqlen, 0), r2t.shape[1]) // B)
    for r in range(sl.shape[0]):
        row = r2t[int(sid[r]) % r2t.shape[0]].tolist() + [-1] * (cols * B)
        for j in range(cols):
            page = row[j * B] // B
            for i in range(B):
                if j * B + i < int(sl[r]) and row[j * B + i] != B * page + i:
                    return r << 32 | j
    return NO_FAULT


@pytest.fixture
def _device_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tables stand in for device ones: checked by torch ops into the fault word, not at once."""
    monkeypatch.setattr(si, "on_host", lambda t: False)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_page_check_finds_what_the_per_slot_rule_finds(dtype: torch.dtype, _device_tables: None) -> None:
    gen = torch.Generator().manual_seed(0)
    B = 8
    for trial in range(60):
        R, width = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen)) * B
        pages = torch.randperm(64, generator=gen)[:R * width // B].view(R, width // B)
        r2t = (pages.repeat_interleave(B, dim=1) * B + torch.arange(B).repeat(width // B)).to(dtype)
        for _ in range(int(torch.randint(0, 3, (1,), generator=gen))):      # break some slots
            r, p = int(torch.randint(0, R, (1,), generator=gen)), int(torch.randint(0, width, (1,), generator=gen))
            r2t[r, p] += int(torch.randint(1, 3, (1,), generator=gen))
        if trial % 7 == 0:
            r2t[0] += 1                                                      # misaligned from the start
        sid = torch.randperm(R, generator=gen)
        if trial % 5 == 0:
            sid[0] = -1                                                      # a padding row's slot id
        sl = torch.randint(0, width + 1, (R,), generator=gen, dtype=torch.int32)
        if trial % 9 == 0:
            sl[0] = 2 ** 31 - 1                                              # beyond the table: checked to its end
        if trial % 11 == 0:
            sl[-1] = -5
        max_seqlen = int(torch.randint(1, width + 2, (1,), generator=gen))
        bt, faults = si.pages("f", r2t, sid, B, max_seqlen, sl)
        got = NO_FAULT if faults is None else int(si.fault_word(faults))
        assert got == _reference_word(r2t, sid, B, max_seqlen, sl), trial
        assert torch.equal(bt, (r2t[sid.remainder(R)][:, :bt.shape[1] * B:B] // B).to(torch.int32))


def test_the_page_check_lowers_a_flag_as_the_word_says(_device_tables: None) -> None:
    from mm3.contract.contents import FaultFlag

    B, R = 4, 3
    r2t = torch.arange(R * 4 * B, dtype=torch.int32).view(R, 4 * B)
    sl = torch.tensor([16, 16, 16], dtype=torch.int32)
    r2t[2, 9] = 0                                       # request 2's block 2
    r2t[1, 13] = 0                                      # request 1's block 3: the least word
    _, faults = si.pages("f", r2t, torch.arange(R), B, 16, sl)
    assert faults is not None
    flag = FaultFlag("cpu")
    batch = si.decode_batch(sl, torch.zeros(R, 4, dtype=torch.int32), B)
    si.record_pages(flag, faults, "f", si.names(B, False, False), batch, 64, graph=False)
    assert int(flag.word[0]) == 1 << 32 | 3 == int(si.fault_word(faults))
    with pytest.raises(InputError, match=r"request 1, block 3"):
        flag.raise_pending()


def test_the_page_check_runs_few_torch_ops(_device_tables: None) -> None:
    """The page check of a step (its table derived on the device): the slot ids wrapped, a gather, the table (a
    division), one subtraction of the page starts, one of the offsets, a cast, one fused multiply-add, one
    reduction, and on ``[R]`` a comparison and the word (a division and an or); then, lowering the flag, a
    where and a reduction into it. Views besides: the table's columns, the blocks, their first slots, the page
    starts' axis, the kept constants' columns."""
    B, R = 16, 3
    r2t = torch.arange(R * 40 * B, dtype=torch.int32).view(R, 40 * B)
    sl, sid = torch.tensor([40 * B, 3, 17], dtype=torch.int32), torch.tensor([2, 0, 1])
    si.pages("f", r2t, sid, B, 37 * B, sl)      # its constants, kept once
    with _Ops() as seen:
        si.pages("f", r2t, sid, B, 37 * B, sl)
    views = ("slice", "view", "select", "unsqueeze")
    computing = [o for o in seen.ops if o.split(".")[1] not in views]
    assert computing[:-1] == ["aten.remainder.Scalar", "aten.index_select.default", "aten.div.Tensor_mode",
                              "aten.sub.Tensor", "aten.sub_.Tensor", "aten._to_copy.default", "aten.addcmul.default",
                              "aten.amin.default", "aten.lt.Tensor", "aten.div.Tensor_mode"], computing
    assert computing[-1] in ("aten.__or__.Tensor", "aten.bitwise_or.Tensor"), computing
    assert len(seen.ops) - len(computing) <= 5, seen.ops


def test_a_constant_read_inside_capture_outlives_the_store_starting_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """A captured graph reads the kept tensors at every replay: once a capture has read an entry, emptying the
    store when it is full (a churn of shapes) must not free it, and later calls get that very tensor."""
    monkeypatch.setattr(vllm_inputs, "MAX_KEPT", 8)
    monkeypatch.setattr(vllm_inputs, "_KEPT", {})
    monkeypatch.setattr(vllm_inputs, "_PINNED", {})

    def make() -> tuple[torch.Tensor, ...]:
        return (torch.arange(4, dtype=torch.int32),)
    eager = vllm_inputs.kept(("test constant",), False, make)
    captured = vllm_inputs.kept(("test constant",), True, make)       # a capture reads it
    assert captured is eager
    loose = vllm_inputs.kept(("test loose",), False, make)              # never read inside capture
    for i in range(20):                                               # the store fills and starts over
        vllm_inputs.kept(("churn", i), False, make)
    assert vllm_inputs.kept(("test constant",), False, make) is eager   # still the tensor the graph reads
    assert vllm_inputs.kept(("test loose",), False, make) is not loose  # the store did start over
