"""The fp64 oracle's answers, memoised for the conformance suite.

The oracle is deliberately slow (it is the literal definition). Running the
suite on several backends in one process (tests, ``mm3 check a b``) feeds it
identical inputs, so its results are cached by a digest of exactly the
tensors it reads: a hit is bit-for-bit the same question.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Callable

import torch

from mm3.contract.buffers import TopkBuffer
from mm3.testing.factories import Case
from mm3.testing.oracle import oracle_attention, oracle_block_scores, oracle_topk

__all__ = ["oracle_scores_cached", "oracle_topk_cached", "oracle_attention_cached"]

_CACHE: "OrderedDict[tuple[str, str], Any]" = OrderedDict()
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 256


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha1()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _memo(kind: str, key: str, compute: Callable[[], Any]) -> Any:
    with _CACHE_LOCK:
        if (kind, key) in _CACHE:
            _CACHE.move_to_end((kind, key))
            return _CACHE[(kind, key)]
    value = compute()
    with _CACHE_LOCK:
        _CACHE[(kind, key)] = value
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return value


def _index_key(case: Case) -> str:
    b = case.batch
    return _digest(case.index_q, case.caches.index, b.block_table, b.token_positions, b.token_to_request) + \
        repr(case.params)


def oracle_scores_cached(case: Case) -> list[torch.Tensor]:
    """:func:`~mm3.testing.oracle.oracle_block_scores` of ``case``, memoised."""
    return _memo("scores", _index_key(case), lambda: oracle_block_scores(
        case.index_q, case.caches, case.batch, case.params))


def oracle_topk_cached(case: Case) -> TopkBuffer:
    """:func:`~mm3.testing.oracle.oracle_topk` of ``case`` (head-major, CPU), memoised; a fresh copy."""
    return _memo("topk", _index_key(case), lambda: oracle_topk(
        case.index_q, case.caches, case.batch, case.params)).clone()


def oracle_attention_cached(case: Case, sel: TopkBuffer) -> torch.Tensor:
    """:func:`~mm3.testing.oracle.oracle_attention` of ``case`` on ``sel``, memoised."""
    b = case.batch
    c = case.caches
    scales = [s for s in (c.k_scale, c.v_scale) if isinstance(s, torch.Tensor)]
    key = _digest(case.q, c.k, c.v, *scales, b.block_table, b.token_positions,
                  b.token_to_request, sel.head_major()) + repr(case.params)
    return _memo("attention", key, lambda: oracle_attention(case.q, case.caches, sel, case.batch,
                                                            case.params))
