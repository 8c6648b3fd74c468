"""Engine traffic reads nothing on the host: a stream of steps of new shapes, through every entry point.

An engine batching continuously sends a step of a new shape almost every step
(requests join and finish, prefill chunks come in their own sizes), so a
boundary that reads a batch's contents on the host at the first step of each
shape class reads on nearly every step: a device sync each time on a GPU. Here
a short engine-like stream (:func:`mm3_benchmarks.stream.engine_stream`: fresh
``BatchMetadata.from_device`` batches from an engine's int32 tensors, new
shapes nearly every step) runs through the layer, the custom ops (the two, and the step op a
compiled layer calls), vLLM's decode
pair and prefill functions, SGLang's decode and prefill entry points, and rank 0
of a tensor-parallel layer. Each entry
point's first steps (the first call of each batch kind, on caches of their own)
are guarded by ``check_contracts="first"``, and the guard reads what it checks,
by design; every step of the stream after them must read no tensor value on the
host (:class:`mm3_benchmarks.host_reads.CountHostReads`, which also sees inside
the custom ops).

The CPU block tables stand in for device ones (``on_host`` patched, as in
tests/test_dropin_no_host_reads.py, and SGLang's ``req_to_token`` pool too:
``mm3.integrations.sglang_inputs.on_host``, whose pages are then checked with
torch ops into the fault word). SGLang's pool has pages of the params' block
size (``page_size`` = ``block_size_k`` = 16), read as pages and, with ``page_size=1``, as token slots
(whose contents mm3 judges with torch ops too). Two backends: a stub that declares
``reports_bad_page_ids`` (as the Triton backends do: page ids are its kernels'
job) and returns at once after its first steps, and cpu_ref (which checks no
page ids itself; it plans its work from host lengths, so its own frames are let
through).
"""

from __future__ import annotations

import os
from typing import Callable

import pytest
import torch

import mm3
from mm3.integrations import sglang_inputs
from mm3.runtime import step
from mm3_backends.cpu_ref import plugin as cpu_ref_plugin
from mm3_benchmarks.host_reads import CountHostReads
from mm3_benchmarks.stream import (
    EngineBuffers, LayerRow, OpsRow, Row, Setup, SglangDecodeRow, SglangPrefillRow, StepOpRow, VllmDecodeRow,
    VllmPrefillRow, engine_stream,
)

P = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                              block_size=16, topk=4, init_blocks=1, local_blocks=1)
#: the full model whose rank 0 of 2 has P
FULL = mm3.SparseAttentionParams(**{**P.model_dump(), "num_heads": 8, "num_kv_heads": 4, "num_index_heads": 4})
STREAM = engine_stream(16, seed=3, block_size=16, max_decodes=12, decode_lens=(20, 200), max_prefill=24,
                       max_context=64, prefill_every=3, num_pages=64)
#: cpu_ref's own frames: a reference that plans its work from host lengths
CPU_REF = os.path.dirname(cpu_ref_plugin.__file__) + os.sep

ENTRIES: dict[str, Callable[[Setup], Row]] = {
    "layer": LayerRow,
    "custom ops": OpsRow,
    "step op": StepOpRow,
    "vllm decode pair": VllmDecodeRow,
    "vllm prefill functions": VllmPrefillRow,
    "sglang decode": SglangDecodeRow,
    "sglang prefill": SglangPrefillRow,
    "sglang decode, token slots": lambda setup: SglangDecodeRow(setup, page_size=1),
    "sglang prefill, token slots": lambda setup: SglangPrefillRow(setup, page_size=1),
    "tp rank": lambda setup: LayerRow(setup, tp=True),
}


def test_the_stream_is_new_shapes_of_both_kinds() -> None:
    """Otherwise the test below would pass on a boundary that reads at each new shape."""
    kinds = [s.kind for s in STREAM.steps]
    assert "decode" in kinds and kinds.count("mixed") >= 3, kinds
    assert STREAM.new_shapes() >= 13, [s.shape for s in STREAM.steps]
    assert len({s.num_decodes for s in STREAM.steps[:2]}) == 2    # the stream moves from its first step


def test_the_counter_sees_every_kind_of_read_inside_a_custom_op_too() -> None:
    t = torch.arange(4, dtype=torch.int32)
    for read in (lambda: t.tolist(), lambda: int(t[0]), lambda: bool(t.any()), lambda: t.numpy(),
                 lambda: t.cpu(), lambda: t.to("cpu"), lambda: t.sum().item()):
        with CountHostReads() as reads:
            read()
        assert reads.count == 1
    with CountHostReads() as reads:
        (t + 1).to(torch.int64).sum()
    assert reads.count == 0
    lib = torch.library.Library("mm3_stream_test", "FRAGMENT")
    lib.define("peek(Tensor x) -> ()")
    lib.impl("peek", lambda x: x.tolist() and None, "CompositeExplicitAutograd")
    with CountHostReads() as reads:
        torch.ops.mm3_stream_test.peek(t)
    assert reads.count == 1, "a custom op's kernel runs unseen"


@pytest.mark.parametrize("backend", ["stub", "cpu_ref"])
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_no_step_after_the_first_reads_the_host(entry: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step, "on_host", lambda batch: False)   # the CPU tables stand in for device ones
    monkeypatch.setattr(sglang_inputs, "on_host", lambda t: False)
    setup = Setup(P, STREAM, torch.device("cpu"), backend, full=FULL, world=2, dtype=torch.float32)
    buffers = EngineBuffers(STREAM, setup.device)
    row = ENTRIES[entry](setup)
    try:
        with torch.inference_mode():     # as engines call every entry point
            row.prime()
            stub = getattr(row, "stub", None)
            before = dict(stub.calls) if stub else {}
            reads_at: list[str] = []
            for i, s in enumerate(STREAM.steps):
                call = row.prepare(s, *buffers.load(i))
                with CountHostReads(CPU_REF) as reads:
                    call()
                if reads.count:
                    reads_at.append(f"step {i} ({s.kind}, {s.num_decodes} decodes, {s.num_tokens} tokens): "
                                    f"{reads.count} host reads, first at {reads.where[0]}")
            if stub:   # every step reached the backend: nothing was skipped
                ran = {k: stub.calls[k] - before[k] for k in before}
                prefills = sum(s.prefill is not None for s in STREAM.steps)
                want = {"layer": (16, 16), "custom ops": (16, 16), "step op": (16, 16), "tp rank": (16, 16),
                        "vllm decode pair": (16, 16), "vllm prefill functions": (0, prefills),
                        "sglang decode": (16, 16),
                        "sglang prefill": (prefills, prefills)}[entry.replace(", token slots", "")]
                assert (ran["index_topk"], ran["attention_forward"]) == want, ran
    finally:
        getattr(row, "close", lambda: None)()
    assert not reads_at, (f"{entry} on {backend}: {len(reads_at)} of the stream's {len(STREAM.steps)} steps (all "
                          f"after the entry point's first steps) read tensor values on the host, a device sync "
                          f"each on a GPU:\n" + "\n".join(reads_at))
