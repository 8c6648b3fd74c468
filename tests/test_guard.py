"""The contract guard (mm3.debug.guard): it stops every planted fault with a readable message.

The centre piece reproduces vLLM's MiniMax-M3 bug (docs/spec.md §5) in a mixed
decode + prefill batch with H > 1: without the guard the step *runs* and
returns wrong numbers; with it the step stops with a message naming the
backend, the hook, the rule and the row. Every other rule gets its own planted
fault (MockBackend's, plus a few below), and clean backends never trip it.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest
import torch

import mm3_backends.cpu_ref.plugin as cpu_ref
from mm3.plugin import BackendCapabilities, Probe, SparseAttentionParams, TopkBuffer, hookimpl
from mm3.runtime.config import Settings
from mm3.contract.batch import BatchMetadata
from mm3.contract.errors import ContractViolation, InputError, PluginError
import mm3.debug.guard as guard_mod
from mm3.debug import GUARD_SENTINEL, RULES, check_topk_allocation, checked_call
from mm3.runtime.layer import SparseAttention
from mm3.runtime.registry import Registry
from mm3.testing.factories import Case, make_case
from mm3.testing.mock import MockBackend, MockFault
from mm3.testing.oracle import oracle_attention, oracle_topk

GUARD_ON = Settings(check_contracts=True)
GUARD_OFF = Settings(check_contracts=False)


def _params(H: int = 2, G: int = 2, **kw: Any) -> SparseAttentionParams:
    return SparseAttentionParams(num_heads=H * G, num_kv_heads=H, head_dim=16, num_index_heads=H,
                                 index_head_dim=16, block_size=16, topk=4, **kw)


def _mixed(H: int = 2, seed: int = 0, **kw: Any) -> Case:
    """docs/spec.md §5's regression batch: 3 decodes (+1 padding) and 2 prefills, T = 4 + 9 + 17 = 30."""
    return make_case(_params(H, **kw), decodes=[70, 40, 90], prefills=[(9, 30), (17, 17)],
                     padding_decodes=1, dtype="float32", index_dtype="bfloat16", seed=seed)


def _layer(plugin: object, name: str, settings: Settings, case: Case, capacity: int = 48
           ) -> SparseAttention:
    reg = Registry(plugins=[plugin], entry_points=False)
    return SparseAttention(case.params, dtype=case.q.dtype, index_dtype=case.caches.index_dtype,
                           max_num_tokens=capacity, max_decode_query_len=case.batch.decode_query_len,
                           backend=name, registry=reg, settings=settings)


def _reference(case: Case) -> torch.Tensor:
    sel = oracle_topk(case.index_q, case.caches, case.batch, case.params)
    return oracle_attention(case.q, case.caches, sel, case.batch, case.params)


def _max_err(out: torch.Tensor, case: Case) -> float:
    return (out.double() - _reference(case)).abs().max().item()


# -- faults MockBackend does not have ---------------------------------------------------------------

class Faulty:
    """A cpu_ref-backed plugin with one planted fault (the faults MockBackend lacks).

    ``head_major_writer`` is vLLM's bug in its original form: the allocation is
    honest (token-major, as declared) but the indexer kernel writes rows as if
    the buffer were dense head-major.
    """

    def __init__(self, name: str, fault: Optional[str], layout: str = "token_major",
                 requires_contiguous: bool = False) -> None:
        self.name, self.fault = name, fault
        self.caps = BackendCapabilities(name=name, ops={"index_topk", "attention"}, device_types={"cpu"},
                                        topk_layout=layout, topk_requires_contiguous=requires_contiguous,
                                        max_decode_query_len=8)

    @hookimpl
    def backend_capabilities(self) -> BackendCapabilities:
        return self.caps

    @hookimpl
    def backend_probe(self, device: torch.device) -> Probe:
        return Probe.yes("test plugin")

    @hookimpl
    def alloc_topk_buffer(self, num_tokens: int, num_heads: int, topk: int, device: torch.device
                          ) -> TopkBuffer:
        where = "meta" if self.fault == "alloc_meta" else device
        return TopkBuffer.allocate(num_tokens, num_heads, topk, self.caps.topk_layout, where)

    @hookimpl
    def index_topk(self, index_q: torch.Tensor, caches: Any, batch: BatchMetadata,
                   params: SparseAttentionParams, out: TopkBuffer) -> None:
        T = batch.num_tokens
        if self.fault == "head_major_writer":
            scratch = TopkBuffer.allocate(T, out.num_heads, out.topk, "head_major")
            cpu_ref.index_topk(index_q, caches, batch, params, scratch)
            s = out.storage  # a raw pointer to row 0, indexed as dense [H, T, K]
            torch.as_strided(s, (out.num_heads, T, out.topk), (T * out.topk, out.topk, 1),
                             s.storage_offset()).copy_(scratch.storage)
            return
        cpu_ref.index_topk(index_q, caches, batch, params, out)
        hm = out.head_major()
        pos = batch.token_positions.tolist()
        B, K = params.block_size, params.topk
        real = [t for t, p in enumerate(pos) if p >= 0]
        wide = [t for t in real if pos[t] // B + 1 >= K]        # tokens with a full row of K ids
        if self.fault == "duplicate":
            hm[0, wide[0], 1] = hm[0, wide[0], 0]
        elif self.fault == "hole":                               # -1 inside the prefix
            hm[1, wide[0], 1] = -1
        elif self.fault == "drop_local":                         # the token's own block is missing
            t = next(t for t in real if pos[t] // B + 1 > K)
            own = pos[t] // B
            row = hm[0, t].tolist()
            spare = next(b for b in range(own) if b not in row)
            hm[0, t, row.index(own)] = spare
        elif self.fault == "padding_row":
            hm[1, pos.index(-1), 0] = 0

    @hookimpl
    def attention_forward(self, q: torch.Tensor, caches: Any, topk: TopkBuffer, batch: BatchMetadata,
                          params: SparseAttentionParams, out: torch.Tensor) -> None:
        cpu_ref.attention_forward(q, caches, topk, batch, params, out)
        T = batch.num_tokens
        if self.fault == "out_past_T":
            torch.as_strided(out, (T + 1,) + tuple(out.shape[1:]), out.stride(),
                             out.storage_offset())[T, 0, 0] = 1.0
        elif self.fault == "write_topk":
            topk.head_major()[0, 0, -1] += 100
        elif self.fault == "replace_out":
            out.set_(torch.zeros_like(out))
        elif self.fault == "padding_out":
            out[batch.token_positions.tolist().index(-1), 0, 0] = 0.5
        elif self.fault == "inf_output":
            out[T - 1, -1, 0] = float("inf")


# -- the vLLM bug -----------------------------------------------------------------------------------

@pytest.mark.parametrize("guard", [GUARD_OFF, GUARD_ON], ids=["unguarded", "guarded"])
@pytest.mark.parametrize("declared", ["token_major", "head_major"])
def test_vllm_allocation_bug_fails_at_allocation_guard_or_not(declared: str, guard: Settings) -> None:
    """Storage in one layout labelled as the other cannot become a TopkBuffer (H > 1), so no kernel runs."""
    case = _mixed(H=2)
    mock = MockBackend("vllm_like", topk_layout=declared, fault="wrong_layout")
    with pytest.raises(PluginError) as info:
        _layer(mock, "vllm_like", guard, case)
    msg = str(info.value)
    for fragment in ("'vllm_like'", "alloc_topk_buffer", f"as {declared!r} storage", "TopkBuffer(view)", "vLLM"):
        assert fragment in msg, msg
    assert isinstance(info.value.__cause__, InputError)
    assert not [c for c in mock.calls if c.hook == "index_topk"]


def test_vllm_layout_bug_in_the_writer_is_stopped_at_the_first_scrambled_row() -> None:
    """The original form: honest token-major allocation, a kernel writing it as head-major."""
    case = _mixed(H=2)
    T = case.batch.num_tokens
    unguarded_layer = _layer(Faulty("nv", "head_major_writer"), "nv", GUARD_OFF, case)
    out = unguarded_layer(case.q, case.index_q, case.caches, case.batch)
    assert _max_err(out, case) > 0.05                                   # silently wrong

    layer = _layer(Faulty("nv", "head_major_writer"), "nv", GUARD_ON, case)
    with pytest.raises(ContractViolation) as info:
        layer(case.q, case.index_q, case.caches, case.batch)
    e = info.value
    assert (e.backend, e.hook) == ("nv", "index_topk") and e.rule.startswith("topk.")
    # the reported row is really what the buffer holds at (head, token)
    assert e.row == layer.topk_buffer.head_major()[e.head, e.token].tolist()
    assert 0 <= e.token < T and f"token {e.token}" in str(e) and str(e.row) in str(e)
    assert "layout mix-up" in str(e)


def test_with_one_head_the_layout_bug_is_harmless_and_the_guard_agrees() -> None:
    """H = 1: both layouts share one memory map (why the bug hid); no false alarm."""
    case = _mixed(H=1, G=4)
    for plugin, name in ((MockBackend("one_head", topk_layout="token_major", fault="wrong_layout"), "one_head"),
                         (Faulty("nv1", "head_major_writer"), "nv1")):
        layer = _layer(plugin, name, GUARD_ON, case)
        out = layer(case.q, case.index_q, case.caches, case.batch)
        assert _max_err(out, case) < 1e-5


# -- each rule, each planted fault --------------------------------------------------------------------

MOCK_FAULTS = {
    "unordered": ("index_topk", "topk.order"),   # with topk_order="ascending" declared (_mock)
    "out_of_range": ("index_topk", "topk.range"),
    "write_past_rows": ("index_topk", "topk.rows_past_T"),
    "nan_output": ("attention_forward", "attention.nonfinite"),
}
OWN_FAULTS = {
    "alloc_meta": ("alloc_topk_buffer", "alloc.device"),
    "duplicate": ("index_topk", "topk.unique"),
    "hole": ("index_topk", "topk.prefix"),
    "drop_local": ("index_topk", "topk.forced"),
    "padding_row": ("index_topk", "topk.padding"),
    "out_past_T": ("attention_forward", "attention.out_past_T"),
    "write_topk": ("attention_forward", "attention.topk_written"),
    "replace_out": ("attention_forward", "attention.out_replaced"),
    "padding_out": ("attention_forward", "attention.padding"),
    "inf_output": ("attention_forward", "attention.nonfinite"),
}


def _mock(fault: Optional[str], twin_of: Optional[str] = None) -> MockBackend:
    """MockBackend "faulty" with ``fault`` (None: clean). "unordered" breaks a declared ascending order, so it
    declares one, and so does its clean twin (``twin_of="unordered"``)."""
    ascending = "unordered" in (fault, twin_of)
    return MockBackend("faulty", fault=fault, topk_order="ascending" if ascending else "score")


def _run_faulty(plugin: object, name: str, settings: Settings, case: Case) -> torch.Tensor:
    layer = _layer(plugin, name, settings, case)
    # an out buffer with spare rows, as an engine with a persistent output would pass
    out = torch.full((case.batch.num_tokens + 3,) + tuple(case.q.shape[1:]), 7.0, dtype=case.q.dtype)
    return layer(case.q, case.index_q, case.caches, case.batch, out=out)


@pytest.mark.parametrize("fault", sorted(MOCK_FAULTS))
def test_guard_names_mock_faults(fault: str) -> None:
    case = _mixed(H=2)
    hook, rule = MOCK_FAULTS[fault]
    with pytest.raises(ContractViolation) as info:
        _run_faulty(_mock(fault), "faulty", GUARD_ON, case)
    e = info.value
    assert (e.backend, e.hook, e.rule) == ("faulty", hook, rule), str(e)
    assert f"'faulty'" in str(e) and hook in str(e) and rule in str(e)


@pytest.mark.parametrize("fault", sorted(OWN_FAULTS))
def test_guard_names_planted_faults(fault: str) -> None:
    case = _mixed(H=2)
    hook, rule = OWN_FAULTS[fault]
    with pytest.raises(ContractViolation) as info:
        _run_faulty(Faulty("planted", fault), "planted", GUARD_ON, case)
    e = info.value
    assert (e.backend, e.hook, e.rule) == ("planted", hook, rule), str(e)
    assert rule in RULES and RULES[rule] in str(e)


#: where each fault's wrong data lands: the step's rows of the top-k buffer or of out, or rows past the step
SILENT_DAMAGE = {
    "duplicate": "topk", "hole": "topk", "drop_local": "topk", "padding_row": "topk", "out_of_range": "topk",
    "write_topk": "topk", "write_past_rows": "topk past T", "padding_out": "out", "inf_output": "out",
    "out_past_T": "out past T", "unordered": "topk",
}


def _unguarded_state(plugin: object, case: Case) -> dict[str, torch.Tensor]:
    """A step with check_contracts off: every row of out (spare ones too) and of the layer's top-k buffer."""
    T = case.batch.num_tokens
    layer = _layer(plugin, "faulty", GUARD_OFF, case)
    out = torch.full((T + 3,) + tuple(case.q.shape[1:]), 7.0, dtype=case.q.dtype)
    layer(case.q, case.index_q, case.caches, case.batch, out=out)     # raises nothing: no guard ran
    rows = layer.topk_buffer.head_major()
    return {"topk": rows[:, :T].clone(), "topk past T": rows[:, T:].clone(), "out": out[:T].clone(),
            "out past T": out[T:].clone()}


@pytest.mark.parametrize("fault", sorted(set(OWN_FAULTS) - {"alloc_meta", "replace_out"})
                         + sorted(set(MOCK_FAULTS) - {"nan_output"}))
def test_the_same_faults_pass_silently_without_the_guard(fault: str) -> None:
    """Without the guard these faults raise nothing: only wrong data shows, where each fault puts it (the same
    backend without the fault, also unguarded, writes the oracle's answer and leaves the rest untouched)."""
    assert set(SILENT_DAMAGE) == (set(OWN_FAULTS) - {"alloc_meta", "replace_out"}) | (set(MOCK_FAULTS) - {"nan_output"})
    case = _mixed(H=2)
    make = (lambda f: _mock(f, fault)) if fault in MOCK_FAULTS else (lambda f: Faulty("faulty", f))
    clean, faulty = _unguarded_state(make(None), case), _unguarded_state(make(fault), case)
    assert _max_err(clean["out"], case) < 1e-5
    assert (clean["topk past T"] == -1).all() and (clean["out past T"] == 7.0).all()
    where = SILENT_DAMAGE[fault]
    assert not torch.equal(faulty[where], clean[where]), f"{fault} left {where} as a clean step does"
    if where == "out":
        assert not _max_err(faulty["out"], case) < 1e-5


def test_row_report_names_head_token_and_content() -> None:
    case = _mixed(H=2)
    with pytest.raises(ContractViolation) as info:
        _run_faulty(MockBackend("oor", fault="out_of_range"), "oor", GUARD_ON, case)
    e = info.value
    t = int((case.batch.token_positions >= 0).nonzero()[0, 0])       # the mock's first real token
    nb = int(case.batch.token_positions[t]) // case.params.block_size + 1
    assert (e.head, e.token, e.row[0]) == (0, t, nb)
    assert f"head 0, token {t} (decode request" in str(e)
    assert f"holds {nb}, outside [0, {nb})" in str(e)


def test_nonfinite_output_is_allowed_where_inputs_are_not_finite() -> None:
    """docs/spec.md §4: garbage in may give garbage out; the guard only blames the backend for finite inputs."""
    case = _mixed(H=2)
    case.q[5, 1] = float("nan")
    case.caches.v[case.batch.block_table[4, 0].item(), 3, 1] = float("inf")  # first prefill, KV head 1
    layer = _layer(cpu_ref, "cpu_ref", GUARD_ON, case)
    out = layer(case.q, case.index_q, case.caches, case.batch)
    assert torch.isnan(out[5, 1]).all()
    assert not torch.isfinite(out).all()


def test_attention_input_layout_rule_blames_the_caller() -> None:
    case = _mixed(H=2)
    be = Registry(plugins=[Faulty("strict", None, "token_major", requires_contiguous=True)],
                  entry_points=False).get("strict")
    T = case.batch.num_tokens
    head_major = TopkBuffer.allocate(T, 2, 4, "head_major")
    cpu_ref.index_topk(case.index_q, case.caches, case.batch, case.params, head_major)
    args = (case.q, case.caches, head_major, case.batch, case.params, torch.empty_like(case.q))
    with pytest.raises(ContractViolation, match=r"attention.input_layout.*caller.*to_layout\('token_major'\)"):
        checked_call(be, "attention", args)
    with pytest.raises(InputError, match=r"strict.attention_forward: needs a dense token_major top-k buffer"):
        be.attention_forward(*args)     # the boundary refuses it before the guard would see it
    # the layer converts for such a backend, so through SparseAttention all is well
    out = _layer(Faulty("strict", None, "token_major", requires_contiguous=True), "strict", GUARD_ON, case)(
        case.q, case.index_q, case.caches, case.batch)
    assert _max_err(out, case) < 1e-5


def test_backend_exceptions_surface_naming_backend_and_hook() -> None:
    """The guard adds nothing to a backend's exception: the bound backend names it (tests/test_faults_mid_step.py)."""
    case = _mixed(H=2)
    with pytest.raises(PluginError, match="backend 'boom' .* failed in index_topk: .*MockFault") as info:
        _run_faulty(MockBackend("boom", fault="raise"), "boom", GUARD_ON, case)
    assert isinstance(info.value.__cause__, MockFault)


# -- allocation checks, directly -------------------------------------------------------------------

def test_allocation_checks() -> None:
    good = TopkBuffer.allocate(8, 2, 4, "token_major")
    kw = dict(layout="token_major", num_tokens=8, num_heads=2, topk=4, device="cpu", backend="b")
    assert check_topk_allocation(good, **kw) is good
    cases = {
        "alloc.type": good.storage,
        "alloc.shape": TopkBuffer.allocate(8, 2, 5, "token_major"),
        "alloc.layout": TopkBuffer.allocate(8, 2, 4, "head_major"),
        "alloc.device": TopkBuffer.allocate(8, 2, 4, "token_major", device="meta"),
    }
    for rule, buf in cases.items():
        with pytest.raises(ContractViolation, match=rule.replace(".", r"\.")) as info:
            check_topk_allocation(buf, **kw)
        assert info.value.rule == rule
    # a padded (non-dense) allocation in the right order is honest: accepted
    padded = TopkBuffer._wrap(torch.full((8, 2, 8), -1, dtype=torch.int32)[:, :, :4], "token_major")
    assert check_topk_allocation(padded, **kw) is padded


def test_guarded_allocation_is_sentinel_filled() -> None:
    case = _mixed(H=2)
    for settings, filled in ((GUARD_ON, True), (Settings(check_contracts="first"), True), (GUARD_OFF, False)):
        buf = _layer(cpu_ref, "cpu_ref", settings, case).topk_buffer
        assert bool((buf.storage == GUARD_SENTINEL).all()) == filled
    assert GUARD_SENTINEL != -1 and GUARD_SENTINEL < 0


# -- no false alarms, and the plumbing -----------------------------------------------------------------

@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("H", [1, 2])
def test_clean_backend_passes_and_output_is_unchanged(H: int, kv_layout: str) -> None:
    p = _params(H, init_blocks=1, local_blocks=2)
    case = make_case(p, decodes=[70, 33, 90], prefills=[(9, 30), (3, 3), (17, 100)], decode_query_len=2,
                     padding_decodes=1, empty_decodes=1, dtype="float32", index_dtype="bfloat16",
                     kv_layout=kv_layout, seed=H)
    outs = [_layer(cpu_ref, "cpu_ref", s, case)(case.q, case.index_q, case.caches, case.batch)
            for s in (GUARD_OFF, GUARD_ON)]
    assert torch.equal(outs[0], outs[1])
    assert _max_err(outs[1], case) < 1e-5


@pytest.mark.parametrize("settings, guarded", [(GUARD_ON, [2, 2]), (Settings(check_contracts="first"), [2, 0]),
                                               (GUARD_OFF, [0, 0])], ids=["always", "first", "never"])
def test_the_layer_guards_the_calls_its_policy_says(settings: Settings, guarded: list[int],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard wraps the very call a step makes (no wrapper class): counted per step."""
    case = _mixed(H=2)
    calls: list[str] = []
    real = guard_mod.checked_call
    monkeypatch.setattr(guard_mod, "checked_call", lambda be, op, args, **kw: (calls.append(op), real(be, op, args))[1])
    layer = _layer(cpu_ref, "cpu_ref", settings, case)
    counts = []
    for _ in range(2):
        before = len(calls)
        layer(case.q, case.index_q, case.caches, case.batch)
        counts.append(len(calls) - before)
    assert counts == guarded


def test_the_suite_runs_the_production_default(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No suite-wide override: the tests see what a user gets, the first step of each kind guarded
    (a test that needs every step guarded says so with Settings(check_contracts="always"))."""
    if "MM3_CHECK_CONTRACTS" in os.environ:
        pytest.skip(f"this run sets MM3_CHECK_CONTRACTS={os.environ['MM3_CHECK_CONTRACTS']} on purpose")
    monkeypatch.chdir(tmp_path)
    assert Settings().check_contracts == "first"


def test_block_ids_outside_the_cache_are_input_errors() -> None:
    case = _mixed(H=2)
    bt = case.batch.block_table.clone()
    bt[4, 1] = case.caches.num_pages + 5                 # first prefill's second block
    b = case.batch
    bad = BatchMetadata.build(b.query_lens, b.seq_lens_host, bt, block_size=16, num_decodes=b.num_decodes)
    layer = _layer(cpu_ref, "cpu_ref", GUARD_ON, case)
    with pytest.raises(InputError, match=r"request 4, block 1: batch.block_table\[4, 1\] = \d+ is not a page id"):
        layer(case.q, case.index_q, case.caches, bad)


class _Replay:
    """A plugin that writes precomputed outputs (whatever batch it is handed): isolates what the guard reads."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    @hookimpl
    def backend_capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(**{**cpu_ref.CAPABILITIES.model_dump(), "name": "replay", "ops": {"attention"}})

    @hookimpl
    def attention_forward(self, out: torch.Tensor) -> None:
        out.copy_(self.out)


def test_padding_is_read_from_device_positions_after_update_() -> None:
    """A batch refreshed in place (graph replay) keeps stale host lengths; the guard must not use them."""
    p = _params(H=2)
    first = make_case(p, decodes=[70, 0, 40], decode_query_len=1, dtype="float32", seed=1)   # request 1: padding
    again = make_case(p, decodes=[70, 33, 40], decode_query_len=1, dtype="float32", seed=1)  # ... now real
    assert first.batch.block_table.shape == again.batch.block_table.shape
    first.batch.update_(again.batch)
    T = again.batch.num_tokens
    sel = oracle_topk(again.index_q, again.caches, again.batch, p)
    want = torch.empty_like(again.q)
    cpu_ref.attention_forward(again.q, again.caches, sel, again.batch, p, want)
    assert (want[1] != 0).any()
    replay = Registry(plugins=[_Replay(want)], entry_points=False).get("replay")
    checked_call(replay, "attention", (again.q, again.caches, sel, first.batch, p, torch.empty_like(want)))  # no alarm
    # ... and a real padding row with output is still caught, from the device positions
    again.batch.update_(make_case(p, decodes=[70, 0, 40], dtype="float32", seed=1).batch)
    with pytest.raises(ContractViolation, match="attention.padding") as info:
        checked_call(replay, "attention", (again.q, again.caches, sel, again.batch, p, torch.empty_like(want)))
    assert info.value.token == 1 and T == 3


def test_the_gravest_broken_rule_is_reported_though_a_lesser_one_comes_first() -> None:
    """An indexer declared ascending that writes score order breaks topk.order on nearly every row: an id out of
    range on a later row is still the one reported (rules rank as ROW_RULES lists them), and every row that
    breaks a rule is counted."""
    from mm3.debug.topk_rows import describe_row, row_codes

    case = _mixed(H=2)
    T = case.batch.num_tokens
    buf = TopkBuffer.allocate(T, 2, case.params.topk, "head_major")
    cpu_ref.index_topk(case.index_q, case.caches, case.batch, case.params, buf)      # score order
    hm = buf.head_major()
    pos = case.batch.token_positions
    last = int((pos >= 0).nonzero()[-1, 0])
    nb = int(pos[last]) // case.params.block_size + 1
    unordered = row_codes(hm, pos, case.params, True)
    first_unordered = int((unordered.T != 0).nonzero()[0, 0])
    assert first_unordered < last, "the case must put an unordered row before the out-of-range one"
    hm[1, last, 0] = nb                                                    # one past its visible blocks
    codes = row_codes(hm, pos, case.params, True)
    v = describe_row(codes, hm, case.batch, case.params)
    assert (v.rule, v.head, v.token) == ("topk.range", 1, last), v
    assert v.bad_rows == int((codes != 0).sum()) > 1


def test_docs_errors_lists_exactly_the_guards_rules() -> None:
    """docs/errors.md §2.2's table names every rule of the guard's table and no other, so a rule added to one
    and not the other fails here."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()
    section = text.split("### 2.2 What it checks", 1)[1].split("\n### ", 1)[0]
    documented = {name for line in section.splitlines() if line.startswith("| `")
                  for name in re.findall(r"`([a-z]+\.[A-Za-z_]+)`", line.split("|")[1])}
    assert documented == set(RULES), (sorted(documented - set(RULES)), sorted(set(RULES) - documented))
