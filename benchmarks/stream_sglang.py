"""SGLang's entry points fed :mod:`mm3_benchmarks.stream`'s engine stream: rows like the vLLM ones.

SGLang addresses a request's tokens through its persistent ``req_to_token``
pool (``[max_reqs, max_context]``, a token slot per position) and a step's
``slot_ids`` (``req_pool_indices``); with ``--page-size`` equal to the block
size every block is one aligned page of contiguous slots. :func:`req_to_token`
builds that pool once from the stream's block-table rows, and each step passes
the slots of its requests, as SGLang's ``ForwardBatch`` does; K/V are
token-major ``[slots, Hkv, D]``, the index keys ``[slots, 1, Di]``.

* :class:`SglangDecodeRow`: ``minimax_sparse_decode`` on the step's decodes;
* :class:`SglangPrefillRow`: ``minimax_sparse_prefill`` on a step with a prefill chunk, the whole
  step as one extend batch (SGLang's mixed chunk: each decode a one-token extend); a step without a
  chunk calls nothing. Not a row of the benchmark (a chunk comes on one step in four): tests run it.
"""

from __future__ import annotations

from typing import Any

import torch

from mm3.runtime.config import Settings

from mm3_benchmarks.stream import Call, Setup, StreamStep, _i32, _prime_steps

__all__ = ["req_to_token", "SglangDecodeRow", "SglangPrefillRow"]


def req_to_token(pages: torch.Tensor, block_size: int) -> torch.Tensor:
    """The ``req_to_token`` rows of requests whose blocks are ``pages`` (``[R, W]`` page ids): position ``j``
    of row ``r`` is slot ``block_size * pages[r, j // block_size] + j % block_size``."""
    offsets = torch.arange(block_size, dtype=torch.int32, device=pages.device)
    return (pages.to(torch.int32).unsqueeze(2) * block_size + offsets).flatten(1)


class SglangDecodeRow:
    """SGLang's ``minimax_sparse_decode`` on the step's decodes, the drop-in's backends configured to this run's."""

    def __init__(self, setup: Setup) -> None:
        from mm3.integrations import sglang, targets

        self.sglang, self.setup = sglang, setup
        name, reg, self.stub = setup.backend()
        targets.configure(Settings(backend=name, check_contracts="first"), registry=reg)
        S, p = setup.stream, setup.params
        self.caches = self._caches(S.num_pages)
        #: each request's row of the pool, and the pool (made once, as SGLang's is)
        self.slot = {r: i for i, r in enumerate(S.rows)}
        self.pool = req_to_token(_i32(list(S.rows.values()), setup.device), p.block_size)
        T = S.max_tokens
        self.q, self.iq = setup.tokens(T, p.num_heads, p.head_dim), setup.tokens(T, p.num_kv_heads,
                                                                               p.index_head_dim)

    def _caches(self, pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache, idx_k_cache)`` token-major over ``pages`` pages, random."""
        p, s = self.setup.params, self.setup
        slots = pages * p.block_size
        kv = s.random(2, slots, p.num_kv_heads, p.head_dim)
        return kv[0], kv[1], s.random(slots, 1, p.index_head_dim)

    def _slots(self, s: StreamStep) -> torch.Tensor:
        """The step's ``slot_ids`` (SGLang's ``req_pool_indices``, the scheduler's tensor: not timed)."""
        reqs = list(s.decodes) + ([s.prefill[0]] if s.prefill else [])
        return _i32([self.slot[r] for r in reqs], self.setup.device).to(torch.int64)

    def _prime_pool(self, bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A first step's pool and slots: its block table's rows, in order."""
        return req_to_token(bt, self.setup.params.block_size), torch.arange(bt.shape[0], device=bt.device)

    def prime(self) -> None:
        if self.stub:
            self.stub.real = True
        s, _, sl, bt = _prime_steps(self.setup.params.block_size, self.setup.device)[0]
        self._decode(sl, *self._prime_pool(bt), max(s.decode_lens), self._caches(8))()
        if self.stub:
            self.stub.real = False

    def _decode(self, sl: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, longest: int,
                caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Call:
        p, fn, n = self.setup.params, self.sglang.minimax_sparse_decode, sl.shape[0]
        q, iq, (k, v, index), B = self.q[:n], self.iq[:n], caches, p.block_size

        def decode() -> None:
            fn(q, None, k, v, iq, None, index, None, pool, slots, sl, longest, 1, B, p.topk, p.init_blocks,
               p.local_blocks, sm_scale=p.softmax_scale, disable_index_value=True, page_size=B)
        return decode

    def prepare(self, s: StreamStep, qsl: torch.Tensor, sl: torch.Tensor, bt: torch.Tensor) -> Call:
        nd = s.num_decodes
        return self._decode(sl[:nd], self.pool, self._slots(s)[:nd], max(s.decode_lens), self.caches)

    def close(self) -> None:
        from mm3.integrations import targets

        targets.configure()


class SglangPrefillRow(SglangDecodeRow):
    """SGLang's ``minimax_sparse_prefill`` on a step with a prefill chunk, the whole step one extend batch."""

    def prime(self) -> None:
        if self.stub:
            self.stub.real = True
        s, qsl, sl, bt = _prime_steps(self.setup.params.block_size, self.setup.device)[1]
        self._extend(s, qsl, sl, *self._prime_pool(bt), self._caches(8))()
        if self.stub:
            self.stub.real = False

    def _extend(self, s: StreamStep, qsl: torch.Tensor, sl: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Call:
        assert s.prefill is not None
        p, fn, T, B = self.setup.params, self.sglang.minimax_sparse_prefill, s.num_tokens, self.setup.params.block_size
        q, iq, (k, v, index) = self.q[:T], self.iq[:T], caches
        prefix = sl - (qsl[1:] - qsl[:-1])        # the engine's extend_prefix_lens (not timed)
        longest = max(*s.decode_lens, s.prefill[1] + s.prefill[2]) if s.decodes else s.prefill[1] + s.prefill[2]

        def extend() -> Any:
            return fn(q, k, v, None, iq, index, None, None, pool, slots, qsl, sl, prefix, s.max_query_len, longest,
                      1, B, p.topk, p.init_blocks, p.local_blocks, sm_scale=p.softmax_scale,
                      disable_index_value=True, page_size=B)
        return extend

    def prepare(self, s: StreamStep, qsl: torch.Tensor, sl: torch.Tensor, bt: torch.Tensor) -> Call:
        if s.prefill is None:
            return lambda: None
        return self._extend(s, qsl, sl, self.pool, self._slots(s), self.caches)
