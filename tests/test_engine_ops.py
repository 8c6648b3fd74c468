"""Engine-readiness on the CPU: mm3's custom ops, a compiled model, metadata from device tensors.

The compile test uses dynamo with ``fullgraph=True`` (any graph break fails) and
the ``aot_eager`` backend: tracing, functionalisation of the declared
mutations and the fake kernels all run, without Inductor's C++ code generation
(18 s on two cores; tests/gpu/test_engine_gpu.py compiles with Inductor and CUDA
graphs on the GPU).
"""

from __future__ import annotations

import random

import pytest
import torch

import mm3
from mm3.runtime.ops import batch_args
from mm3.testing.factories import make_case
from mm3.testing.oracle import oracle_attention

P = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
                              index_head_dim=16, block_size=16, topk=4)


def _layer(**kw: object) -> mm3.SparseAttention:
    return mm3.SparseAttention(P, dtype=torch.float32, max_num_tokens=32, backend="cpu_ref",
                               max_decode_query_len=2, **kw)


def test_ops_are_registered_with_fake_kernels_and_declared_mutations() -> None:
    layer = _layer()
    case = make_case(P, decodes=[40, 0, 33], prefills=[(5, 20)], dtype="float32", seed=11)
    c, args, h = case.caches, batch_args(case.batch), layer.op_target.handle
    topk = layer.topk_buffer.storage
    out = torch.full_like(case.q, float("nan"))
    # opcheck: schema (the mutations it declares are the ones it makes), fake kernel, autograd registration
    torch.library.opcheck(torch.ops.mm3.index_topk.default, (case.index_q, c.k, c.v, c.index, topk, *args, h))
    torch.library.opcheck(torch.ops.mm3.attention.default, (case.q, c.k, c.v, c.index, topk, *args, h, out))
    assert torch.ops.mm3.index_topk.default._schema.arguments[4].alias_info.is_write
    written = {a.name for a in torch.ops.mm3.attention.default._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"out"}
    out2 = torch.full_like(case.q, float("nan"))
    step = torch.ops.mm3.sparse_attention.default
    torch.library.opcheck(step, (case.q, case.index_q, c.k, c.v, c.index, topk, *args, h, out2))
    assert {a.name for a in step._schema.arguments if a.alias_info is not None and a.alias_info.is_write} == \
        {"topk", "out"}
    # the step op is the two ops in one call (opcheck wrote into copies)
    torch.ops.mm3.index_topk(case.index_q, c.k, c.v, c.index, topk, *args, h)
    torch.ops.mm3.attention(case.q, c.k, c.v, c.index, topk, *args, h, out)
    T = case.batch.num_tokens
    rows = topk.clone()
    topk.fill_(-7)
    step(case.q, case.index_q, c.k, c.v, c.index, topk, *args, h, out2)
    assert torch.equal(topk[:, :T], rows[:, :T]) and not out.isnan().any()
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_op_handle_of_a_dead_layer_is_refused() -> None:
    layer = _layer()
    handle = layer.op_target.handle
    case = make_case(P, decodes=[40], dtype="float32")
    storage = layer.topk_buffer.storage
    del layer
    import gc

    gc.collect()
    with pytest.raises(mm3.InputError, match=f"handle {handle} names no live layer"):
        torch.ops.mm3.index_topk(case.index_q, case.caches.k, case.caches.v, case.caches.index, storage,
                                 *batch_args(case.batch), handle)


class _Model(torch.nn.Module):
    """Two SparseAttention layers around small projections: what an engine compiles."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(P.head_dim, P.head_dim)
        self.layers = [_layer(), _layer()]

    def forward(self, q: torch.Tensor, index_q: torch.Tensor, caches: mm3.PagedKVCache,
                batch: mm3.BatchMetadata) -> torch.Tensor:
        h = q
        for layer in self.layers:
            h = layer(self.proj(h), index_q, caches, batch) + h
        return h


def _device_step(case: object) -> mm3.BatchMetadata:
    b = case.batch  # type: ignore[attr-defined]
    return mm3.BatchMetadata.from_device(b.query_start_loc.clone(), b.seq_lens.clone(), b.block_table.clone(),
                                         num_decodes=b.num_decodes, num_tokens=b.num_tokens,
                                         max_query_len=b.max_query_len, block_size=b.block_size,
                                         decode_query_len=b.decode_query_len,
                                         num_decode_tokens=b.num_decode_tokens)


def test_compiled_model_has_no_graph_break_and_matches_eager() -> None:
    torch.manual_seed(0)
    model = _Model()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=backend)  # a graph break raises
    # steps of one shape class (3 decodes with a draft token, one 6-token prefill chunk, 15 pages,
    # 6 block-table columns) with different lengths, positions and pages
    steps = [make_case(P, decodes=d, prefills=[(6, pf)], decode_query_len=2, dtype="float32", seed=s)
             for s, d, pf in ((1, [70, 40, 45], 50), (2, [33, 80, 17], 70), (3, [20, 40, 80], 80))]
    with torch.no_grad():
        for i, case in enumerate(steps):
            batch = _device_step(case) if i else case.batch  # the engine's own tensors, from the second step
            want = model(case.q, case.index_q, case.caches, case.batch)
            got = compiled(case.q, case.index_q, case.caches, batch)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(graphs) == 1, f"compiled {len(graphs)} times for one shape class"
    # each layer is one opaque node: the layer's and the backend's Python were not traced
    calls = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    mm3_ops = [str(t) for t in calls if str(t).startswith("mm3.")]
    assert mm3_ops == ["mm3.sparse_attention"] * 2, calls


class _Halves(torch.nn.Module):
    """A layer's step through its two ops, as an engine that schedules the indexer and the attention apart
    calls them: the attention reads what the indexer wrote, through the compiled graph's functionalization."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = _layer()

    def forward(self, q: torch.Tensor, index_q: torch.Tensor, caches: mm3.PagedKVCache,
                batch: mm3.BatchMetadata) -> torch.Tensor:
        t, c = self.layer.op_target, caches
        args, topk, out = batch_args(batch), t.topk.storage, torch.empty_like(q)  # type: ignore[union-attr]
        torch.ops.mm3.index_topk(index_q, c.k, c.v, c.index, topk, *args, t.handle)
        torch.ops.mm3.attention(q, c.k, c.v, c.index, topk, *args, t.handle, out)
        return out


def test_the_two_halves_compile_in_order_and_match_the_layer() -> None:
    model, graphs = _Halves(), []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.no_grad():
        for s, d in ((1, [70, 40]), (2, [33, 80])):
            case = make_case(P, decodes=d, prefills=[(6, 50)], dtype="float32", seed=s)
            want = model.layer(case.q, case.index_q, case.caches, case.batch)
            torch.testing.assert_close(compiled(case.q, case.index_q, case.caches, case.batch), want, rtol=0, atol=0)
    calls = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert [c for c in calls if c.startswith("mm3.")] == ["mm3.index_topk", "mm3.attention"], calls


def test_steps_of_other_shape_classes_do_not_recompile_every_time() -> None:
    """The ops take the batch's host ints as SymInt: after the first change dynamo makes them
    dynamic instead of compiling again for every new number of decodes or prefill length (an
    ``int`` schema recompiled on each; 8 recompiles is dynamo's limit, where fullgraph fails)."""
    torch._dynamo.reset()
    layer = _layer()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(layer.forward, fullgraph=True, backend=backend)
    shapes = [([70], [(5, 30)]), ([70, 40], [(9, 30)]), ([20, 40, 33], [(3, 3)]), ([40], [(12, 50), (4, 4)]),
              ([17, 70, 40, 33], [(7, 60)]), ([33, 20], [(11, 11)]), ([50], [(2, 40)]), ([60, 61, 62], [(8, 9)])]
    with torch.no_grad():
        for s, (decodes, prefills) in enumerate(shapes):
            case = make_case(P, decodes=decodes, prefills=prefills, dtype="float32", seed=s)
            got = compiled(case.q, case.index_q, case.caches, case.batch)
            want = layer(case.q, case.index_q, case.caches, case.batch)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(graphs) <= 3, f"{len(graphs)} compilations for {len(shapes)} steps"


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn, torch.float8_e5m2], ids=["plain", "e4m3", "e5m2"])
def test_compiled_layer_against_the_oracle(kv_dtype: torch.dtype | None) -> None:
    """The ops carry an fp8 cache's scales: dropping them would be off by the scale, far past 1e-5."""
    layer = _layer(kv_dtype=kv_dtype) if kv_dtype else _layer()
    compiled = torch.compile(layer.forward, fullgraph=True, backend="aot_eager")
    case = make_case(P, decodes=[70, 40], prefills=[(5, 30)], dtype="float32", kv_dtype=kv_dtype, seed=5)
    out = compiled(case.q, case.index_q, case.caches, case.batch)
    sel = layer.topk_buffer.rows(0, case.batch.num_tokens)
    ref = oracle_attention(case.q, case.caches, sel, case.batch, P)
    assert (out.double() - ref).abs().max() < 1e-5


def _random_lengths(rng: random.Random) -> tuple[list[int], list[int], int, int]:
    dql = rng.choice([1, 2, 3])
    nd, npf = rng.randint(0, 4), rng.randint(0, 3)
    seqs, qls = [], []
    for _ in range(nd):
        pad = rng.random() < 0.25
        seqs.append(0 if pad else rng.randint(dql, 200))
        qls.append(rng.choice([0, dql]) if pad else dql)
    for _ in range(npf):
        q = rng.randint(1, 40)
        seqs.append(q + rng.randint(0, 150))
        qls.append(q)
    return qls, seqs, nd, dql


def test_from_device_matches_build_on_random_batches() -> None:
    rng = random.Random(7)
    for _ in range(40):
        qls, seqs, nd, dql = _random_lengths(rng)
        width = max([-(-s // 16) for s in seqs] + [1])
        bt = torch.randint(0, 50, (len(qls), width), dtype=torch.int32)
        want = mm3.BatchMetadata.build(qls, seqs, bt, block_size=16, num_decodes=nd, decode_query_len=dql)
        qsl = torch.tensor([0] + [sum(qls[:i + 1]) for i in range(len(qls))], dtype=torch.int32)
        got = mm3.BatchMetadata.from_device(qsl, torch.tensor(seqs, dtype=torch.int32), bt, num_decodes=nd,
                                            num_tokens=sum(qls), max_query_len=max(qls, default=0),
                                            block_size=16, decode_query_len=dql,
                                            num_decode_tokens=sum(qls[:nd]))
        for f in ("query_start_loc", "seq_lens", "context_lens", "token_to_request", "token_positions"):
            assert getattr(got, f).tolist() == getattr(want, f).tolist(), (f, qls, seqs, nd)
        assert got.validate() is got
        assert (got.query_lens, got.seq_lens_host, got.num_tokens, got.num_decode_tokens) == \
            (want.query_lens, want.seq_lens_host, want.num_tokens, want.num_decode_tokens)


def test_update_from_device_refills_in_place() -> None:
    bt = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    qsl = torch.tensor([0, 1, 2, 7], dtype=torch.int32)
    b = mm3.BatchMetadata.from_device(qsl, torch.tensor([300, 129, 5], dtype=torch.int32), bt, num_decodes=2,
                                      num_tokens=7, max_query_len=5, block_size=128)
    assert b.seq_lens_host == (300, 129, 5)
    ptrs = [t.data_ptr() for t in (b.query_start_loc, b.seq_lens, b.token_positions, b.context_lens)]
    b.update_from_device_(qsl, torch.tensor([301, 0, 9], dtype=torch.int32), bt)  # second decode padding
    assert [t.data_ptr() for t in (b.query_start_loc, b.seq_lens, b.token_positions, b.context_lens)] == ptrs
    assert b.token_positions.tolist() == [300, -1, 4, 5, 6, 7, 8]
    assert b.context_lens.tolist() == [300, 0, 4]
    assert b.seq_lens_host == (301, 0, 9)  # read back again, not the stale copy
    with pytest.raises(mm3.InputError, match="shape class"):
        b.update_from_device_(qsl[:3], torch.tensor([1, 2], dtype=torch.int32), bt[:2])


@pytest.mark.parametrize("bad, match", [
    (dict(num_tokens=6), r"ends query_start_loc at 7 tokens, but the step has 6 \(num_tokens\)"),
    (dict(num_decode_tokens=3), "closes the decodes at token 2, but num_decode_tokens is 3"),
    (dict(max_query_len=4), "request 2 holds 5 query tokens, more than max_prefill_query_len=4"),
    (dict(seq_lens=[300, 129, 4]), "request 2 has seq_len 4 < query_len 5"),
    (dict(seq_lens=[300, 129, 600]), "needs 5 blocks of 128 but the block table has only 4 columns"),
])
def test_validate_names_what_is_wrong(bad: dict, match: str) -> None:
    kw = dict(num_decodes=2, num_tokens=7, max_query_len=5, block_size=128)
    seqs = bad.pop("seq_lens", [300, 129, 5])
    kw.update(bad)
    b = mm3.BatchMetadata.from_device(torch.tensor([0, 1, 2, 7], dtype=torch.int32),
                                      torch.tensor(seqs, dtype=torch.int32),
                                      torch.zeros(3, 4, dtype=torch.int32), **kw)
    with pytest.raises(mm3.InputError, match=match):
        b.validate()


def test_from_device_refuses_wrong_tensors() -> None:
    with pytest.raises(mm3.InputError, match="query_start_loc must be an int32 tensor, got torch.int64"):
        mm3.BatchMetadata.from_device(torch.tensor([0, 1]), torch.tensor([3], dtype=torch.int32),
                                      torch.zeros(1, 1, dtype=torch.int32), num_decodes=1, num_tokens=1,
                                      max_query_len=1, block_size=16)
    with pytest.raises(mm3.InputError, match=r"shapes do not agree"):
        mm3.BatchMetadata.from_device(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32),
                                      torch.zeros(2, 1, dtype=torch.int32), num_decodes=1, num_tokens=1,
                                      max_query_len=1, block_size=16)


def test_engine_loop_example_runs_and_checks_itself(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "engine_loop.py"
    spec = importlib.util.spec_from_file_location("engine_loop", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "engine_loop", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    assert module.main(["--requests", "3", "--layers", "1", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert "mixed" in text and "decode" in text and "passed:" in text, text
    assert "includes compilation" in text and " ms, repeated " in text, text   # which times hold compile time

    if not torch.cuda.is_available():   # a device this build cannot use: argparse's error, not a torch assert
        with pytest.raises(SystemExit) as stop:
            module.main(["--device", "cuda"])
        assert stop.value.code == 2
        assert "--device cuda cannot be used by this PyTorch build" in capsys.readouterr().err
