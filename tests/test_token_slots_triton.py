"""The Triton kernels read token slots (docs/spec.md §2.1) in every format, through Triton's interpreter (CPU).

A step through token slots holds the same keys as the same step through pages, only found another way
(a gather per token through the slot table, backends/triton/addressing.py), so every kernel must give
the *same bits* on both: the indexers (decode with and without the fused top-k, prefill with and without
splits), the block scores, the decode attention (persistent and grid) and the prefill attention
(block-grouped and token-tile). And the slot step is checked against the fp64 oracle on its own: fresh
random inputs, NaN-poisoned outputs, mixed batches (speculative decodes, a padding decode, a chunked and
a fresh prefill), K/V in 16-bit, fp32, scaled fp8 (per tensor, head and slot), unscaled e4m3 and NVFP4,
index keys in 16-bit, e4m3 and NVFP4, fp8 queries. The conformance kit's token-slot cases run in
tests/test_triton_conformance.py; the GPU in tests/gpu/test_sglang_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

import mm3
from mm3 import InputError
from mm3.contract.params import SparseAttentionParams
from mm3.testing.conformance.scores import check_scores
from mm3.testing.factories import as_token_slots, make_case
from mm3.testing.oracle import check_topk, oracle_attention, oracle_topk
from mm3_backends.triton.addressing import block_columns
from mm3_backends.triton.launch import override

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]

P = SparseAttentionParams(num_heads=6, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                          block_size=16, topk=4, init_blocks=1, local_blocks=1)

# docs/spec.md §4's tolerances (max, mean) of the attention dtype; quantized K/V: the quantized step's
ATTN_TOL = {torch.float16: (1e-2, 1e-3), torch.bfloat16: (3e-2, 3e-3), torch.float32: (1e-5, 1e-5)}


def _configs() -> dict[str, object]:
    from mm3_backends.cuda.plugin import PLATFORM as CUDA
    from mm3_backends.rocm.plugin import PLATFORM as ROCM

    cuda = CUDA.launch_config(torch.device("cpu"))
    return {
        "cuda": cuda,   # persistent decode, fused top-k, block-grouped prefill
        "rocm": ROCM.launch_config(torch.device("cpu")),   # grid decode, token-tile prefill
        # the indexer's other launches: a top-k kernel of its own, prefill tiles split over programs
        "topk_launched+prefill_splits": override(cuda, algorithms=dict(topk_in_last_program=False),
                                                 target_programs=256, prefill_index=dict(chunk=2, max_splits=4)),
    }


#: (attention dtype, K/V format, fp8 scale kind, index format, fp8 queries)
FORMATS = {
    "f16": ("float16", None, "head", "float8_e4m3fn", False),
    "f32": ("float32", None, "head", "float32", False),
    "bf16_kv_e4m3_tensor": ("bfloat16", "float8_e4m3fn", "tensor", "bfloat16", False),
    "f16_kv_e5m2_head": ("float16", "float8_e5m2", "head", "float16", False),
    "bf16_kv_e4m3_slot": ("bfloat16", "float8_e4m3fn", "slot", "float8_e4m3fn", False),
    "f16_kv_e4m3_unscaled": ("float16", "float8_e4m3fn_unscaled", "head", "bfloat16", False),
    "f16_nvfp4": ("float16", "nvfp4", "head", "nvfp4", False),
    "q8_bf16_nvfp4": ("bfloat16", "nvfp4", "head", "nvfp4", True),
}


def _cases(fmt: str, seed: int) -> tuple[object, object]:
    dtype, kv, scale, index, q8 = FORMATS[fmt]
    paged = make_case(P, decodes=[70, 33], prefills=[(9, 200), (3, 3)], padding_decodes=1, decode_query_len=2,
                      dtype=dtype, index_dtype=index, kv_dtype=kv, kv_scale=scale,
                      q_dtype="float8_e4m3fn" if q8 else None, seed=seed)
    return paged, as_token_slots(paged, torch.Generator().manual_seed(seed + 1))


def _topk(case: object, cfg: object, layout: str) -> mm3.TopkBuffer:
    from mm3_backends.triton import indexer

    T = case.batch.num_tokens
    out = mm3.TopkBuffer.allocate(T, P.num_kv_heads, P.topk, layout=layout)
    out.storage.fill_(-7)     # poisoned: every row must be written
    indexer.index_topk(case.index_q, case.caches, case.batch, P, out, cfg)
    return out


def _attend(case: object, sel: mm3.TopkBuffer, cfg: object) -> torch.Tensor:
    from mm3_backends.triton import attention

    T = case.batch.num_tokens
    out = torch.full((T + 2, P.num_heads, P.head_dim), float("nan"), dtype=case.out_dtype)
    attention.attention_forward(case.q, case.caches, sel, case.batch, P, out[:T], cfg)
    assert out[T:].isnan().all(), "rows past the step were written"
    return out[:T]


PAIRS = [("cuda", "f16"), ("rocm", "f32"), ("cuda", "bf16_kv_e4m3_tensor"), ("rocm", "f16_kv_e5m2_head"),
         ("cuda", "bf16_kv_e4m3_slot"), ("rocm", "bf16_kv_e4m3_slot"), ("rocm", "f16_kv_e4m3_unscaled"),
         ("cuda", "f16_nvfp4"), ("rocm", "q8_bf16_nvfp4"), ("topk_launched+prefill_splits", "f16_nvfp4")]


@pytest.mark.parametrize("path, fmt", PAIRS, ids=[f"{p}-{f}" for p, f in PAIRS])
def test_slots_give_the_bits_of_pages_and_the_oracle_agrees(path: str, fmt: str) -> None:
    paged, slotted = _cases(fmt, seed=len(path) * 7 + len(fmt))
    assert slotted.batch.facts.addressing == "slots" and slotted.batch.block_table.shape[1] == 0
    cfg = _configs()[path]
    layout = "head_major" if path == "rocm" else "token_major"
    if path == "topk_launched+prefill_splits":     # the prefill tiles' blocks are split over programs
        tiles = -(-slotted.batch.max_prefill_query_len // (max(cfg.prefill_index.rows, 16) // P.num_index_heads))
        assert cfg.prefill_index_splits(slotted.batch.num_prefills * tiles, block_columns(slotted.batch)) > 1
    got = _topk(slotted, cfg, layout)
    assert torch.equal(got.head_major(), _topk(paged, cfg, layout).head_major())
    assert not check_topk(got, slotted.index_q, slotted.caches, slotted.batch, P)

    sel = oracle_topk(slotted.index_q, slotted.caches, slotted.batch, P)
    out = _attend(slotted, sel, cfg)
    assert not out.isnan().any(), "unwritten (NaN-poisoned) output elements"
    assert torch.equal(out, _attend(paged, sel, cfg)), "token slots changed the arithmetic"
    ref = oracle_attention(slotted.q, slotted.caches, sel, slotted.batch, P)
    err = (out.double() - ref).abs()
    max_tol, mean_tol = ATTN_TOL[slotted.out_dtype]
    assert err.max().item() <= max_tol and err.mean().item() <= mean_tol, (err.max().item(), err.mean().item())


@pytest.mark.parametrize("path, fmt", [("cuda", "f16_nvfp4"), ("rocm", "f16")])
def test_block_scores_of_slots_are_those_of_pages_and_the_oracle(path: str, fmt: str) -> None:
    from mm3_backends.triton import index_scores

    paged, slotted = _cases(fmt, seed=5)
    T = slotted.batch.num_tokens
    N = 16 * -(-paged.batch.block_table.shape[1] // 16)
    got = []
    for case in (slotted, paged):
        out = torch.full((P.num_index_heads, T, N), float("nan"))
        index_scores.index_scores(case.index_q, case.caches, case.batch, P, out, _configs()[path])
        got.append(out)
    assert torch.equal(got[0], got[1])
    check_scores(slotted, got[0], {})


def test_a_slot_table_edited_in_place_is_read_at_the_next_step() -> None:
    """An engine moves a token (copies its rows to another slot and edits its table entry): the kernels read the
    table as it is now, the same launch arguments (what a captured graph replays)."""
    paged, slotted = _cases("f16", seed=9)
    cfg = _configs()["cuda"]
    sel = oracle_topk(slotted.index_q, slotted.caches, slotted.batch, P)
    before = _attend(slotted, sel, cfg)
    table, rows, c = slotted.batch.slots.table, slotted.batch.slots.rows, slotted.caches
    r, p = 0, 5     # request 0's position 5: a key its decode sees (an init block)
    old = int(table[rows[r], p])
    used = set(table[table >= 0].tolist())
    new = next(s for s in range(c.k.shape[0]) if s not in used)
    for t in (c.k, c.v, c.index):
        t[new] = t[old]
        t[old] = (torch.randn(t[old].shape, generator=torch.Generator().manual_seed(1)) * 50).to(t.dtype)
    table[rows[r], p] = new
    assert torch.equal(_attend(slotted, sel, cfg), before)
    got = _topk(slotted, cfg, "token_major")
    assert not check_topk(got, slotted.index_q, slotted.caches, slotted.batch, P)


# -- the plugins' check_contents hook judges a slot table on the device ---------------------------------------
NUM_SLOTS = 64
SLOT_GOOD = [[-1] * 6, [10, 11, 3, 40, 63, -1], [7, 8, 9, -1, -1, -1]]
SLOT_BAD = [
    ("a slot row outside the table", dict(rows=[1, 3]), r"request 1 has slot row \?"),
    ("a negative slot row", dict(rows=[-1, 2]), r"request 0 has slot row \?"),
    ("a used position without a slot", dict(table=[[-1] * 6, [10, 11, 3, -1, 63, -1], SLOT_GOOD[2]]),
     r"request 0, position 3: \S*slot_table\[\S*slot_rows\[0\], 3\] is not a slot of the cache, in \[0, 64\)"),
    ("a slot past the cache", dict(table=[[-1] * 6, SLOT_GOOD[1], [7, 64, 9, -1, -1, -1]]),
     r"request 1, position 1: .* is not a slot of the cache"),
    ("a seq_len past the table", dict(table=[[-1] * 6, SLOT_GOOD[1], [7, 8, 9, 12, 13, 14]], sl=(5, 7)),
     r"request 1 has seq_len \S+, but \S*slot_table has only \S+ columns"),
]


def _slot_batch(table: list[list[int]], rows: list[int], sl: tuple[int, int]) -> object:
    """One decode and one prefill of 3 tokens, built as an engine builds them: contents unchecked."""
    from mm3 import BatchMetadata
    from mm3.contract.slots import TokenSlots

    qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
    slots = TokenSlots.of(torch.tensor(table, dtype=torch.int32), torch.tensor(rows))
    return BatchMetadata.from_device(qsl, torch.tensor(sl, dtype=torch.int32), torch.zeros(2, 0, dtype=torch.int32),
                                     num_decodes=1, num_tokens=4, max_query_len=3, block_size=16, slots=slots)


def _judge(batch: object, plugin: str) -> object:
    from mm3.contract.contents import FaultFlag
    from mm3.contract.facts import LAYER_NAMES
    from mm3.runtime.registry import default_registry

    flag = FaultFlag("cpu")
    flag.about("t", LAYER_NAMES, NUM_SLOTS, batch)     # what the boundary names before it calls the hook
    default_registry().get(plugin).check_contents(batch, NUM_SLOTS, flag.word)
    return flag


@pytest.mark.parametrize("plugin", ["cuda", "rocm"])
@pytest.mark.parametrize("what, change, message", SLOT_BAD, ids=[b[0] for b in SLOT_BAD])
def test_the_contents_hook_names_each_slot_fault(plugin: str, what: str, change: dict, message: str) -> None:
    """The one-launch check (backends/triton/contents.py) finds what mm3's torch rules find (slots_word), named
    the same way: a slot row outside the table, a used position without a slot or past the cache, a seq_len
    past the table."""
    args = {"table": SLOT_GOOD, "rows": [1, 2], "sl": (5, 3), **change}
    flag = _judge(_slot_batch(args["table"], args["rows"], args["sl"]), plugin)
    with pytest.raises(InputError, match=f"{message}.*found on the device"):
        flag.raise_pending()


@pytest.mark.parametrize("plugin", ["cuda", "rocm"])
@pytest.mark.parametrize("rows, sl", [([1, 2], (5, 3)), ([-1, 2], (0, 3)), ([2, 1], (3, 6))],
                         ids=["good", "padding_needs_no_row", "rows_swapped"])
def test_the_contents_hook_passes_a_good_slot_batch(plugin: str, rows: list[int], sl: tuple[int, int]) -> None:
    _judge(_slot_batch([[-1] * 6, [10, 11, 3, 40, 63, 0], [7, 8, 9, -1, -1, -1]], rows, sl), plugin).raise_pending()
