"""The Triton plugins' kernels stay inside their tensors whatever a device batch's contents hold.

A device batch's contents are judged on the device while the step's kernels run, and a fault raises at
the next step or at ``check_page_ids()`` (docs/errors.md §2.6). So in a faulty step every kernel runs on
the faulty values: a query start past the step's tokens, a token's request past the batch's, a position
past the block table. On a GPU a load or store outside a tensor corrupts memory or poisons the CUDA
context, which no later error can undo. Here each kernel of the cuda and rocm plugins runs under the
interpreter's bounds check (:mod:`mm3_backends.triton.interpreter_bounds`: every lane of every access
compared with the extents of the kernel's tensors) on a batch made as an engine makes it
(``BatchMetadata.from_device``, its tables treated as device memory) and then edited in place; ``q``,
``index_q`` and ``out`` sit inside canary margins. Each case must touch nothing
outside its tensors, and the fault must still be raised. The steps: a mixed one, decodes alone (the
score launch judges them), decodes with a draft token and a padding decode, and the mixed one through
token slots. Every case runs on both plugins and on two launch variants (the second takes the kernel
paths a GPU takes at other shapes, the streamed decode among them). The edits that move cache addresses
run again on fp8 and on NVFP4 caches, whose value and scale loads are kernels' code of their own.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch

import mm3
import mm3.runtime.step as step_mod
from mm3 import BatchMetadata, InputError
from mm3.plugin import TokenSlots
from mm3.testing.factories import as_token_slots, make_case

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the bounds check runs the kernels in Triton's interpreter")

P = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2, index_head_dim=16,
                              block_size=16, topk=4)
MARGIN = 1024     # canary elements on each side of a guarded tensor
CANARY = -777


Edit = Callable[[BatchMetadata, int], None]    # edits a batch in place; the int: its block table's width


def _put(name: str, at: Any, value: Callable[[int], int], derive: bool = False) -> Edit:
    def edit(b: BatchMetadata, width: int) -> None:
        getattr(b, name)[at] = value(width)
        if derive:      # the engine refilled the lengths in place and mm3 derived the tokens from them again
            b._derive_tokens()
    return edit


def _qsl(values: tuple[int, ...], derive: bool = False) -> Edit:
    def edit(b: BatchMetadata, width: int) -> None:
        b.query_start_loc.copy_(torch.tensor(values, dtype=torch.int32))
        if derive:
            b._derive_tokens()
    return edit


def _const(v: int) -> Callable[[int], int]:
    return lambda width: v


PAST_TABLE = lambda width: width * P.block_size + 5  # noqa: E731 - a position one block past the table

# the mixed step: decodes [40, 20], prefills (5 tokens, seq 35) and (3, 20): qsl (0, 1, 2, 7, 10), T = 10,
# R = 4, a table of 4 columns. Moderate values as well as huge ones: int32 arithmetic wraps huge ones around.
MIXED: dict[str, Edit] = {
    "qsl_end_past_tokens": _qsl((0, 1, 2, 11, 10)),
    "qsl_end_past_tokens_derived": _qsl((0, 1, 2, 11, 10), True),
    "qsl_last_past_tokens": _qsl((0, 1, 2, 7, 15)),
    "qsl_prefill_start_past_tokens": _qsl((0, 1, 2, 40, 10)),
    "qsl_prefill_start_huge": _qsl((0, 1, 2, 2 ** 30, 10)),
    "qsl_decode_start_past_tokens": _qsl((0, 50, 51, 7, 10)),
    "qsl_decode_start_huge": _qsl((0, 2 ** 30, 2 ** 30 + 1, 7, 10)),
    "qsl_decreasing": _qsl((0, 1, 2, 1, 10)),
    "qsl_first_negative": _qsl((-3, 1, 2, 7, 10)),
    "qsl_prefill_start_negative": _qsl((0, 1, -5, 7, 10), True),
    "qsl_prefill_start_negative_huge": _qsl((0, 1, -(2 ** 30), 7, 10)),
    "qsl_decode_start_negative": _qsl((0, -20, 2, 7, 10)),
    "t2r_decode_past_requests": _put("token_to_request", 0, _const(9)),
    "t2r_decode_negative": _put("token_to_request", 1, _const(-3)),
    "t2r_prefill_past_requests": _put("token_to_request", 4, _const(9)),
    "t2r_prefill_huge": _put("token_to_request", 4, _const(2 ** 30)),
    "t2r_prefill_negative": _put("token_to_request", 8, _const(-3)),
    "t2r_prefill_to_a_decode": _put("token_to_request", 8, _const(0)),
    "pos_decode_past_table": _put("token_positions", 0, PAST_TABLE),
    "pos_decode_far": _put("token_positions", 0, _const(4096)),
    "pos_decode_int_max": _put("token_positions", 1, _const(2 ** 31 - 1)),
    "pos_prefill_past_table": _put("token_positions", 6, PAST_TABLE),
    "pos_prefill_far": _put("token_positions", 6, _const(4096)),
    "pos_prefill_int_max": _put("token_positions", 9, _const(2 ** 31 - 1)),
    "pos_negative": _put("token_positions", 3, _const(-7)),
    "seq_len_decode_huge_derived": _put("seq_lens", 0, _const(10 ** 6), True),
    "seq_len_prefill_far_derived": _put("seq_lens", 3, _const(4096), True),
    "seq_len_prefill_negative_derived": _put("seq_lens", 2, _const(-100), True),
    "context_len_wrong": _put("context_lens", 2, _const(10 ** 6)),
    "page_id_huge": _put("block_table", (0, 0), _const(10 ** 6)),
    "page_id_negative": _put("block_table", (3, 1), _const(-5)),
}
# a step of decodes alone, [40, 20, 70]: qsl (0, 1, 2, 3), a table of 6 columns; the score launch judges it
DECODES: dict[str, Edit] = {
    "qsl_start_past_tokens": _qsl((0, 50, 51, 3)),
    "qsl_start_huge": _qsl((0, 2 ** 30, 2, 3)),
    "qsl_start_negative": _qsl((0, -20, 2, 3)),
    "qsl_end_past_tokens": _qsl((0, 1, 2, 9)),
    "t2r_past_requests": _put("token_to_request", 0, _const(9)),
    "t2r_huge": _put("token_to_request", 0, _const(2 ** 30)),
    "t2r_negative": _put("token_to_request", 1, _const(-3)),
    "pos_past_table": _put("token_positions", 0, PAST_TABLE),
    "pos_huge": _put("token_positions", 2, _const(10 ** 6)),
    "pos_int_max": _put("token_positions", 1, _const(2 ** 31 - 1)),
    "seq_len_huge_derived": _put("seq_lens", 2, _const(10 ** 6), True),
}

# decodes [40, 20] of two tokens each (one draft), a padding decode (seq_len 0) and a prefill (5, 35):
# qsl (0, 2, 4, 6, 11), T = 11
DRAFTS: dict[str, Edit] = {
    "qsl_end_past_tokens": _qsl((0, 2, 4, 15, 11)),
    "qsl_draft_start_past_tokens": _qsl((0, 30, 32, 6, 11)),
    "qsl_decreasing": _qsl((0, 2, 4, 3, 11)),
    "t2r_draft_past_requests": _put("token_to_request", 1, _const(9)),
    "pos_draft_far": _put("token_positions", 2, _const(4096)),
    "pos_draft_int_max": _put("token_positions", 1, _const(2 ** 31 - 1)),
    "seq_len_padding_huge_derived": _put("seq_lens", 2, _const(10 ** 6), True),
}


def _slot_row(request: int, value: int) -> Edit:
    def edit(b: BatchMetadata, width: int) -> None:
        b.slots.rows[request] = value
    return edit


def _slot(request: int, position: int, value: int) -> Edit:
    def edit(b: BatchMetadata, width: int) -> None:     # the slot of a position the request's seq_len uses
        b.slots.table[b.slots.rows[request], position] = value
    return edit


# the mixed step through token slots (one-token pages found through a slot table of its own)
SLOTS: dict[str, Edit] = {
    "qsl_end_past_tokens": MIXED["qsl_end_past_tokens"],
    "t2r_decode_past_requests": MIXED["t2r_decode_past_requests"],
    "t2r_prefill_past_requests": MIXED["t2r_prefill_past_requests"],
    "pos_decode_far": MIXED["pos_decode_far"],
    "pos_prefill_far": MIXED["pos_prefill_far"],
    "slot_row_huge": _slot_row(1, 10 ** 6),
    "slot_row_negative": _slot_row(2, -4),
    "slot_huge": _slot(0, 3, 10 ** 6),
    "slot_negative": _slot(3, 17, -9),
}
KINDS = {"mixed": MIXED, "decodes": DECODES, "drafts": DRAFTS, "slots": SLOTS}


def _cases() -> list[Any]:
    out = []
    for kind, edits in KINDS.items():
        for name in edits:
            for backend in ("cuda", "rocm"):
                for variant in ("default", "other paths"):
                    out.append(pytest.param(backend, variant, kind, name, id=f"{backend}-{variant}-{kind}-{name}"))
    return out


def _other_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel paths a GPU takes at other shapes: the top-k in the last score program, more blocks per
    decode score split than the table has columns, the prefill index split over two programs (and merged),
    the decode attention's merge in its last program, the attention streamed behind the indexer (the
    cuda plugin's persistent kernel waits on each request's ready flag)."""
    from mm3_backends.triton import indexer
    from mm3_backends.triton.launch import LaunchConfig

    monkeypatch.setattr(LaunchConfig, "use_topk_in_last_program", lambda self, *a, **k: True)
    monkeypatch.setattr(LaunchConfig, "decode_index_blocks_per_split", lambda self, *a, **k: 8)
    monkeypatch.setattr(LaunchConfig, "prefill_index_splits", lambda self, *a, **k: 2)
    monkeypatch.setattr(LaunchConfig, "use_merge_in_last_program", lambda self, *a, **k: True)
    monkeypatch.setattr(indexer, "streamed_enabled", lambda cfg, *a: cfg.algorithms.decode_attention_flat)


def _guarded(like: torch.Tensor, fill: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of ``like`` (zeros unless ``fill``) inside a flat buffer whose margins hold :data:`CANARY`."""
    buf = torch.full((2 * MARGIN + like.numel(),), CANARY, dtype=like.dtype)
    view = buf[MARGIN:MARGIN + like.numel()].view(like.shape)
    view.copy_(like if fill else torch.zeros_like(like))
    return view, buf


def _margins_untouched(buf: torch.Tensor) -> bool:
    return bool((buf[:MARGIN] == CANARY).all() and (buf[-MARGIN:] == CANARY).all())


def _device_batch(kind: str) -> tuple[Any, BatchMetadata]:
    """The case and its batch as an engine builds it, from tensors it holds (copies: edited in place)."""
    spec: dict[str, Any] = {"mixed": dict(decodes=[40, 20], prefills=[(5, 35), (3, 20)]),
                            "slots": dict(decodes=[40, 20], prefills=[(5, 35), (3, 20)]),
                            "decodes": dict(decodes=[40, 20, 70]),
                            "drafts": dict(decodes=[40, 20], prefills=[(5, 35)], decode_query_len=2,
                                           padding_decodes=1)}[kind]
    case = make_case(P, dtype="float32", index_dtype="float32", seed=3, **spec)
    if kind == "slots":
        case = as_token_slots(case, torch.Generator().manual_seed(3))
    b = case.batch
    slots = None if b.slots is None else TokenSlots.of(b.slots.table.clone(), b.slots.rows.clone())
    batch = BatchMetadata.from_device(b.query_start_loc.clone(), b.seq_lens.clone(), b.block_table.clone(),
                                      num_decodes=b.num_decodes, num_tokens=b.num_tokens,
                                      max_query_len=b.max_query_len, block_size=P.block_size,
                                      decode_query_len=b.decode_query_len, context_lens=b.context_lens.clone(),
                                      slots=slots)
    return case, batch


@pytest.mark.parametrize("backend, variant, kind, name", _cases())
def test_a_batch_edited_in_place_is_read_and_written_inside_its_tensors(
        monkeypatch: pytest.MonkeyPatch, backend: str, variant: str, kind: str, name: str) -> None:
    from mm3_backends.triton.interpreter_bounds import checking

    if variant != "default":
        _other_paths(monkeypatch)
    monkeypatch.setattr(step_mod, "on_host", lambda batch: False)   # CPU tables stand in for device ones
    case, batch = _device_batch(kind)
    T = batch.num_tokens
    layer = mm3.SparseAttention(P, dtype=torch.float32, index_dtype=torch.float32, max_num_tokens=T,
                                max_decode_query_len=batch.decode_query_len, backend=backend)
    q, q_buf = _guarded(case.q)
    iq, iq_buf = _guarded(case.index_q)
    out, out_buf = _guarded(case.q, fill=False)
    layer(q, iq, case.caches, batch, out=out)      # the first step: judged on the host, once
    KINDS[kind][name](batch, batch.block_table.shape[1])
    with checking() as outside:
        layer(q, iq, case.caches, batch, out=out)  # the faulty step: judged on the device as it runs
    assert outside == [], f"{name}: accesses outside the kernels' tensors: {outside}"
    assert all(_margins_untouched(b) for b in (q_buf, iq_buf, out_buf))   # the top-k storage: by its extent
    with pytest.raises(InputError):
        layer.check_page_ids()


@pytest.mark.parametrize("backend", ["cuda", "rocm"])
@pytest.mark.parametrize("name", ["qsl_end_past_tokens", "qsl_first_negative", "qsl_decode_start_past_tokens",
                                  "qsl_prefill_start_negative_huge", "pos_prefill_far", "pos_decode_int_max"])
def test_the_block_scores_of_a_corrupt_batch_are_written_inside_their_tensor(backend: str, name: str) -> None:
    """``index_scores`` (an entry point of its own: the drop-ins' score functions) on a corrupt step: its
    ``[H, T, N]`` output, N wider than the table, sits inside canary margins."""
    from importlib import import_module

    from mm3_backends.triton.interpreter_bounds import checking

    plugin = import_module(f"mm3_backends.{backend}.plugin")
    case, batch = _device_batch("mixed")
    iq, iq_buf = _guarded(case.index_q)
    scores, scores_buf = _guarded(torch.empty(P.num_index_heads, batch.num_tokens, 16), fill=False)
    word = torch.full((1,), 2 ** 63 - 1, dtype=torch.int64)
    MIXED[name](batch, batch.block_table.shape[1])
    with checking() as outside:
        plugin.index_scores(index_q=iq, caches=case.caches, batch=batch, params=P, out=scores, page_faults=word)
    assert outside == [], f"{name}: accesses outside the kernel's tensors: {outside}"
    assert _margins_untouched(scores_buf) and _margins_untouched(iq_buf)


@pytest.mark.parametrize("backend", ["cuda", "rocm"])
@pytest.mark.parametrize("kind", ["decodes", "mixed"])
def test_an_attention_handed_a_callers_topk_reads_no_block_past_the_table(backend: str, kind: str) -> None:
    """The attention called alone (the custom op, the drop-ins' attention functions) reads a top-k its caller
    wrote: ids far past the table, beside positions far past it, must read no block-table column past the
    table (the indexer's own ids never go past it, so only this call shows it)."""
    from importlib import import_module

    from mm3.plugin import TopkBuffer
    from mm3_backends.triton.interpreter_bounds import checking

    plugin = import_module(f"mm3_backends.{backend}.plugin")
    case, batch = _device_batch(kind)
    T, width = batch.num_tokens, batch.block_table.shape[1]
    ids = torch.randint(0, 1 << 20, (P.num_kv_heads, T, P.topk), generator=torch.Generator().manual_seed(1),
                        dtype=torch.int32)
    ids[:, :, 0] = width + 3                         # every row selects a block just past the table, too
    batch.token_positions.fill_(2 ** 31 - 1)
    out, out_buf = _guarded(case.q, fill=False)
    with checking() as outside:
        plugin.attention_forward(q=case.q, caches=case.caches, topk=TopkBuffer(ids), batch=batch, params=P, out=out)
    assert outside == [], f"accesses outside the kernels' tensors: {outside}"
    assert _margins_untouched(out_buf)


def test_the_bounds_check_sees_an_access_outside_and_masks_it() -> None:
    """The check itself: a kernel that stores two lanes past its tensor is caught (and the lanes are masked
    off, so the canaries stay), one that stays inside is not."""
    import triton
    import triton.language as tl

    from mm3_backends.triton.interpreter_bounds import checking

    @triton.jit
    def shifted_store(x_ptr, shift, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs + shift, offs.to(tl.float32) + 1.0)

    x, buf = _guarded(torch.zeros(8))
    with checking() as outside:
        shifted_store[(1,)](x, 6, BLOCK=4)
    assert [(v.kernel, v.op, v.nearest, v.lanes, v.offset) for v in outside] == [("shifted_store", "store", "x_ptr",
                                                                                 2, 8)]
    assert _margins_untouched(buf) and x[6:].tolist() == [1.0, 2.0]
    with checking() as outside:
        shifted_store[(1,)](x, 4, BLOCK=4)
    assert outside == [] and x[4:].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_the_bounds_check_sees_an_overrun_into_a_neighbouring_argument() -> None:
    """Two lanes of a store into ``x`` land in ``y``, the next argument in memory: inside a tensor of the
    launch, but not the one the access addresses (the argument holding most of its lanes)."""
    import triton
    import triton.language as tl

    from mm3_backends.triton.interpreter_bounds import checking

    @triton.jit
    def shifted_pair(x_ptr, y_ptr, shift, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs + shift, 1.0)
        tl.store(y_ptr + offs, 2.0)

    both = torch.zeros(16)
    x, y = both[:8], both[8:]
    with checking() as outside:
        shifted_pair[(1,)](x, y, 6, BLOCK=4)
    assert [(v.op, v.nearest, v.lanes, v.offset) for v in outside] == [("store", "x_ptr", 2, 8)]
    assert y.tolist() == [2.0] * 4 + [0.0] * 4     # the two lanes were masked off: y[0:2] is y's own 2.0


def test_the_bounds_check_refuses_to_run_where_kernels_are_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where Triton compiles the kernels (TRITON_INTERPRET unset when it was imported) the check would see no
    access at all: ``checking()`` raises instead of reporting an empty list."""
    from mm3_backends.triton import tl_utils
    from mm3_backends.triton.interpreter_bounds import checking

    monkeypatch.setattr(tl_utils, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1 before Triton is imported"):
        with checking():
            pass


def test_the_bounds_check_names_the_releases_to_install_where_an_internal_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Triton that lacks an internal the check patches: the error names it and the releases to install."""
    from mm3_backends.triton import compat, interpreter_bounds

    monkeypatch.setattr(interpreter_bounds, "_installed", [])      # as in a process that never installed it
    monkeypatch.setattr(compat, "missing", lambda feature: ["triton.runtime.interpreter:Gone (no Gone)"])
    with pytest.raises(RuntimeError) as raised:
        with interpreter_bounds.checking():
            pass
    text = str(raised.value)
    assert "Gone" in text and "Install a Triton release" in text
    assert all(v in text for r in compat.RELEASES for v in r.read)


#: the quantized caches a layer reads (the plugins' own loads: fp8 values and their per-head scales, NVFP4 block
#: scales)
QUANTIZED = {
    "fp8_kv_fp8_index": dict(kv_dtype=torch.float8_e5m2, index_dtype=torch.float8_e4m3fn),
    "nvfp4_kv_nvfp4_index": dict(kv_dtype="nvfp4", index_dtype="nvfp4"),
}
#: the edits that move the addresses every cache load goes through: pages, positions, query starts, requests
QUANTIZED_EDITS = {"mixed": ["page_id_huge", "page_id_negative", "pos_prefill_far", "pos_decode_int_max",
                             "qsl_prefill_start_huge", "t2r_prefill_huge", "seq_len_decode_huge_derived"],
                   "decodes": ["qsl_start_huge", "pos_huge", "t2r_past_requests", "seq_len_huge_derived"]}


def _quantized_case(kind: str, formats: dict[str, Any]) -> tuple[Any, BatchMetadata, dict[str, Any]]:
    """:func:`_device_batch`'s step on quantized caches, and the formats (a layer is built for them)."""
    spec = {"mixed": dict(decodes=[40, 20], prefills=[(5, 35), (3, 20)]), "decodes": dict(decodes=[40, 20, 70])}[kind]
    name = lambda d: d if isinstance(d, str) else str(d).removeprefix("torch.")  # noqa: E731
    case = make_case(P, dtype="bfloat16", seed=3, **spec, kv_dtype=name(formats["kv_dtype"]),
                     index_dtype=name(formats["index_dtype"]))
    b = case.batch
    batch = BatchMetadata.from_device(b.query_start_loc.clone(), b.seq_lens.clone(), b.block_table.clone(),
                                      num_decodes=b.num_decodes, num_tokens=b.num_tokens,
                                      max_query_len=b.max_query_len, block_size=P.block_size,
                                      decode_query_len=b.decode_query_len, context_lens=b.context_lens.clone())
    return case, batch, formats


@pytest.mark.parametrize("backend", ["cuda", "rocm"])
@pytest.mark.parametrize("formats", list(QUANTIZED))
@pytest.mark.parametrize("kind, name", [(k, n) for k, names in QUANTIZED_EDITS.items() for n in names])
def test_quantized_caches_are_read_inside_their_tensors(monkeypatch: pytest.MonkeyPatch, backend: str, formats: str,
                                                        kind: str, name: str) -> None:
    """The edits that move cache addresses, on fp8 caches (scaled K/V, an fp8 index) and on NVFP4 caches: their
    value and scale loads go through the same clamped pages and bounded rows."""
    from mm3_backends.triton.interpreter_bounds import checking

    monkeypatch.setattr(step_mod, "on_host", lambda batch: False)
    case, batch, fmt = _quantized_case(kind, QUANTIZED[formats])
    T = batch.num_tokens
    layer = mm3.SparseAttention(P, dtype=torch.bfloat16, kv_dtype=fmt["kv_dtype"], index_dtype=fmt["index_dtype"],
                                max_num_tokens=T, backend=backend)
    out = torch.zeros_like(case.q)
    layer(case.q, case.index_q, case.caches, batch, out=out)   # the first step: judged on the host, once
    KINDS[kind][name](batch, batch.block_table.shape[1])
    with checking() as outside:
        layer(case.q, case.index_q, case.caches, batch, out=out)
    assert outside == [], f"{name}: accesses outside the kernels' tensors: {outside}"
    with pytest.raises(InputError):
        layer.check_page_ids()
