"""Decode-step helpers shared by the interpreter tests of the fused decode paths
(``tests/test_arrivals.py``, ``tests/test_streamed_decode.py``).

* :func:`run_decode_step`: one step through the Triton plugin's own launchers
  with a given launch config, recording every launch.
* :func:`assert_decode_step_right`: a step's top-k against the fp64 oracle's
  selection rules and its output against the oracle's attention on it.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from mm3.contract.buffers import TopkBuffer
from mm3.contract.params import SparseAttentionParams
from mm3.testing.oracle import check_topk, oracle_attention

__all__ = ["Launch", "run_decode_step", "assert_decode_step_right"]

#: one recorded launch: kernel name, grid, constexpr keyword arguments
Launch = tuple[str, tuple, dict]


def run_decode_step(cfg: Any, case: Any, p: SparseAttentionParams, layout: str,
                    attention_buf: Optional[TopkBuffer] = None) -> tuple[torch.Tensor, torch.Tensor, list[Launch]]:
    """The indexer then the attention on ``case`` with launch config ``cfg``, into a poisoned top-k
    buffer of ``layout`` and a NaN output; ``attention_buf``: the attention reads a copy of the top-k
    there instead. Returns the top-k (head-major), the output and the launches in order."""
    from mm3_backends.triton import attention, fast_launch, indexer

    launched: list[Launch] = []
    real = fast_launch.launch

    def recording(fn: Any, grid: tuple, args: tuple, kwargs: dict, *rest: Any) -> None:
        launched.append((fn.__name__, grid, kwargs))
        real(fn, grid, args, kwargs, *rest)

    T = case.batch.num_tokens
    buf = TopkBuffer.allocate(T, p.num_kv_heads, p.topk, layout, fill=-7)
    out = torch.full_like(case.q, float("nan"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(indexer, "launch", recording)
        mp.setattr(attention, "launch", recording)
        indexer.index_topk(case.index_q, case.caches, case.batch, p, buf, cfg)
        if attention_buf is not None:
            attention_buf.storage.copy_(buf.storage)
        attention.attention_forward(case.q, case.caches, attention_buf or buf, case.batch, p, out, cfg)
    return buf.head_major().clone(), out, launched


def assert_decode_step_right(sel: torch.Tensor, out: torch.Tensor, case: Any, p: SparseAttentionParams,
                             tol: float = 1e-2) -> None:
    """``sel`` (head-major top-k of the step's tokens) obeys the selection rules against the oracle's
    block scores, and ``out`` is within ``tol`` of the oracle's attention over that selection."""
    T = case.batch.num_tokens
    buf = TopkBuffer.allocate(T, p.num_kv_heads, p.topk, "head_major")
    buf.storage.copy_(sel)
    errors = check_topk(buf, case.index_q, case.caches, case.batch, p)
    assert not errors, "\n".join(map(str, errors[:5]))
    ref = oracle_attention(case.q, case.caches, buf, case.batch, p)
    err = (out[:T].double() - ref[:T]).abs().max().item()
    assert err < tol, f"attention {err} from the fp64 oracle"
