"""On a GPU: a device batch edited wrongly in place raises at ``check_page_ids()``, never an illegal access.

tests/test_kernel_bounds.py holds every kernel of both plugins to its tensors under the interpreter,
lane by lane. Here the compiled kernels run the cases that crashed the interpreter (or hung it) before
the kernels bounded their rows, requests and blocks: huge and negative query starts, requests and
positions. A kernel that reads or writes outside its tensors raises an illegal-address error at the
synchronisation, and that poisons the CUDA context: the step after it, with the contents mended, must
run and equal the step before the fault.

Run on a CUDA machine (skips elsewhere)::

    pytest tests/gpu/test_kernel_bounds_gpu.py
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

import mm3
from mm3 import BatchMetadata, InputError
from mm3.testing.factories import make_case

GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _allow_rocm_here(monkeypatch: pytest.MonkeyPatch) -> None:
    from mm3_backends.rocm import plugin as rocm_plugin

    monkeypatch.setenv(rocm_plugin.ALLOW_NON_ROCM_ENV, "1")   # the rocm plugin's kernels, on this GPU


P = mm3.SparseAttentionParams(num_heads=16, num_kv_heads=2, head_dim=128, num_index_heads=2, index_head_dim=128,
                              block_size=128, topk=4)


def _set(name: str, at: object, value: int, derive: bool = False) -> Callable[[BatchMetadata], None]:
    def edit(b: BatchMetadata) -> None:
        getattr(b, name)[at] = value
        if derive:      # the engine refilled the lengths in place and mm3 derived the tokens from them again
            b._derive_tokens()
    return edit


# decodes [4000, 900], prefills (300 tokens, seq 1000) and (40, 260): qsl (0, 1, 2, 302, 342)
EDITS = {
    "qsl_prefill_start_huge": _set("query_start_loc", 3, 2 ** 30),
    "qsl_prefill_start_negative_huge": _set("query_start_loc", 2, -(2 ** 30)),
    "qsl_decode_start_huge": _set("query_start_loc", 1, 2 ** 30),
    "t2r_decode_huge": _set("token_to_request", 0, 2 ** 30),
    "t2r_prefill_huge": _set("token_to_request", 100, 2 ** 30),
    "pos_decode_int_max": _set("token_positions", 1, 2 ** 31 - 1),
    "pos_prefill_int_max": _set("token_positions", 300, 2 ** 31 - 1),
    "seq_len_decode_huge_derived": _set("seq_lens", 0, 10 ** 8, True),
}


@pytest.mark.parametrize("backend", ["cuda", "rocm"])
@pytest.mark.parametrize("name", list(EDITS))
def test_a_corrupt_step_raises_and_leaves_the_device_usable(backend: str, name: str) -> None:
    case = make_case(P, decodes=[4000, 900], prefills=[(300, 1000), (40, 260)], dtype="bfloat16", device="cuda",
                     seed=5)
    b = case.batch
    batch = BatchMetadata.from_device(b.query_start_loc.clone(), b.seq_lens.clone(), b.block_table.clone(),
                                      num_decodes=b.num_decodes, num_tokens=b.num_tokens,
                                      max_query_len=b.max_query_len, block_size=P.block_size)
    kept = {n: getattr(batch, n).clone() for n in ("query_start_loc", "seq_lens", "token_to_request",
                                                    "token_positions")}
    layer = mm3.SparseAttention(P, dtype=torch.bfloat16, max_num_tokens=b.num_tokens, backend=backend, device="cuda")
    want = layer(case.q, case.index_q, case.caches, batch).clone()
    EDITS[name](batch)
    layer(case.q, case.index_q, case.caches, batch)
    torch.cuda.synchronize()           # an access outside a tensor raises here
    with pytest.raises(InputError):
        layer.check_page_ids()
    for n, t in kept.items():          # the engine mends its tensors in place (the derived ones too)
        getattr(batch, n).copy_(t)
    batch._derive_tokens()
    got = layer(case.q, case.index_q, case.caches, batch)
    layer.check_page_ids()
    assert torch.equal(got, want)
