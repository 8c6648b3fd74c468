"""The bad-input matrix: every rejected input, through the public entry points.

Each :data:`ROWS` entry is one row of the table in docs/errors.md (same id):
an input that is wrong in one way, the public call that receives it, and the
exception type and message fragment the caller gets. A test checks that the
table in the docs and the rows here agree, so neither can drift.

Regenerate the docs' tables (after adding a row) with::

    python tests/test_bad_input_matrix.py > /tmp/rows.md

The second half covers inputs that are *accepted* and must not crash:
NaN/Inf anywhere (NaN scores rank last, docs/spec.md §3), any strides, empty steps.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

if __name__ == "__main__" and not torch.cuda.is_available():  # as tests/conftest.py does for pytest
    os.environ.setdefault("TRITON_INTERPRET", "1")

import mm3_backends.cpu_ref.plugin as cpu_ref
from mm3.plugin import (BackendCapabilities, BatchMetadata, PagedKVCache, Probe, SparseAttentionParams, TopkBuffer,
                        hookimpl)
from mm3.runtime.config import Settings, reset_default_settings
from mm3.contract.contents import FaultFlag
from mm3.contract.errors import (BackendUnavailableError, ConfigError, ContractViolation, InputError, NoBackendError,
                        PluginError, UnknownBackendError)
from mm3.debug import checked_call
from mm3.runtime.layer import SparseAttention
from mm3.runtime.registry import Registry, default_registry
from mm3.runtime.scope import use_backend
from mm3.runtime.selection import requirements_for, select
from mm3.testing.factories import Case, make_case
from mm3.testing.oracle import check_topk, oracle_attention, oracle_topk

DOCS = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
F32 = torch.float32


# -- the shared step -----------------------------------------------------------------------------------

def _params(**kw: Any) -> SparseAttentionParams:
    base: dict[str, Any] = dict(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
                                index_head_dim=16, block_size=16, topk=4)
    base.update(kw)
    return SparseAttentionParams(**base)


@dataclass
class Ctx:
    """A valid step and a layer that accepts it; each row breaks one thing."""

    p: SparseAttentionParams
    case: Case
    layer: SparseAttention

    @property
    def T(self) -> int:
        return self.case.batch.num_tokens

    def forward(self, **override: Any) -> Any:
        c = self.case
        args: dict[str, Any] = dict(q=c.q, index_q=c.index_q, caches=c.caches, batch=c.batch)
        args.update(override)
        return self.layer(**args)

    def caches(self, **override: torch.Tensor) -> PagedKVCache:
        c = self.case.caches
        parts = dict(k=c.k, v=c.v, index=c.index)
        parts.update(override)
        return PagedKVCache(**parts)

    def rebatch(self, **override: Any) -> BatchMetadata:
        b = self.case.batch
        args: dict[str, Any] = dict(query_lens=b.query_lens, seq_lens=b.seq_lens_host,
                                    block_table=b.block_table, block_size=16, num_decodes=b.num_decodes)
        args.update(override)
        return BatchMetadata.build(**args)


@functools.lru_cache(maxsize=None)
def ctx() -> Ctx:
    p = _params()
    case = make_case(p, decodes=[70, 40], prefills=[(9, 30)], padding_decodes=1, dtype=F32,
                     index_dtype=F32, seed=0)
    layer = SparseAttention(p, dtype=F32, index_dtype=F32, max_num_tokens=64, backend="cpu_ref",
                            settings=Settings(check_contracts=False))
    return Ctx(p, case, layer)


def _layer(p: Optional[SparseAttentionParams] = None, **kw: Any) -> SparseAttention:
    kw.setdefault("dtype", F32)
    kw.setdefault("index_dtype", F32)
    kw.setdefault("max_num_tokens", 64)
    kw.setdefault("settings", Settings(check_contracts=False))
    return SparseAttention(p or ctx().p, **kw)


# -- plugins that declare limits (deterministic on any machine) -------------------------------------------

class Declared:
    """A cpu_ref-backed plugin with whatever capabilities and probe answer a row needs."""

    def __init__(self, name: str = "declared", available: bool = True, reason: str = "test plugin",
                 **caps: Any) -> None:
        base: dict[str, Any] = dict(name=name, ops={"index_topk", "attention"}, device_types={"cpu"},
                                    topk_layout="head_major",
                                    index_cache_dtypes={"bfloat16", "float16", "float32", "float8_e4m3fn"})
        base.update(caps)
        self.caps = BackendCapabilities(**base)
        self.available, self.reason = available, reason

    @hookimpl
    def backend_capabilities(self) -> BackendCapabilities:
        return self.caps

    @hookimpl
    def backend_probe(self, device: torch.device) -> Probe:
        return Probe.yes(self.reason) if self.available else Probe.no(self.reason)

    @hookimpl
    def index_topk(self, index_q: Any, caches: Any, batch: Any, params: Any, out: Any) -> None:
        cpu_ref.index_topk(index_q, caches, batch, params, out)

    @hookimpl
    def attention_forward(self, q: Any, caches: Any, topk: Any, batch: Any, params: Any, out: Any) -> None:
        cpu_ref.attention_forward(q, caches, topk, batch, params, out)


class StrictReader(Declared):
    """Reads the top-k buffer through raw dense token-major pointers, so it checks that it got one."""

    @hookimpl
    def attention_forward(self, q: Any, caches: Any, topk: TopkBuffer, batch: Any, params: Any,
                          out: Any) -> None:
        if topk.layout != "token_major" or not topk.is_dense():
            raise InputError(f"{self.caps.name}: needs a dense token_major top-k buffer (it declares "
                             f"topk_requires_contiguous), got {topk!r}; convert with "
                             f"buf.to_layout('token_major')")
        cpu_ref.attention_forward(q, caches, topk, batch, params, out)


def _declared(**caps: Any) -> SparseAttention:
    plugin = Declared(**caps)
    reg = Registry(plugins=[plugin], entry_points=False)
    # named for both roles, so the answer is the named backend's own reasons
    return _layer(backend=plugin.caps.name, indexer_backend=plugin.caps.name, registry=reg)


# -- settings rows run in a clean environment and an empty directory ----------------------------------------

@contextlib.contextmanager
def clean_env(files: Optional[dict[str, str]] = None, **env: str) -> Iterator[Path]:
    old_env, old_cwd = dict(os.environ), os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for k in [k for k in os.environ if k.upper().startswith("MM3_")]:
                del os.environ[k]
            os.environ.update(env)
            os.chdir(tmp)
            for name, text in (files or {}).items():
                Path(tmp, name).write_text(text)
            yield Path(tmp)
        finally:
            os.chdir(old_cwd)
            os.environ.clear()
            os.environ.update(old_env)


def _layer_in_env(files: Optional[dict[str, str]] = None, env: Optional[dict[str, str]] = None) -> Callable[[], Any]:
    """A layer whose settings come from this environment and these files only (no ``settings=`` argument)."""
    def call() -> Any:
        c = ctx()
        with clean_env(files, **(env or {})):
            reset_default_settings()
            try:
                return SparseAttention(c.p, dtype=F32, index_dtype=F32, max_num_tokens=64)
            finally:
                reset_default_settings()
    return call


def _settings(files: Optional[dict[str, str]] = None, env: Optional[dict[str, str]] = None,
              **kw: Any) -> Callable[[], Any]:
    def call() -> Any:
        with clean_env(files, **(env or {})):
            return Settings(**kw)
    return call


# -- the rows --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    id: str
    entry: str
    input: str
    exc: type
    fragment: str
    call: Callable[[], Any]


def _q(**kw: Any) -> Callable[[], Any]:
    return lambda: ctx().forward(**kw)


def _bt(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def _duplicate_registry() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Registry(plugins=[Declared("twin"), Declared("twin")], entry_points=False).get("twin")


def _strict_direct(guarded: bool) -> Callable[[], Any]:
    def call() -> None:
        c = ctx()
        plugin = StrictReader("strict", topk_layout="token_major", topk_requires_contiguous=True)
        be = Registry(plugins=[plugin], entry_points=False).get("strict")
        buf = TopkBuffer.allocate(c.T, 2, 4, "head_major")
        cpu_ref.index_topk(c.case.index_q, c.case.caches, c.case.batch, c.p, buf)
        args = (c.case.q, c.case.caches, buf, c.case.batch, c.p, torch.empty_like(c.case.q))
        if guarded:          # the guard alone, around the very call (the bound backend refuses it first)
            checked_call(be, "attention", args)
        else:
            be.attention_forward(*args)
    return call


def _unusable_device() -> str:
    # A device index past the last GPU (or any GPU on a CPU-only build) cannot be used.
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def _block_ids_outside_cache(mode: str, page: int) -> Callable[[], Any]:
    def call() -> Any:
        c = ctx()
        bt = c.case.batch.block_table.clone()
        bt[3, 1] = page if page < 0 else c.case.caches.num_pages + page    # the prefill's second block
        layer = _layer(backend="cpu_ref", settings=Settings(check_contracts=mode))
        return layer(c.case.q, c.case.index_q, c.case.caches, c.rebatch(block_table=bt))
    return call


def _prefill_first() -> Any:
    """A 9-token prompt placed first and counted as the one decode: it reads as a 9-token decode."""
    c = ctx()
    batch = BatchMetadata.build([9, 1], [9, 40], c.case.batch.block_table[:2], block_size=16, num_decodes=1)
    return c.forward(q=c.case.q[:10], index_q=c.case.index_q[:10], batch=batch)


def _page_id_flag() -> Any:
    c = ctx()
    bt = c.case.batch.block_table.clone()
    bt[3, 1] = -7
    flag = FaultFlag(bt.device)
    flag.record(c.rebatch(block_table=bt), c.case.caches.num_pages)       # on the device, no sync
    flag.raise_pending()


FORWARD = "SparseAttention.forward"
BUILD = "BatchMetadata.build"
LAYER = "SparseAttention(...)"
PARAMS = "SparseAttentionParams(...)"
CACHE = "PagedKVCache(...)"
TOPK = "TopkBuffer"
SETTINGS = "Settings(...)"

ROWS: list[Row] = [
    # q
    Row("q-type", FORWARD, "q is not a tensor", InputError, "q must be a torch.Tensor",
        lambda: ctx().forward(q=ctx().case.q.tolist())),
    Row("q-dtype", FORWARD, "q's dtype is not the layer's", InputError, "q is torch.float16 but this layer",
        lambda: ctx().forward(q=ctx().case.q.half())),
    Row("q-device", FORWARD, "q on another device", InputError, "q is on meta but the layer runs on cpu",
        lambda: ctx().forward(q=ctx().case.q.to("meta"))),
    Row("q-rank", FORWARD, "q is 2-D", InputError, "q has shape (12, 16), expected (12, 4, 16)",
        lambda: ctx().forward(q=ctx().case.q[:, 0])),
    Row("q-heads", FORWARD, "q has the wrong number of heads", InputError, "q has shape (12, 2, 16)",
        lambda: ctx().forward(q=ctx().case.q[:, :2])),
    Row("q-tokens", FORWARD, "q rows != the batch's tokens", InputError, "q has shape (13, 4, 16)",
        lambda: ctx().forward(q=torch.cat([ctx().case.q, ctx().case.q[:1]]))),
    Row("q-head-dim", FORWARD, "q head dim != params.head_dim", InputError, "q has shape (12, 4, 8)",
        lambda: ctx().forward(q=ctx().case.q[..., :8])),
    # index_q
    Row("index_q-type", FORWARD, "index_q is not a tensor", InputError, "index_q must be a torch.Tensor",
        lambda: ctx().forward(index_q=None)),
    Row("index_q-dtype", FORWARD, "index_q's dtype is not the layer's", InputError,
        "index_q is torch.bfloat16 but this layer", lambda: ctx().forward(index_q=ctx().case.index_q.bfloat16())),
    Row("index_q-device", FORWARD, "index_q on another device", InputError, "index_q is on meta",
        lambda: ctx().forward(index_q=ctx().case.index_q.to("meta"))),
    Row("index_q-rank", FORWARD, "index_q is 4-D", InputError, "index_q has shape (12, 2, 16, 1)",
        lambda: ctx().forward(index_q=ctx().case.index_q[..., None])),
    Row("index_q-heads", FORWARD, "index_q heads != num_index_heads", InputError,
        "index_q has shape (12, 1, 16), expected (12, 2, 16)",
        lambda: ctx().forward(index_q=ctx().case.index_q[:, :1])),
    # caches
    Row("caches-type", FORWARD, "caches is a tuple", InputError, "caches must be an mm3.PagedKVCache",
        lambda: ctx().forward(caches=(ctx().case.caches.k, ctx().case.caches.v))),
    Row("kv-rank", CACHE, "k cache is 3-D", InputError, "k cache must be a 4-D tensor",
        lambda: ctx().caches(k=ctx().case.caches.k[:, :, 0])),
    Row("kv-shape-mismatch", CACHE, "k and v shapes differ", InputError, "differ in shape",
        lambda: ctx().caches(v=ctx().case.caches.v[:, :, :1])),
    Row("kv-dtype-mismatch", CACHE, "k and v dtypes differ", InputError, "differ in dtype",
        lambda: ctx().caches(v=ctx().case.caches.v.half())),
    Row("kv-devices", CACHE, "k, v, index on different devices", InputError, "caches live on different devices",
        lambda: ctx().caches(k=ctx().case.caches.k.to("meta"), v=ctx().case.caches.v.to("meta"))),
    Row("index-rank", CACHE, "index cache is 4-D", InputError, "index cache must be a 3-D tensor",
        lambda: ctx().caches(index=ctx().case.caches.index[..., None])),
    Row("index-pages", CACHE, "index cache pages != KV pages", InputError, "index cache pages/block",
        lambda: ctx().caches(index=ctx().case.caches.index[:-1])),
    Row("index-dtype-unsupported", CACHE, "index cache is int32", InputError,
        "index cache dtype torch.int32 unsupported", lambda: ctx().caches(index=ctx().case.caches.index.int())),
    Row("kv-dtype", FORWARD, "KV cache dtype is not the layer's", InputError,
        "k/v cache is torch.float16 but this layer",
        lambda: ctx().forward(caches=ctx().caches(k=ctx().case.caches.k.half(), v=ctx().case.caches.v.half()))),
    Row("index-dtype", FORWARD, "index cache dtype is not the layer's index_dtype", InputError,
        "index cache is torch.bfloat16 but this layer",
        lambda: ctx().forward(caches=ctx().caches(index=ctx().case.caches.index.bfloat16()))),
    Row("caches-device", FORWARD, "caches on another device", InputError, "caches is on meta",
        lambda: ctx().forward(caches=PagedKVCache(*(t.to("meta") for t in (
            ctx().case.caches.k, ctx().case.caches.v, ctx().case.caches.index))))),
    Row("kv-heads", FORWARD, "KV cache heads != num_kv_heads", InputError,
        "SparseAttention.forward: the caches have 1 KV heads, params.num_kv_heads is 2",
        lambda: ctx().forward(caches=ctx().caches(k=ctx().case.caches.k[:, :, :1], v=ctx().case.caches.v[:, :, :1]))),
    Row("kv-head-dim", FORWARD, "KV head dim != head_dim", InputError,
        "SparseAttention.forward: KV cache heads have dim 8, params.head_dim is 16",
        lambda: ctx().forward(caches=ctx().caches(k=ctx().case.caches.k[..., :8], v=ctx().case.caches.v[..., :8]))),
    Row("cache-block-size", FORWARD, "cache pages hold another block size", InputError,
        "SparseAttention.forward: block sizes disagree: cache pages hold 8 tokens",
        lambda: ctx().forward(caches=ctx().caches(k=ctx().case.caches.k[:, :8], v=ctx().case.caches.v[:, :8],
                                                  index=ctx().case.caches.index[:, :8]))),
    Row("index-head-dim", FORWARD, "index key dim != index_head_dim", InputError,
        "SparseAttention.forward: index cache keys have dim 8, params.index_head_dim is 16",
        lambda: ctx().forward(caches=ctx().caches(index=ctx().case.caches.index[..., :8]))),
    Row("kv-layout-unknown", "PagedKVCache.allocate", "unknown page layout", InputError,
        "unknown KV cache layout 'NDH'", lambda: PagedKVCache.allocate(2, 16, 2, 16, 16, layout="NDH")),
    # batch at the layer
    Row("batch-type", FORWARD, "batch is a dict", InputError, "batch must be an mm3.BatchMetadata",
        lambda: ctx().forward(batch={"query_lens": [1]})),
    Row("batch-device", FORWARD, "batch tensors on another device", InputError, "batch is on meta",
        lambda: ctx().forward(batch=ctx().case.batch.to("meta"))),
    Row("batch-block-size", FORWARD, "batch built for another block size", InputError,
        "the batch's block_size is 32, params.block_size is 16",
        lambda: ctx().forward(batch=ctx().rebatch(block_size=32))),
    Row("capacity", FORWARD, "step larger than the top-k buffer (max_num_tokens)", InputError,
        "step has 12 tokens but the top-k buffer holds 8",
        lambda: _layer(backend="cpu_ref", max_num_tokens=8)(ctx().case.q, ctx().case.index_q,
                                                             ctx().case.caches, ctx().case.batch)),
    Row("decode-len-layer", FORWARD, "decode query length > the layer's max_decode_query_len", InputError,
        "decode query length 2 exceeds the layer's max_decode_query_len 1",
        lambda: (lambda c: _layer(backend="cpu_ref")(c.q, c.index_q, c.caches, c.batch))(
            make_case(ctx().p, decodes=[40, 20], decode_query_len=2, dtype=F32, index_dtype=F32))),
    Row("prefill-first-as-decode", FORWARD, "a prefill placed first, counted by num_decodes=1", InputError,
        "if one of them is a prefill, the batch is not decode-first",
        lambda: _prefill_first()),
    Row("block-ids-outside-cache-guarded", FORWARD + " (check_contracts)",
        "block-table entry past the cache, batch built without num_pages", InputError,
        "request 3, block 1: batch.block_table[3, 1] = 18 is not a page id in [0, 13)",
        _block_ids_outside_cache("always", 5)),
    Row("block-id-negative-unguarded", FORWARD + ' (check_contracts="never")',
        "negative block-table entry, batch built without num_pages", InputError,
        "request 3, block 1: batch.block_table[3, 1] = -3 is not a page id", _block_ids_outside_cache("never", -3)),
    Row("block-id-device-flag", "FaultFlag.raise_pending (GPU steps)",
        "a bad entry recorded on the device by an earlier step", InputError,
        "request 3, block 1: batch.block_table[3, 1] is not a page id in [0, 13) (the cache has "
        "13 pages)", _page_id_flag),
    # out
    Row("out-type", FORWARD, "out is not a tensor", InputError, "out must be a torch.Tensor",
        lambda: ctx().forward(out=[0.0])),
    Row("out-rows", FORWARD, "out has fewer rows than the step", InputError, "out has shape (10, 4, 16); needs [>= 12",
        lambda: ctx().forward(out=torch.empty(10, 4, 16))),
    Row("out-shape", FORWARD, "out has the wrong head count", InputError, "out has shape (12, 2, 16)",
        lambda: ctx().forward(out=torch.empty(12, 2, 16))),
    Row("out-dtype", FORWARD, "out dtype != q dtype", InputError, "out is torch.float16 on cpu; needs torch.float32",
        lambda: ctx().forward(out=torch.empty(12, 4, 16, dtype=torch.float16))),
    Row("out-device", FORWARD, "out on another device", InputError, "out is torch.float32 on meta",
        lambda: ctx().forward(out=torch.empty(12, 4, 16, device="meta"))),
    Row("out-overlap", FORWARD, "out's elements share memory (expand)", InputError, "share memory",
        lambda: ctx().forward(out=torch.empty(1, 4, 16).expand(12, 4, 16))),
    # BatchMetadata.build
    Row("lengths-count", BUILD, "query_lens and seq_lens differ in length", InputError,
        "query_lens has 2 requests but seq_lens has 3", lambda: BatchMetadata.build([1, 1], [5, 5, 5], _bt([0], [1]),
                                                                                      block_size=16)),
    Row("query-len-negative", BUILD, "negative query_len", InputError, "request 0 has a negative query length",
        lambda: BatchMetadata.build([-1], [5], _bt([0]), block_size=16)),
    Row("seq-len-negative", BUILD, "negative seq_len", InputError, "request 0 has seq_len -5 < query_len 1",
        lambda: BatchMetadata.build([1], [-5], _bt([0]), block_size=16)),
    Row("seq-len-lt-query-len", BUILD, "seq_len < query_len", InputError, "request 0 has seq_len 3 < query_len 5",
        lambda: BatchMetadata.build([5], [3], _bt([0]), block_size=16)),
    Row("seq-len-overflow", BUILD, "seq_len beyond int32", InputError, "does not fit int32",
        lambda: BatchMetadata.build([1], [2 ** 31], _bt([0]), block_size=16)),
    Row("prefill-empty", BUILD, "a prefill with no tokens", InputError, "request 1 is a prefill without query tokens",
        lambda: BatchMetadata.build([1, 0], [5, 5], _bt([0], [1]), block_size=16, num_decodes=1)),
    Row("not-decode-first", BUILD, "a decode after a prefill", InputError,
        "batch is not decode-first: request 2 is a decode after prefill request 1",
        lambda: BatchMetadata.build([1, 4, 1], [5, 9, 7], _bt([0], [1], [2]), block_size=16,
                                    is_decode=[True, False, True])),
    Row("is-decode-count", BUILD, "is_decode has the wrong length", InputError, "is_decode has 2 entries for 3 requests",
        lambda: BatchMetadata.build([1, 4, 1], [5, 9, 7], _bt([0], [1], [2]), block_size=16,
                                    is_decode=[True, False])),
    Row("num-decodes-disagrees", BUILD, "num_decodes contradicts is_decode", InputError,
        "num_decodes=2 disagrees with is_decode (1 decodes)",
        lambda: BatchMetadata.build([1, 4], [5, 9], _bt([0], [1]), block_size=16, num_decodes=2,
                                    is_decode=[True, False])),
    Row("num-decodes-range", BUILD, "num_decodes > requests", InputError, "num_decodes=5 must be in [0, 2]",
        lambda: BatchMetadata.build([1, 4], [5, 9], _bt([0], [1]), block_size=16, num_decodes=5)),
    Row("prefill-among-decodes", BUILD, "a prefill placed before a decode, with num_decodes", InputError,
        "If request 1 (query_len 9) is a prefill, the batch is not decode-first",
        lambda: BatchMetadata.build([1, 9, 1], [50, 9, 40], _bt([0], [1], [2]), block_size=16, num_decodes=2)),
    Row("decode-lens-non-uniform", BUILD, "decodes of different lengths", InputError,
        "decode query lengths must be uniform", lambda: BatchMetadata.build([1, 2], [5, 9], _bt([0], [1]),
                                                                            block_size=16, num_decodes=2)),
    Row("decode-query-len-disagrees", BUILD, "decode_query_len contradicts the decodes", InputError,
        "decodes have query length 2 but decode_query_len=3",
        lambda: BatchMetadata.build([2, 2], [5, 9], _bt([0], [1]), block_size=16, num_decodes=2,
                                    decode_query_len=3)),
    Row("decode-query-len-zero", BUILD, "decode_query_len < 1", InputError, "decode_query_len must be >= 1",
        lambda: BatchMetadata.build([0], [0], _bt([0]), block_size=16, num_decodes=1, decode_query_len=0)),
    Row("seq-len-past-block-table", BUILD, "seq_len needs more blocks than the table has", InputError,
        "request 0 has seq_len 40, which needs 3 blocks of 16 but the block table has only 2 columns",
        lambda: BatchMetadata.build([1], [40], _bt([0, 1]), block_size=16)),
    Row("block-id-outside-cache", BUILD, "block-table entry >= num_pages", InputError,
        "request 0, block 1: block_table[0, 1] = 4 is not a page id in [0, 4)",
        lambda: BatchMetadata.build([1], [20], _bt([0, 4]), block_size=16, num_pages=4)),
    Row("block-id-negative", BUILD, "negative block-table entry a request uses", InputError,
        "block_table[0, 0] = -2 is not a page id",
        lambda: BatchMetadata.build([1], [20], _bt([-2, 1]), block_size=16, num_pages=4)),
    Row("block-table-float", BUILD, "block table of floats", InputError, "block_table must hold integer page ids",
        lambda: BatchMetadata.build([1], [5], [[0.5]], block_size=16)),
    Row("block-table-rank", BUILD, "block table is 1-D", InputError, "block_table must be [num_requests=1, max_blocks]",
        lambda: BatchMetadata.build([1], [5], torch.zeros(1, dtype=torch.int32), block_size=16)),
    Row("block-table-rows", BUILD, "block table rows != requests", InputError,
        "block_table must be [num_requests=2, max_blocks], got (1, 1)",
        lambda: BatchMetadata.build([1, 1], [5, 5], _bt([0]), block_size=16)),
    Row("block-table-ragged", BUILD, "ragged nested list", InputError, "rectangular nested list",
        lambda: BatchMetadata.build([1, 1], [5, 5], [[0], [1, 2]], block_size=16)),
    Row("block-table-overflow", BUILD, "int64 page id beyond int32", InputError, "does not fit the int32 page ids",
        lambda: BatchMetadata.build([1], [5], torch.tensor([[2 ** 40]]), block_size=16)),
    Row("lengths-float", BUILD, "query_lens as a float tensor", InputError,
        "query_lens must be a 1-D integer tensor or list", lambda: BatchMetadata.build(torch.tensor([1.0]), [5], _bt([0]),
                                                                                       block_size=16)),
    Row("lengths-fractional", BUILD, "a fractional seq_len", InputError,
        "seq_lens[1] is 30.5: lengths count tokens, so they must be ints",
        lambda: BatchMetadata.build([1, 4], [5, 30.5], _bt([0, 1], [2, 3]), block_size=16, num_decodes=1)),
    Row("lengths-not-ints", BUILD, "query_lens not a sequence of ints", InputError,
        "query_lens must be a sequence of ints", lambda: BatchMetadata.build(None, [5], _bt([0]), block_size=16)),
    Row("block-size-invalid", BUILD, "block_size 0", InputError, "block_size must be a positive int, got 0",
        lambda: BatchMetadata.build([1], [5], _bt([0]), block_size=0)),
    Row("update-shape", "BatchMetadata.update_", "replay batch with other shapes than the captured one", InputError,
        "update_: query_start_loc shape (3,) != captured (5,)",
        lambda: ctx().rebatch().update_(make_case(ctx().p, decodes=[70], prefills=[(9, 30)], dtype=F32).batch)),
    # top-k buffers
    Row("topk-dtype", TOPK, "int64 tensor", InputError, "top-k buffer must be int32, got torch.int64",
        lambda: TopkBuffer(torch.zeros(2, 3, 4, dtype=torch.int64))),
    Row("topk-rank", TOPK, "2-D tensor", InputError, "TopkBuffer needs the logical [H, T, K] view",
        lambda: TopkBuffer(torch.zeros(2, 3, dtype=torch.int32))),
    Row("topk-label", TOPK, "a layout label beside the memory", InputError,
        "TopkBuffer takes the logical [H, T, K] view of your memory, and reads the layout from its strides",
        lambda: TopkBuffer(torch.zeros(2, 3, 4, dtype=torch.int32), "head_major")),
    Row("topk-layout", "TopkBuffer.allocate", "unknown layout name", InputError, "unknown top-k layout 'hm'",
        lambda: TopkBuffer.allocate(3, 2, 4, layout="hm")),
    Row("topk-allocate", "TopkBuffer.allocate", "negative size", InputError,
        "num_tokens must be a non-negative int, got -1", lambda: TopkBuffer.allocate(-1, 2, 4)),
    Row("topk-rows", "TopkBuffer.rows", "rows past the capacity", InputError,
        "top-k buffer rows [0, 5) out of range: capacity is 4 tokens", lambda: TopkBuffer.allocate(4, 2, 4).rows(0, 5)),
    Row("topk-copy", "TopkBuffer.copy_", "copy between different shapes", InputError, "cannot copy top-k buffer",
        lambda: TopkBuffer.allocate(4, 2, 4).copy_(TopkBuffer.allocate(4, 1, 4))),
    # params
    Row("index-heads-ne-kv-heads", PARAMS, "num_index_heads != num_kv_heads", InputError,
        "num_index_heads (1) must equal num_kv_heads (2)", lambda: _params(num_index_heads=1)),
    Row("heads-not-multiple", PARAMS, "num_heads not a multiple of num_kv_heads", InputError,
        "num_heads (5) must be a multiple of num_kv_heads (2)", lambda: _params(num_heads=5)),
    Row("params-non-positive", PARAMS, "a size <= 0", InputError, "head_dim: Input should be greater than 0",
        lambda: _params(head_dim=0)),
    Row("params-unknown-field", PARAMS, "misspelled field", InputError,
        "unknown field 'top_k': did you mean 'topk'?",
        lambda: _params(top_k=8)),
    Row("forced-exceed-topk", PARAMS, "init + local blocks > topk", InputError,
        "init_blocks (3) + local_blocks (2) exceed topk (4)", lambda: _params(init_blocks=3, local_blocks=2)),
    Row("params-tp-size", "SparseAttentionParams.minimax_m3", "tensor-parallel size not 1/2/4/8", InputError,
        "MiniMax-M3 runs at tp_size 1, 2, 4 or 8, got 3", lambda: SparseAttentionParams.minimax_m3(tp_size=3)),
    # layer construction
    Row("layer-params-type", LAYER, "params is a dict", InputError, "params must be SparseAttentionParams, got dict",
        lambda: SparseAttention({"num_heads": 4})),  # type: ignore[arg-type]
    Row("max-num-tokens", LAYER, "max_num_tokens 0", InputError, "max_num_tokens must be a positive int, got 0",
        lambda: _layer(backend="cpu_ref", max_num_tokens=0)),
    Row("max-decode-query-len", LAYER, "max_decode_query_len 0", InputError,
        "max_decode_query_len must be an int >= 1", lambda: _layer(backend="cpu_ref", max_decode_query_len=0)),
    Row("device-name", LAYER, "not a device name", InputError, "device 'gpu' is not a torch device",
        lambda: _layer(backend="cpu_ref", device="gpu")),
    Row("device-unusable", LAYER, "a device this process cannot use", InputError, "cannot be used in this process",
        lambda: _layer(backend="cpu_ref", device=_unusable_device())),
    Row("dtype-unsupported", LAYER, "attention dtype float64", InputError,
        "unsupported request: dtype: Input should be 'bfloat16', 'float16' or 'float32' (got 'float64')",
        lambda: _layer(backend="cpu_ref", dtype=torch.float64)),
    Row("index-dtype-unsupported-layer", LAYER, "index dtype int8", InputError,
        "unsupported request: index_cache_dtype", lambda: _layer(backend="cpu_ref", index_dtype=torch.int8)),
    # selection: backends that cannot serve
    Row("unknown-backend", LAYER, "backend name nobody provides", UnknownBackendError,
        "unknown backend 'nope' (backend, from argument); known backends:", lambda: _layer(backend="nope")),
    Row("unknown-backend-env", LAYER, "MM3_BACKEND names a backend nobody provides", UnknownBackendError,
        "unknown backend 'nope' (backend, from env MM3_BACKEND)", _layer_in_env(env={"MM3_BACKEND": "nope"})),
    Row("unknown-backend-file", LAYER, "mm3.toml names a backend nobody provides", UnknownBackendError,
        "unknown backend 'nope' (indexer_backend, from file ",
        _layer_in_env(files={"mm3.toml": 'indexer_backend = "nope"\n'})),
    Row("unknown-backend-typo", LAYER, "misspelled backend name", UnknownBackendError, "did you mean 'cpu_ref'?",
        lambda: _layer(backend="cpu_rf")),
    Row("unknown-indexer-backend", LAYER, "unknown indexer_backend", UnknownBackendError, "unknown backend 'nope'",
        lambda: _layer(backend="cpu_ref", indexer_backend="nope")),
    Row("unknown-backend-scope", "use_backend(...)", "unknown name in a scope", UnknownBackendError,
        "unknown backend 'nope' (from use_backend)", lambda: _scoped_layer("nope")),
    Row("unknown-backend-registry", "Registry.get", "unknown name", UnknownBackendError, "unknown backend 'nope'",
        lambda: default_registry().get("nope")),
    Row("unknown-backend-select", "select(...)", "unknown name", UnknownBackendError, "unknown backend 'nope'",
        lambda: select(requirements_for(ctx().p, F32, F32, "cpu"), default_registry(), backend="nope",
                       device="cpu")),
    Row("topk-too-large", LAYER, "topk above the backend's max_topk", BackendUnavailableError,
        "topk 8 > max_topk 4", lambda: _declared_with(_params(topk=8), max_topk=4)),
    Row("topk-too-large-cuda", LAYER, "topk 128 on the cuda backend (max 64)", BackendUnavailableError,
        "topk 128 > max_topk 64", lambda: _layer(_params(topk=128), backend="cuda")),
    Row("block-size-unserved", LAYER, "block size the cuda backend does not tile", BackendUnavailableError,
        "block_size 8 not in [16, 32, 64, 128, 256]", lambda: _layer(_params(block_size=8), backend="cuda")),
    Row("head-dim-unserved", LAYER, "head dim the cuda backend does not tile", BackendUnavailableError,
        "head_dim 48 not in [16, 32, 64, 128, 256]", lambda: _layer(_params(head_dim=48), backend="cuda")),
    Row("index-head-dim-unserved", LAYER, "index head dim a backend does not serve", BackendUnavailableError,
        "index_head_dim 16 not in [128]", lambda: _declared(index_head_dims={128})),
    Row("gqa-group-unserved", LAYER, "GQA group above max_gqa_group", BackendUnavailableError,
        "GQA group 2 > max_gqa_group 1", lambda: _declared(max_gqa_group=1)),
    Row("decode-len-unserved", LAYER, "speculative decode length above the backend's", BackendUnavailableError,
        "decode query length 17 > max_decode_query_len 16",
        lambda: _layer(backend="cpu_ref", max_decode_query_len=17)),
    Row("dtype-unserved", LAYER, "attention dtype the backend does not declare", BackendUnavailableError,
        "dtype float32 not in ['bfloat16']", lambda: _declared(dtypes={"bfloat16"})),
    Row("index-dtype-unserved", LAYER, "index cache dtype the backend does not declare", BackendUnavailableError,
        "index cache dtype float32 not in ['bfloat16']", lambda: _declared(index_cache_dtypes={"bfloat16"})),
    Row("device-type-unserved", LAYER, "device type the backend does not declare", BackendUnavailableError,
        "device type 'cpu' not in ['cuda']", lambda: _declared(device_types={"cuda"})),
    Row("backend-unavailable", LAYER, "the backend's probe says no", BackendUnavailableError,
        "unavailable on cpu: driver too old", lambda: _declared(available=False, reason="driver too old")),
    Row("op-not-provided", LAYER, "indexer_backend without index_topk", BackendUnavailableError,
        "does not provide op(s) ['index_topk']", lambda: _indexer_without_op()),
    Row("cuda-graph-unsafe", LAYER, "cuda_graph=True on a backend that is not graph safe", BackendUnavailableError,
        "CUDA-graph capture requested but backend is not cuda_graph_safe",
        lambda: _layer(backend="cpu_ref", cuda_graph=True)),
    Row("no-backend", LAYER, "auto finds no capable backend", NoBackendError,
        "no backend can serve the attention op on cpu", lambda: _auto_nothing()),
    Row("duplicate-backend", "Registry.get", "two plugins declare one name", PluginError,
        "backend name 'twin' is declared by more than one plugin", _duplicate_registry),
    Row("op-missing-direct", "Backend.index_topk", "calling an op the backend does not provide",
        BackendUnavailableError, "does not provide 'index_topk'", lambda: _attention_only().index_topk(1, 2, 3, 4, 5)),
    Row("provides-unknown-op", "Backend.provides", "an op name that does not exist", InputError,
        "unknown op 'indexer'", lambda: default_registry().get("cpu_ref").provides("indexer")),
    # contiguity
    Row("topk-not-dense-direct", "Backend.attention_forward", "non-dense / other-layout top-k buffer to a "
        "backend that declares topk_requires_contiguous (direct call)", InputError,
        "needs a dense token_major top-k buffer", _strict_direct(False)),
    Row("topk-not-dense-guarded", "Backend.attention_forward (guarded)", "the same, with the contract guard on",
        ContractViolation, "rule attention.input_layout", _strict_direct(True)),
    # settings
    Row("settings-unknown-key", SETTINGS, "misspelled keyword", ConfigError,
        "unknown setting 'bakend': did you mean 'backend'?", _settings(bakend="cpu_ref")),
    Row("settings-bad-mode", SETTINGS, "check_contracts neither a mode nor a boolean", ConfigError,
        "check_contracts (from argument): Input should be 'first', 'always' or 'never'",
        _settings(check_contracts="maybe")),
    Row("settings-bad-name", SETTINGS, "backend name that is not an identifier", ConfigError,
        "'cu-da' is not a backend name", _settings(backend="cu-da")),
    Row("settings-bad-list", SETTINGS, "plugins not a list of names", ConfigError,
        "plugins (from argument): Input should be a valid list",
        _settings(plugins=3)),
    Row("env-unknown", "Settings() / env", "misspelled MM3_ variable", ConfigError,
        "unknown environment variable MM3_BACKEDN: did you mean MM3_BACKEND?",
        _settings(env={"MM3_BACKEDN": "cpu_ref"})),
    Row("env-bad-value", "Settings() / env", "MM3_ALLOW_FALLBACK=perhaps", ConfigError,
        "allow_fallback (from env MM3_ALLOW_FALLBACK): Input should be a valid boolean", _settings(env={"MM3_ALLOW_FALLBACK": "perhaps"})),
    Row("file-malformed", "Settings() / mm3.toml", "malformed TOML", ConfigError, "malformed TOML in config file",
        _settings(files={"mm3.toml": "backend = \n"})),
    Row("file-unknown-key", "Settings() / mm3.toml", "unknown key", ConfigError,
        "unknown key 'bakend' in file", _settings(files={"mm3.toml": 'bakend = "cpu_ref"\n'})),
    Row("file-bad-value", "Settings() / mm3.toml", "wrongly typed value", ConfigError,
        "mm3.toml): Input should be a valid boolean (got 3.5)",
        _settings(files={"mm3.toml": "allow_fallback = 3.5\n"})),
    Row("pyproject-unknown-key", "Settings() / pyproject.toml", "unknown key in [tool.mm3]", ConfigError,
        "unknown key 'bakend'", _settings(files={"pyproject.toml": '[tool.mm3]\nbakend = "x"\n'})),
    Row("pyproject-not-table", "Settings() / pyproject.toml", "[tool.mm3] is not a table", ConfigError,
        "[tool] and [tool.mm3] must be tables", _settings(files={"pyproject.toml": '[tool]\nmm3 = 3\n'})),
    Row("file-config-key", "Settings() / mm3.toml", "'config' inside a config file", ConfigError,
        "'config' cannot be set inside a config file", _settings(files={"mm3.toml": 'config = "x.toml"\n'})),
    Row("config-missing", "Settings() / MM3_CONFIG", "MM3_CONFIG names a missing file", ConfigError,
        "does not exist or is not a file", _settings(env={"MM3_CONFIG": "/nonexistent/mm3.toml"})),
]


def _declared_with(p: SparseAttentionParams, **caps: Any) -> SparseAttention:
    plugin = Declared(**caps)
    return _layer(p, backend=plugin.caps.name, registry=Registry(plugins=[plugin], entry_points=False))


def _scoped_layer(name: str) -> SparseAttention:
    with use_backend(name):
        return _layer()


def _attention_only() -> Any:
    return Registry(plugins=[Declared("att_only", ops={"attention"})], entry_points=False).get("att_only")


def _indexer_without_op() -> SparseAttention:
    reg = Registry(plugins=[cpu_ref, Declared("att_only", ops={"attention"})], entry_points=False)
    return _layer(backend="cpu_ref", indexer_backend="att_only", registry=reg)


def _auto_nothing() -> SparseAttention:
    reg = Registry(plugins=[Declared("gpu_only", device_types={"cuda"})], entry_points=False)
    return _layer(registry=reg, settings=Settings(check_contracts=False, backend="auto"))


# -- the tests ------------------------------------------------------------------------------------------------

def _raised(row: Row) -> BaseException:
    with pytest.raises(row.exc) as info:
        row.call()
    return info.value


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_rejected(row: Row) -> None:
    e = _raised(row)
    assert type(e) is row.exc or isinstance(e, row.exc)
    assert row.fragment in str(e), f"{row.id}: {str(e)!r} lacks {row.fragment!r}"
    if row.exc is not ValueError:                       # every mm3 rejection is an mm3.MM3Error
        from mm3.contract.errors import MM3Error

        assert isinstance(e, MM3Error)


def test_row_ids_are_unique() -> None:
    ids = [r.id for r in ROWS]
    assert len(ids) == len(set(ids))


def _doc_rows() -> dict[str, tuple[str, str]]:
    """id -> (exception, message and fix) from the tables in docs/errors.md."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"^\| (.*) \| `(\w+)` \| .*\(`([^`]+)`\) \| (.*) \|$", line)
        if m:
            rows[m.group(3)] = (m.group(2), f"{m.group(1)} {m.group(4)}")
    return rows


def test_docs_table_matches_the_rows() -> None:
    doc = _doc_rows()
    ids = {r.id for r in ROWS}
    assert set(doc) == ids, f"only in docs: {sorted(set(doc) - ids)}; only in tests: {sorted(ids - set(doc))}"
    for r in ROWS:
        exc, text = doc[r.id]
        assert exc == r.exc.__name__, f"{r.id}: docs say {exc}, test expects {r.exc.__name__}"
        assert r.fragment in text.replace("\\|", "|"), f"{r.id}: docs {text!r} lack {r.fragment!r}"


def test_every_row_says_how_to_fix_it() -> None:
    """The docs' fix column: the message's own ("...; do this"), or FIXES."""
    silent = [r.id for r in ROWS if r.id not in FIXES and not _message(r)[1].partition("; ")[2]]
    assert not silent, f"add a FIXES entry (or a fix in the message) for {silent}"
    assert set(FIXES) <= {r.id for r in ROWS}, sorted(set(FIXES) - {r.id for r in ROWS})


# -- accepted inputs that must not crash ------------------------------------------------------------------------

BACKENDS = ["cpu_ref", "cuda", "rocm"]


def _backend_layer(name: str, p: SparseAttentionParams, dtype: torch.dtype = F32,
                   guard: bool = True) -> SparseAttention:
    try:
        return SparseAttention(p, dtype=dtype, index_dtype=dtype, max_num_tokens=64, max_decode_query_len=2,
                               backend=name, settings=Settings(check_contracts=guard))
    except BackendUnavailableError as e:
        pytest.skip(f"{name} cannot run here: {e}")


def _with_non_finite(c: Case) -> tuple[Case, dict[str, Any]]:
    """A copy of ``c`` with NaN / +-Inf planted in every input; returns what was planted where."""
    q, iq = c.q.clone(), c.index_q.clone()
    k, v, idx = c.caches.k.clone(), c.caches.v.clone(), c.caches.index.clone()
    bt = c.batch.block_table
    q[3, 1] = float("nan")                                   # one token, one head
    iq[4] = float("nan")                                     # every index head of token 4: all scores NaN
    iq[5, 1, 0] = float("inf")
    idx[int(bt[0, 2]), 3] = float("nan")                     # one index key of request 0
    idx[int(bt[1, 0]), 5] = float("inf")
    idx[int(bt[3, 0]), 7] = -float("inf")
    k[int(bt[0, 1]), 2, 1] = float("nan")                    # one key of KV head 1
    planted = {"q": (3, 1), "k_page": int(bt[0, 1])}
    return Case(c.params, q, iq, PagedKVCache(k, v, idx), c.batch), planted


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # numpy (Triton's interpreter) warns on NaN math
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_inf_inputs_never_crash_and_follow_the_spec(backend: str) -> None:
    """NaN scores rank last; non-finite inputs never crash and never poison other rows."""
    p = _params()
    base = make_case(p, decodes=[70, 40, 90], prefills=[(9, 30), (17, 17)], padding_decodes=1, dtype=F32,
                     index_dtype=F32, seed=5)
    c, planted = _with_non_finite(base)
    layer = _backend_layer(backend, p)                     # the guard is on: its rules hold too
    out = layer(c.q, c.index_q, c.caches, c.batch)
    T = c.batch.num_tokens
    topk = layer.topk_buffer.rows(0, T)
    bad = check_topk(topk, c.index_q, c.caches, c.batch, p)
    assert not bad, "\n".join(map(str, bad[:5]))
    # token 4's index query is NaN: every unforced block scores -1e30, so only the forced local block is
    # certain; the row is still a valid prefix of distinct visible ids (checked above)
    ref = oracle_attention(c.q, c.caches, topk, c.batch, p)
    finite = torch.isfinite(ref)
    assert torch.isfinite(out[finite.nonzero(as_tuple=True)]).all(), "a NaN input poisoned another row"
    err = (out.double() - ref)[finite].abs().max().item()
    assert err < 1e-4, f"rows with finite inputs differ from the oracle by {err:.3g}"
    t, g = planted["q"]
    assert torch.isnan(out[t, g]).all() and torch.isfinite(out[t, g + 1]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_any_strides_are_accepted(backend: str) -> None:
    """No built-in backend needs contiguous q, index_q, caches or out (they index through strides)."""
    p = _params()
    c = make_case(p, decodes=[70, 40], prefills=[(9, 30)], dtype=F32, index_dtype=F32, seed=2)
    ref = oracle_attention(c.q, c.caches, oracle_topk(c.index_q, c.caches, c.batch, p), c.batch, p)

    def scrambled(t: torch.Tensor) -> torch.Tensor:  # last axis outermost in memory
        n = t.dim()
        w = torch.empty([t.shape[-1], *t.shape[:-1]], dtype=t.dtype).permute(*range(1, n), 0)
        return w.copy_(t)

    layer = _backend_layer(backend, p)
    caches = PagedKVCache(scrambled(c.caches.k), scrambled(c.caches.v), scrambled(c.caches.index))
    out = layer(scrambled(c.q), scrambled(c.index_q), caches, c.batch, out=scrambled(torch.empty_like(c.q)))
    assert not out.is_contiguous()
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_steps_are_accepted(backend: str) -> None:
    p = _params()
    layer = _backend_layer(backend, p)
    c = ctx().case
    for batch in (BatchMetadata.build([], [], torch.zeros(0, 1, dtype=torch.int32), block_size=16),
                  BatchMetadata.build([0, 0], [0, 0], torch.zeros(2, 1, dtype=torch.int32), block_size=16,
                                      num_decodes=2)):
        out = layer(c.q[:0], c.index_q[:0], c.caches, batch)
        assert out.shape == (0, 4, 16)


def test_contiguous_backend_gets_a_converted_buffer_through_the_layer() -> None:
    """Where a backend needs a dense buffer in its layout, SparseAttention converts (no error)."""
    c = ctx().case
    plugin = StrictReader("strict", topk_layout="token_major", topk_requires_contiguous=True)
    reg = Registry(plugins=[cpu_ref, plugin], entry_points=False)
    layer = _layer(backend="strict", indexer_backend="cpu_ref", registry=reg,
                   settings=Settings(check_contracts=True))
    out = layer(c.q, c.index_q, c.caches, c.batch)
    ref = oracle_attention(c.q, c.caches, oracle_topk(c.index_q, c.caches, c.batch, ctx().p), c.batch, ctx().p)
    assert (out.double() - ref).abs().max().item() < 1e-5


# -- the docs table -----------------------------------------------------------------------------------------------

# How to fix each rejected input whose message does not end in its fix ("...; do this"). A new row needs one
# or a message that says it (test_every_row_says_how_to_fix_it).
FIXES = {
    "q-type": "pass a tensor", "index_q-type": "pass a tensor", "out-type": "pass a tensor, or no out",
    "q-rank": "q is [num_tokens, num_heads, head_dim]", "q-heads": "q is [num_tokens, num_heads, head_dim]",
    "q-tokens": "q has one row per token of the batch", "q-head-dim": "q is [num_tokens, num_heads, head_dim]",
    "index_q-rank": "index_q is [num_tokens, num_index_heads, index_head_dim]",
    "index_q-heads": "index_q is [num_tokens, num_index_heads, index_head_dim]",
    "kv-rank": "k and v are [num_pages, block_size, Hkv, D]", "kv-shape-mismatch": "give k and v the same shape",
    "kv-dtype-mismatch": "give k and v the same dtype", "kv-devices": "put k, v and index on one device",
    "index-rank": "the index cache is [num_pages, block_size, index_head_dim]",
    "index-pages": "allocate the index cache with the KV caches' pages and block size",
    "kv-heads": "the caches hold params.num_kv_heads heads (per rank under tensor parallelism)",
    "kv-head-dim": "the K/V caches' last axis is params.head_dim",
    "index-head-dim": "the index cache's last axis is params.index_head_dim",
    "batch-type": "build it with BatchMetadata.build(...) or BatchMetadata.from_device(...)",
    "decode-len-layer": "build the layer with max_decode_query_len >= 1 + draft tokens",
    "prefill-first-as-decode": "decodes first, then prefills; num_decodes counts the first requests",
    "block-ids-outside-cache-guarded": "fix the block table; BatchMetadata.build(..., num_pages=) checks it early",
    "block-id-negative-unguarded": "fix the block table; BatchMetadata.build(..., num_pages=) checks it early",
    "block-id-device-flag": "fix the block table: the step that used it gave invalid output",
    "lengths-count": "one query_len and one seq_len per request",
    "query-len-negative": "lengths are >= 0", "seq-len-negative": "lengths are >= 0",
    "seq-len-overflow": "sequences longer than 2**31 - 1 tokens are not supported",
    "is-decode-count": "one flag per request", "num-decodes-disagrees": "give one of the two, or agreeing ones",
    "num-decodes-range": "num_decodes counts the first requests of the batch",
    "prefill-among-decodes": "decodes first, then prefills (is_decode= checks the order); or one decode length",
    "decode-lens-non-uniform": "give every decode the same 1 + draft tokens (or 0: a padding slot)",
    "decode-query-len-disagrees": "drop decode_query_len, or match the decodes",
    "decode-query-len-zero": "1, or 1 + draft tokens",
    "block-id-outside-cache": "every block a request uses must be a page of the cache",
    "block-id-negative": "every block a request uses must be a page of the cache",
    "block-table-float": "pass int32 (or int64) page ids", "block-table-rank": "one row of page ids per request",
    "block-table-rows": "one row of page ids per request",
    "block-table-ragged": "pad the rows to one width (unused entries are never read)",
    "block-table-overflow": "page ids fit int32", "lengths-float": "pass an integer tensor or a list of ints",
    "lengths-fractional": "pass whole token counts", "lengths-not-ints": "pass an integer tensor or a list of ints",
    "block-size-invalid": "the cache's page size, e.g. 128",
    "update-shape": "replay a batch of the captured shape class, or capture a new graph",
    "topk-rank": "wrap a [H, T, K] (head_major) or [T, H, K] (token_major) tensor",
    "topk-allocate": "sizes are non-negative ints", "topk-copy": "copy between buffers of one shape",
    "index-heads-ne-kv-heads": "num_index_heads = num_kv_heads (index head h selects for KV head h)",
    "heads-not-multiple": "num_heads = G x num_kv_heads", "params-non-positive": "sizes are positive ints",
    "params-unknown-field": "spell the field as the message suggests",
    "forced-exceed-topk": "init_blocks + local_blocks <= topk", "params-tp-size": "tp_size 1, 2, 4 or 8",
    "layer-params-type": "pass SparseAttentionParams(...) or SparseAttentionParams.minimax_m3(tp)",
    "max-num-tokens": "the largest step's token count", "max-decode-query-len": "1, or 1 + draft tokens",
    "device-name": "a torch device: \"cpu\", \"cuda\", \"cuda:1\"...",
    "dtype-unsupported": "bfloat16, float16 or float32", "index-dtype-unsupported-layer":
        "bfloat16 or float8_e4m3fn (float16/float32 on the reference backend)",
    **dict.fromkeys(["unknown-backend", "unknown-backend-env", "unknown-backend-file", "unknown-backend-typo",
                     "unknown-indexer-backend", "unknown-backend-scope", "unknown-backend-registry",
                     "unknown-backend-select"],
                    "fix the name where the message says it came from; `mm3 backends` lists the installed ones"),
    **dict.fromkeys(["topk-too-large", "topk-too-large-cuda", "block-size-unserved", "head-dim-unserved",
                     "index-head-dim-unserved", "gqa-group-unserved", "decode-len-unserved", "dtype-unserved",
                     "index-dtype-unserved", "device-type-unserved", "backend-unavailable", "op-not-provided",
                     "cuda-graph-unsafe"],
                    "another backend (auto picks one that can), another shape; or allow_fallback"),
    "no-backend": "install or enable a backend that serves it (`mm3 backends`), or change dtype/shape",
    "topk-not-dense-guarded": "let SparseAttention call it (it converts), or convert: buf.to_layout(...)",
    "settings-unknown-key": "spell the setting as the message suggests",
    "settings-bad-mode": "\"first\", \"always\", \"never\" or a boolean",
    "settings-bad-name": "an installed backend's name (`mm3 backends`) or \"auto\"",
    "settings-bad-list": "a list of names (comma-separated in the environment)",
    "env-bad-value": "1/0, true/false, yes/no, on/off",
    "file-unknown-key": "spell the key as the message suggests", "file-bad-value": "a TOML boolean: true/false",
    "pyproject-unknown-key": "spell the key as the message suggests",
}

SECTIONS = [  # (heading, entry points whose rows it lists)
    ("Building a batch", ("BatchMetadata",)),
    ("Caches, top-k buffers, parameters", ("PagedKVCache", "TopkBuffer", "SparseAttentionParams")),
    ("Building a layer, choosing a backend", ("SparseAttention(", "use_backend", "Registry", "select", "Backend.")),
    ("Calling the layer", ("SparseAttention.forward", "FaultFlag")),
    ("Settings", ("Settings",)),
]
_SHORT = 110


def _message(row: Row) -> tuple[str, str]:
    """The row's exception name and first message line (temporary paths as ``<tmp>``)."""
    try:
        row.call()
        return "-", "(not raised!)"
    except BaseException as e:  # noqa: BLE001 - we print whatever comes
        return type(e).__name__, re.sub(r"/tmp/\S+?(/|\b)", "<tmp>/", str(e).splitlines()[0])


def _cells(row: Row, msg: str) -> tuple[str, str]:
    """(message, fix): the message up to its fix (or past the row's fragment), and the fix."""
    head, _, tail = msg.partition("; ")
    end = msg.find(row.fragment) + len(row.fragment)
    shown = head if end <= len(head) else msg[:end]
    if len(shown) > _SHORT:
        shown = shown[:max(_SHORT, end)] + " …"
    fix = FIXES.get(row.id) or tail
    return shown, fix if len(fix) <= _SHORT else fix[:_SHORT] + " …"


def _section(entry: str) -> str:
    return next(title for title, prefixes in SECTIONS if entry.startswith(prefixes))


def markdown_rows() -> str:
    """The docs' tables, generated from ROWS by running each row."""
    out: dict[str, list[str]] = {title: [] for title, _ in SECTIONS}
    for row in ROWS:
        name, msg = _message(row)
        shown, fix = _cells(row, msg)
        cells = [shown, f"`{name}`", f"{row.input} (`{row.id}`)", fix]
        out[_section(row.entry)].append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines: list[str] = []
    for title, rows in out.items():
        lines += [f"### {title}", "", "| message | error | cause | fix |", "|---|---|---|---|", *rows, ""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    sys.stdout.write(markdown_rows() + "\n")
