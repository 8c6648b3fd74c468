"""What mm3 costs on an engine's traffic: a stream of steps of new shapes, through each entry point.

An engine that batches continuously sends a step of a new shape almost every
step: requests join and finish, so the decode count changes; about one step in
four carries a prefill chunk of its own size. :func:`engine_stream` makes such
a stream (seeded): each step 1-48 decodes with ``seq_lens`` of 200-3,000
tokens (each a request that persists across steps, one token longer each step)
plus, on about one step in four, a prefill chunk of up to 512 tokens after some
cached context. Each step's int32 ``query_start_loc``, ``seq_lens`` and
``block_table`` are slices of persistent buffers refilled per step, as an
engine's are.

:func:`measure_stream` replays the stream through each entry point (a row):

* ``layer``: ``mm3.SparseAttention`` on a fresh ``BatchMetadata.from_device`` batch per step;
* ``ops``: ``torch.ops.mm3.index_topk`` + ``torch.ops.mm3.attention``, called eagerly with
  ``mm3.runtime.ops.batch_args`` of that batch;
* ``ops, no-op kernels (the dispatcher's floor)``: the same calls on ops of the same schemas whose kernels
  return at once (no mm3 code): what PyTorch's dispatcher alone costs the ``ops`` row;
* ``step op (a compiled layer's)``: ``torch.ops.mm3.sparse_attention``, the two in one call, as a compiled
  ``SparseAttention`` calls it;
* ``vllm decode``: ``minimax_m3_index_decode`` + ``minimax_m3_sparse_attn_decode`` on the step's
  decodes (the drop-in builds its batch itself, so its time includes that);
* ``sglang decode``: SGLang's ``minimax_sparse_decode`` on the step's decodes, addressed through a
  ``req_to_token`` pool and the step's ``slot_ids`` (:class:`SglangDecodeRow`; it builds
  its block table and batch itself, and checks on the device that each block is one page);
* ``tp rank``: rank 0 of ``TensorParallelSparseAttention`` at TP8, built without a process group
  (a rank's step needs none: only ``gather`` communicates);
* ``layer, no check_contents hook`` (``--stub``, a checkout with the hook): the layer on a stub
  without ``check_contents``, so mm3 judges each batch's contents with its own torch ops.

The measures of each row:

* ``host reads / step``: host reads of tensor values (:class:`~.host_reads.CountHostReads`; on a
  GPU, the syncs CUDA reports), per step, on the first pass over the stream (each shape class
  new to the row where it first comes) and on a second pass over the same stream (every class seen);
  ``steps with host reads, pass 1``: how many steps of the first pass read at all;
* ``host us / step``: mm3's own host time of the row's call, the mean over the stream's steps
  (the new-shape steps are the point) of each step's fastest run: pass 1 over 5 runs, each on
  fresh objects (a fresh registry, layer or drop-in choice, and mm3's memo of admitted shape
  classes emptied), pass 2 over 2 passes after each of those; building the step's inputs
  (the engine's work, and ``from_device`` but for the drop-in, which builds its batch itself)
  is not timed;
* ``torch ops / step``: the torch ops the call dispatches, views included (on a GPU, most of the
  others are launches besides the backend's kernels).

And once: ``from_device``'s host time and torch ops per step. Before a row's stream, it runs one
small step of each batch kind on the stream's caches (``check_contracts="first"`` guards the
first call of each op and kind, and the guard reads what it checks, by design), as an engine's
warm-up and graph captures run steps on its caches before it serves: the stream then measures
steady running of new shapes. What a target's first step on new caches or dtypes costs (its plan:
every rule, once) is :mod:`~mm3_benchmarks.first_step_cost`'s measure, not the stream's.

With ``stub=True`` (on the CPU, the stand-in for a GPU) the backend is :class:`StreamStub`: it
declares ``reports_bad_page_ids`` (as the Triton backends do), computes through cpu_ref on those
first steps so the guard passes, and returns at once after; the block tables are treated as
device memory (``mm3.runtime.step.on_host`` patched to False: a host table is checked on the host
every step, by design). Without it: the ``cuda`` backend on a GPU, the device synchronised before
each step, syncs counted by ``torch.cuda.set_sync_debug_mode("warn")``; Triton compiles a kernel
once per process, so the compiles of the first fresh run fall out of the per-step minimum.
"""

from __future__ import annotations

import contextlib
import gc
import random
import sys
import time
import warnings
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, Callable, Iterator, Optional, Protocol

import torch

import mm3
from mm3.plugin import BackendCapabilities, hookimpl
from mm3.runtime.config import Settings
from mm3.runtime.registry import Registry

from mm3_benchmarks.host_reads import CountHostReads, CountOps

__all__ = ["StreamStep", "EngineStream", "engine_stream", "EngineBuffers", "StreamStub", "treat_tables_as_device",
           "measure_stream", "ROWS", "SglangDecodeRow", "SglangPrefillRow", "req_to_token"]

Call = Callable[[], object]


class Unavailable(Exception):
    """This checkout lacks a row's entry point (an older ref): the row's measures are n/a."""


# -- the stream -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class StreamStep:
    """One step: its decodes (request ids in batch order, their ``seq_lens`` with this step's token)
    and at most one prefill chunk ``(request id, query tokens, cached context)``."""

    decodes: tuple[int, ...]
    decode_lens: tuple[int, ...]
    prefill: Optional[tuple[int, int, int]]

    @property
    def num_decodes(self) -> int:
        return len(self.decodes)

    @property
    def num_tokens(self) -> int:
        return self.num_decodes + (self.prefill[1] if self.prefill else 0)

    @property
    def max_query_len(self) -> int:
        return self.prefill[1] if self.prefill else 1

    @property
    def shape(self) -> tuple[int, int, int]:
        """What makes two steps of a layer the same shape class: requests, decodes, tokens."""
        return (self.num_decodes + (self.prefill is not None), self.num_decodes, self.num_tokens)

    @property
    def kind(self) -> str:
        return "mixed" if self.prefill else "decode"


@dataclass(frozen=True)
class EngineStream:
    """The steps, and each request's block-table row (``max_blocks`` page ids below ``num_pages``)."""

    steps: tuple[StreamStep, ...]
    rows: dict[int, tuple[int, ...]]
    block_size: int
    max_blocks: int
    num_pages: int

    @property
    def max_requests(self) -> int:
        return max(s.shape[0] for s in self.steps)

    @property
    def max_tokens(self) -> int:
        return max(s.num_tokens for s in self.steps)

    @property
    def max_decode_tokens(self) -> int:
        return max(s.num_decodes for s in self.steps)

    def new_shapes(self) -> int:
        """Steps whose shape (:attr:`StreamStep.shape`) no earlier step had."""
        return len({s.shape for s in self.steps})


def engine_stream(steps: int, *, seed: int = 0, block_size: int = 128, max_decodes: int = 48,
                  decode_lens: tuple[int, int] = (200, 3000), max_prefill: int = 512, max_context: int = 2048,
                  prefill_every: int = 4, num_pages: int = 256) -> EngineStream:
    """A seeded stream of ``steps`` steps, as an engine batching continuously sends them.

    The decode count walks by 1-3 each step within ``[1, max_decodes]`` (finished requests leave,
    new ones join with a length in ``decode_lens``), and now and then one request finishes as
    another joins; every running request is one token longer each step. About one step in
    ``prefill_every`` adds a prefill chunk of 1 to ``max_prefill`` tokens after 0 to
    ``max_context`` cached ones. Page ids are random (shared pages are what prefix caching does),
    so the caches stay small.

    Example:
        >>> s = engine_stream(20, seed=1)
        >>> all(1 <= st.num_decodes <= 48 for st in s.steps), s.new_shapes() > 10
        (True, True)
    """
    rnd = random.Random(seed)
    lens: dict[int, int] = {}
    order: list[int] = []
    ids = iter(range(10 ** 9))

    def join() -> None:
        r = next(ids)
        lens[r] = rnd.randint(*decode_lens) - 1    # one token longer at the step below
        order.append(r)

    def finish() -> None:
        order.remove(order[rnd.randrange(len(order))])

    for _ in range(rnd.randint(1, max_decodes)):
        join()
    out: list[StreamStep] = []
    longest = 0
    for _ in range(steps):
        target = min(max(len(order) + rnd.choice((-3, -2, -1, 1, 2, 3)), 1), max_decodes)
        while len(order) > target:
            finish()
        while len(order) < target:
            join()
        if rnd.random() < 0.3:     # one finishes as another joins: the same count, other requests
            finish()
            join()
        for r in order:
            lens[r] += 1
        prefill = None
        if rnd.random() < 1 / prefill_every:
            prefill = (next(ids), rnd.randint(1, max_prefill), rnd.randint(0, max_context))
            longest = max(longest, prefill[1] + prefill[2])
        out.append(StreamStep(tuple(order), tuple(lens[r] for r in order), prefill))
        longest = max(longest, *out[-1].decode_lens)
    width = -(-longest // block_size)
    used = {r for s in out for r in s.decodes} | {s.prefill[0] for s in out if s.prefill}
    rows = {r: tuple(rnd.randrange(num_pages) for _ in range(width)) for r in sorted(used)}
    return EngineStream(tuple(out), rows, block_size, width, num_pages)


def _i32(values: list[Any], device: Optional[torch.device] = None) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


class EngineBuffers:
    """An engine's persistent int32 metadata buffers on ``device``; :meth:`load` refills them for a step
    and returns the step's slices ``(query_start_loc, seq_lens, block_table)`` (new views each step)."""

    def __init__(self, stream: EngineStream, device: torch.device) -> None:
        R, W = stream.max_requests, stream.max_blocks
        self.qsl, self.sl, self.bt = (torch.zeros(shape, dtype=torch.int32, device=device)
                                      for shape in ((R + 1,), (R,), (R, W)))
        # each step's contents, made once (the scheduler's work, not timed)
        self._steps = [self._host(stream, s) for s in stream.steps]

    @staticmethod
    def _host(stream: EngineStream, s: StreamStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qlens = [1] * s.num_decodes + ([s.prefill[1]] if s.prefill else [])
        seq = list(s.decode_lens) + ([s.prefill[1] + s.prefill[2]] if s.prefill else [])
        reqs = list(s.decodes) + ([s.prefill[0]] if s.prefill else [])
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        return _i32(starts), _i32(seq), _i32([stream.rows[r] for r in reqs])

    def load(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qsl, sl, bt = self._steps[i]
        R = sl.shape[0]
        self.qsl[:R + 1].copy_(qsl)
        self.sl[:R].copy_(sl)
        self.bt[:R].copy_(bt)
        return self.qsl[:R + 1], self.sl[:R], self.bt[:R]


# -- the stub backend -----------------------------------------------------------------------------

#: whether this checkout's hook specifications have ``check_contents`` (a batch's contents judged by
#: the backend in one launch); an older one rejects a plugin that implements it
CONTENTS_HOOK = hasattr(import_module("mm3.contract.hookspecs"), "check_contents")
#: the stub reads token slots too, where this checkout has them (SGLang's page_size=1 row)
ADDRESSINGS: dict[str, Any] = ({"addressings": {"pages", "slots"}} if "addressings" in BackendCapabilities.model_fields
                               else {})
#: whether this checkout's backends may judge the contents in index_topk (``judges_contents``), as the Triton
#: plugins then do: the stub with a check_contents hook declares it too
JUDGES = "judges_contents" in BackendCapabilities.model_fields


class StreamStub:
    """A backend whose hooks compute (through cpu_ref) only while :attr:`real`, then return at once.

    Declares ``reports_bad_page_ids`` and, where this checkout has the hook, implements
    ``check_contents`` (returning at once, where a Triton backend makes its one launch) and declares
    ``judges_contents`` where the checkout has it (its ``index_topk`` judges a batch handed the word),
    as the production Triton backends do: page ids and contents are its kernels' job. The guarded first
    steps run with ``real`` set, so the guard passes. ``contents_hook=False``: no ``check_contents``,
    so mm3 judges the contents itself (what a backend without the hook gets).
    """

    real = True

    def __init__(self, contents_hook: bool = True) -> None:
        from mm3_backends.cpu_ref import plugin as cpu_ref

        self._ref = cpu_ref
        self.judges = JUDGES and contents_hook
        #: hook calls so far, by hook name (a test's proof that each step reached the backend)
        self.calls: dict[str, int] = {"index_topk": 0, "attention_forward": 0, "check_contents": 0}
        if not contents_hook:
            self.check_contents = None  # type: ignore[method-assign,assignment]  # pluggy registers no non-routine

    if CONTENTS_HOOK:
        @hookimpl
        def check_contents(self, batch: Any, num_pages: int, word: torch.Tensor) -> None:
            self.calls["check_contents"] += 1

    @hookimpl
    def backend_capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(name="stub", ops={"index_topk", "attention"}, device_types={"cpu"},
                                   topk_layout="head_major", max_decode_query_len=8,
                                   kv_cache_dtypes={"bfloat16", "float16", "float32"},
                                   index_cache_dtypes={"bfloat16", "float16", "float32"}, reports_bad_page_ids=True,
                                   **ADDRESSINGS, **({"judges_contents": True} if self.judges else {}))

    @hookimpl
    def index_topk(self, index_q: torch.Tensor, caches: Any, batch: Any, params: Any, out: Any,
                   page_faults: Optional[torch.Tensor] = None) -> None:
        # the hook spec's arguments in its order, as the Triton plugins take them (a reporting indexer
        # gets the fault word): mm3 then calls it directly, with no adapter picking arguments
        self.calls["index_topk"] += 1
        if self.real:
            self._ref.index_topk(index_q=index_q, caches=caches, batch=batch, params=params, out=out)

    @hookimpl
    def attention_forward(self, q: torch.Tensor, caches: Any, topk: Any, batch: Any, params: Any,
                          out: torch.Tensor) -> None:
        self.calls["attention_forward"] += 1
        if self.real:
            self._ref.attention_forward(q=q, caches=caches, topk=topk, batch=batch, params=params, out=out)


@contextlib.contextmanager
def treat_tables_as_device() -> Iterator[Optional[str]]:
    """Within: CPU block tables stand in for device ones (``mm3.runtime.step.on_host`` returns False, and
    so does the SGLang drop-in's own switch for its pages, where this checkout has it). Yields a note when
    this checkout has no such function (its CPU tables then count as host ones)."""
    from mm3.runtime import step

    real = getattr(step, "on_host", None)
    if real is None:
        yield "no mm3.runtime.step.on_host in this checkout: its CPU block tables count as host memory"
        return
    try:
        si: Any = import_module("mm3.integrations.sglang_inputs")
    except ImportError:
        si = None
    pages = getattr(si, "on_host", None)
    step.on_host = lambda batch: False  # type: ignore[attr-defined]
    if pages is not None:
        si.on_host = lambda t: False
    try:
        yield None
    finally:
        step.on_host = real  # type: ignore[attr-defined]
        if pages is not None:
            si.on_host = pages


# -- the rows -------------------------------------------------------------------------------------

@dataclass
class Setup:
    """What every row of one run shares: params, device, dtype, the stream and the backend to bind."""

    params: mm3.SparseAttentionParams
    stream: EngineStream
    device: torch.device
    #: ``"stub"`` (:class:`StreamStub`), or a plugin of ``mm3_backends`` by name (``"cuda"``, ``"cpu_ref"``)
    backend_name: str = "stub"
    #: the full model's params and the TP size of the ``tp rank`` row (its rank 0 has ``params``)
    full: Optional[mm3.SparseAttentionParams] = None
    world: int = 8
    dtype: torch.dtype = torch.bfloat16
    _random: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, repr=False)

    def backend(self, contents_hook: bool = True) -> tuple[str, Registry, Optional[StreamStub]]:
        """A fresh registry (fresh bound backends) and its backend's name; mm3's memo of admitted shape
        classes is emptied too (where this checkout has one), so nothing of an earlier run is remembered."""
        from mm3.runtime import step

        getattr(step, "forget", lambda: None)()
        if self.backend_name == "stub":
            stub = StreamStub(contents_hook)
            return "stub", Registry([stub], entry_points=False), stub
        plugin = import_module(f"mm3_backends.{self.backend_name}.plugin")
        return self.backend_name, Registry([plugin], entry_points=False), None

    def random(self, *shape: int) -> torch.Tensor:
        """A random tensor of ``shape`` in the run's dtype, made once per shape: cache contents are no part
        of mm3's state, and filling them costs more than a run (rows that need the same shape share it)."""
        t = self._random.get(shape)
        if t is None:
            t = self._random[shape] = torch.randn(shape, dtype=self.dtype, device=self.device)
        return t

    def caches(self, num_pages: int) -> mm3.PagedKVCache:
        """Paged caches of ``num_pages`` pages (NHD), random."""
        p = self.params
        kv = self.random(2, num_pages, p.block_size, p.num_kv_heads, p.head_dim)
        return mm3.PagedKVCache(kv[0], kv[1], self.random(num_pages, p.block_size, p.index_head_dim))

    def tokens(self, n: int, heads: int, dim: int) -> torch.Tensor:
        return torch.randn(n, heads, dim, dtype=self.dtype, device=self.device)


class Row(Protocol):
    """An entry point fed the stream: :meth:`prime` runs its first step of each batch kind;
    :meth:`prepare` builds step ``i``'s inputs from the engine's tensors and returns the call to time."""

    def prime(self) -> None: ...

    def prepare(self, s: StreamStep, qsl: torch.Tensor, sl: torch.Tensor, bt: torch.Tensor) -> Call: ...


def _batch(s: StreamStep, qsl: torch.Tensor, sl: torch.Tensor, bt: torch.Tensor, block_size: int) -> Any:
    if not hasattr(mm3.BatchMetadata, "from_device"):
        raise Unavailable("no BatchMetadata.from_device in this checkout")
    return mm3.BatchMetadata.from_device(qsl, sl, bt, num_decodes=s.num_decodes, num_tokens=s.num_tokens,
                                         max_query_len=s.max_query_len, block_size=block_size)


def _prime_steps(block_size: int, device: torch.device) -> list[tuple[StreamStep, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor]]:
    """The first step of each batch kind, ``(step, query_start_loc, seq_lens, block_table)``: a decode,
    then the same decode and a chunk after some context; a 4-wide table (no stream step's shape)."""
    B, n, ctx = block_size, 5, block_size + 1
    decode, mixed = StreamStep((0,), (2 * B + 3,), None), StreamStep((0,), (2 * B + 3,), (1, n, ctx))
    bt = _i32([[3, 1, 4, 0], [5, 2, 6, 7]], device)
    return [(decode, _i32([0, 1], device), _i32([2 * B + 3], device), bt[:1]),
            (mixed, _i32([0, 1, 1 + n], device), _i32([2 * B + 3, n + ctx], device), bt)]


class LayerRow:
    """``layer(q, index_q, caches, batch, out)`` (``tp``: through rank 0 of a TP8 layer)."""

    def __init__(self, setup: Setup, tp: bool = False, contents_hook: bool = True) -> None:
        name, reg, self.stub = setup.backend(contents_hook)
        p, S = setup.params, setup.stream
        kw: dict[str, Any] = dict(device=setup.device, dtype=setup.dtype, index_dtype=setup.dtype,
                                  max_num_tokens=S.max_tokens, backend=name, registry=reg,
                                  settings=Settings(check_contracts="first"))
        if tp:
            from mm3.runtime.distributed import TensorParallelSparseAttention

            if setup.full is None:
                raise Unavailable("no full-model params to shard")
            self.layer: Any = TensorParallelSparseAttention(setup.full, rank=0, world_size=setup.world, **kw)
            assert self.layer.params == p, (self.layer.params, p)
        else:
            self.layer = mm3.SparseAttention(p, **kw)
        self.setup, self.caches = setup, setup.caches(S.num_pages)
        T = S.max_tokens
        self.q, self.iq = setup.tokens(T, p.num_heads, p.head_dim), setup.tokens(T, p.num_index_heads,
                                                                               p.index_head_dim)
        self.out = torch.empty_like(self.q)

    def prime(self) -> None:
        if self.stub:
            self.stub.real = True
        for s, qsl, sl, bt in _prime_steps(self.setup.params.block_size, self.setup.device):
            self._call(s, _batch(s, qsl, sl, bt, self.setup.params.block_size), self.caches)()
        if self.stub:
            self.stub.real = False

    def _call(self, s: StreamStep, b: Any, caches: mm3.PagedKVCache) -> Call:
        T, layer = s.num_tokens, self.layer
        q, iq, out = self.q[:T], self.iq[:T], self.out[:T]
        return lambda: layer(q, iq, caches, b, out)

    def prepare(self, s: StreamStep, qsl: torch.Tensor, sl: torch.Tensor, bt: torch.Tensor) -> Call:
        return self._call(s, _batch(s, qsl, sl, bt, self.setup.params.block_size), self.caches)


class OpsRow(LayerRow):
    """``torch.ops.mm3.index_topk`` + ``torch.ops.mm3.attention`` on the layer's handle and top-k storage."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        if not hasattr(self.layer, "op_target"):
            raise Unavailable("the layer has no op_target (no custom ops)")

    def _call(self, s: StreamStep, b: Any, caches: mm3.PagedKVCache) -> Call:
        from mm3.runtime.ops import batch_args

        T = s.num_tokens
        return self._ops(self.q[:T], self.iq[:T], self.out[:T], caches, batch_args(b), self.layer.op_target.handle,
                         self.layer.topk_buffer.storage)

    def _ops(self, q: torch.Tensor, iq: torch.Tensor, out: torch.Tensor, c: mm3.PagedKVCache, args: Any, h: int,
             st: torch.Tensor) -> Call:
        """The row's op calls of one step, on the step's tensors and flattened batch."""
        def ops() -> None:
            torch.ops.mm3.index_topk(iq, c.k, c.v, c.index, st, *args, h)
            torch.ops.mm3.attention(q, c.k, c.v, c.index, st, *args, h, out)
        return ops


class StepOpRow(OpsRow):
    """``torch.ops.mm3.sparse_attention`` on the layer's handle and top-k storage: what a compiled layer calls."""

    def __init__(self, setup: Setup) -> None:
        if not hasattr(torch.ops.mm3, "sparse_attention"):
            raise Unavailable("no torch.ops.mm3.sparse_attention in this checkout")
        super().__init__(setup)

    def _ops(self, q: torch.Tensor, iq: torch.Tensor, out: torch.Tensor, c: mm3.PagedKVCache, args: Any, h: int,
             st: torch.Tensor) -> Call:
        return lambda: torch.ops.mm3.sparse_attention(q, iq, c.k, c.v, c.index, st, *args, h, out)


_FLOOR: dict[str, Any] = {}


def _floor_ops() -> tuple[Any, Any]:
    """``torch.ops.mm3_floor.index_topk`` / ``.attention``: ops of this checkout's ``torch.ops.mm3`` schemas whose
    kernels return at once (registered once per process): what PyTorch's dispatcher alone costs per call."""
    if not _FLOOR:
        lib = torch.library.Library("mm3_floor", "DEF")
        for name in ("index_topk", "attention"):
            lib.define(str(getattr(torch.ops.mm3, name).default._schema).split("::", 1)[1])
            lib.impl(name, lambda *args, **kwargs: None, "CompositeExplicitAutograd")
        _FLOOR["lib"] = lib
    return torch.ops.mm3_floor.index_topk, torch.ops.mm3_floor.attention


class OpsFloorRow(OpsRow):
    """The ops row's calls, same arguments, on ops of the same schemas whose kernels return at once: the
    floor the dispatcher sets under the custom ops (no mm3 code runs)."""

    def _ops(self, q: torch.Tensor, iq: torch.Tensor, out: torch.Tensor, c: mm3.PagedKVCache, args: Any, h: int,
             st: torch.Tensor) -> Call:
        index_topk, attention = _floor_ops()

        def ops() -> None:
            index_topk(iq, c.k, c.v, c.index, st, *args, h)
            attention(q, c.k, c.v, c.index, st, *args, h, out)
        return ops


def _forget_kept() -> None:
    """Empty the drop-in's small constants kept per request count, so a fresh run makes them anew, as a
    new process would (a checkout without them has nothing to empty)."""
    try:
        getattr(import_module("mm3.integrations.vllm_inputs"), "_KEPT", {}).clear()
    except ImportError:
        pass


class VllmDecodeRow:
    """vLLM's decode pair on the step's decodes, the drop-in's backends configured to this run's."""

    def __init__(self, setup: Setup) -> None:
        from mm3.integrations import targets, vllm

        self.vllm, self.setup = vllm, setup
        name, reg, self.stub = setup.backend()
        _forget_kept()
        targets.configure(Settings(backend=name, check_contracts="first"), registry=reg)
        self.kv, self.index = self._caches(setup.stream.num_pages)
        p, T = setup.params, setup.stream.max_decode_tokens
        self.q, self.iq = setup.tokens(T, p.num_heads, p.head_dim), setup.tokens(T, p.num_kv_heads,
                                                                               p.index_head_dim)
        self.out = torch.empty_like(self.q)
        # token-major storage seen through the head-major view vLLM passes
        self.topk = torch.empty(T, p.num_kv_heads, p.topk, dtype=torch.int32, device=setup.device).permute(1, 0, 2)

    def _caches(self, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's combined K/V cache ``[pages, Hkv, B, 2D]`` and its index cache ``[pages, B, Di]``, random."""
        p, s = self.setup.params, self.setup
        return (s.random(pages, p.num_kv_heads, p.block_size, 2 * p.head_dim),
                s.random(pages, p.block_size, p.index_head_dim))

    def prime(self) -> None:
        kv, index = self.kv, self.index
        if self.stub:
            self.stub.real = True
        s, _, sl, bt = _prime_steps(self.setup.params.block_size, self.setup.device)[0]
        self._call(s, sl, bt, kv, index)()
        if self.stub:
            self.stub.real = False

    def _call(self, s: StreamStep, sl: torch.Tensor, bt: torch.Tensor, kv: torch.Tensor, index: torch.Tensor) -> Call:
        p, v, nd = self.setup.params, self.vllm, s.num_decodes
        q, iq, out, topk = self.q[:nd], self.iq[:nd], self.out[:nd], self.topk[:, :nd]
        sl, bt, longest, H = sl[:nd], bt[:nd], max(s.decode_lens), p.num_kv_heads

        def pair() -> None:
            v.minimax_m3_index_decode(iq, index, bt, sl, longest, p.topk, p.init_blocks, p.local_blocks, H, 1, 1,
                                      out=topk)
            v.minimax_m3_sparse_attn_decode(q, kv, topk, bt, sl, H, p.softmax_scale, out, 1)
        return pair

    def prepare(self, s: StreamStep, qsl: torch.Tensor, sl: torch.Tensor, bt: torch.Tensor) -> Call:
        return self._call(s, sl, bt, self.kv, self.index)

    def close(self) -> None:
        from mm3.integrations import targets

        targets.configure()


class VllmPrefillRow(VllmDecodeRow):
    """vLLM's prefill functions on the step's prefill chunk (``minimax_m3_index_score`` ->
    ``minimax_m3_index_topk`` -> ``minimax_m3_sparse_attn``); a step without one calls nothing. Not a
    row of the benchmark (a chunk comes on one step in four): tests run it."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        p, T = setup.params, setup.stream.max_tokens
        self.q, self.iq = setup.tokens(T, p.num_heads, p.head_dim), setup.tokens(T, p.num_kv_heads,
                                                                               p.index_head_dim)
        self.out = torch.empty_like(self.q)
        self.topk = torch.empty(T, p.num_kv_heads, p.topk, dtype=torch.int32, device=setup.device).permute(1, 0, 2)

    def prime(self) -> None:
        kv, index = self.kv, self.index
        if self.stub:
            self.stub.real = True
        s, _, sl, bt = _prime_steps(self.setup.params.block_size, self.setup.device)[1]
        self._prefill(s, sl[1:], bt[1:], kv, index)()
        if self.stub:
            self.stub.real = False

    def _prefill(self, s: StreamStep, sl: torch.Tensor, bt: torch.Tensor, kv: torch.Tensor,
                 index: torch.Tensor) -> Call:
        """The chunk of ``s`` (whose decodes are skipped), ``sl`` and ``bt`` its rows; the rebased query
        starts and the prefix lengths are the engine's tensors, made here."""
        assert s.prefill is not None
        p, v, (_, n, ctx) = self.setup.params, self.vllm, s.prefill
        cu, prefix = _i32([0, n], self.setup.device), _i32([ctx], self.setup.device)
        q, iq, out, topk, H = self.q[:n], self.iq[:n], self.out[:n], self.topk[:, :n], p.num_kv_heads

        def chunk() -> None:
            scores = v.minimax_m3_index_score(iq, index, bt, cu, sl, prefix, n, n + ctx, H)
            v.minimax_m3_index_topk(scores, cu, prefix, n, p.topk, p.init_blocks, p.local_blocks, out=topk,
                                    block_size=p.block_size)
            v.minimax_m3_sparse_attn(q, kv, topk, bt, cu, sl, prefix, n, H, p.softmax_scale, out)
        return chunk

    def prepare(self, s: StreamStep, qsl: torch.Tensor, sl: torch.Tensor, bt: torch.Tensor) -> Call:
        if s.prefill is None:
            return lambda: None
        nd = s.num_decodes
        return self._prefill(s, sl[nd:], bt[nd:], self.kv, self.index)


# -- SGLang's entry points ----------------------------------------------------------------------------
# SGLang addresses a request's tokens through its persistent req_to_token pool ([max_reqs, max_context], a
# token slot per position) and a step's slot_ids (req_pool_indices); with --page-size equal to the block size
# every block is one aligned page of contiguous slots. K/V are token-major [slots, Hkv, D], the index keys
# [slots, 1, Di].

def req_to_token(pages: torch.Tensor, block_size: int) -> torch.Tensor:
    """The ``req_to_token`` rows of requests whose blocks are ``pages`` (``[R, W]`` page ids): position ``j``
    of row ``r`` is slot ``block_size * pages[r, j // block_size] + j % block_size``."""
    offsets = torch.arange(block_size, dtype=torch.int32, device=pages.device)
    return (pages.to(torch.int32).unsqueeze(2) * block_size + offsets).flatten(1)


class SglangDecodeRow:
    """SGLang's ``minimax_sparse_decode`` on the step's decodes, the drop-in's backends configured to this run's
    (``page_size``: SGLang's, the block size (pages) by default; 1 reads the same pool as token slots)."""

    def __init__(self, setup: Setup, page_size: Optional[int] = None) -> None:
        from mm3.integrations import sglang, targets

        self.sglang, self.setup = sglang, setup
        self.page_size = setup.params.block_size if page_size is None else page_size
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
        self._decode(sl, *self._prime_pool(bt), max(s.decode_lens), self.caches)()
        if self.stub:
            self.stub.real = False

    def _decode(self, sl: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, longest: int,
                caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Call:
        p, fn, n = self.setup.params, self.sglang.minimax_sparse_decode, sl.shape[0]
        q, iq, (k, v, index), B = self.q[:n], self.iq[:n], caches, p.block_size

        def decode() -> None:
            fn(q, None, k, v, iq, None, index, None, pool, slots, sl, longest, 1, B, p.topk, p.init_blocks,
               p.local_blocks, sm_scale=p.softmax_scale, disable_index_value=True, page_size=self.page_size)
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
        self._extend(s, qsl, sl, *self._prime_pool(bt), self.caches)()
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
                      disable_index_value=True, page_size=self.page_size)
        return extend

    def prepare(self, s: StreamStep, qsl: torch.Tensor, sl: torch.Tensor, bt: torch.Tensor) -> Call:
        if s.prefill is None:
            return lambda: None
        return self._extend(s, qsl, sl, self.pool, self._slots(s), self.caches)



class StubHooksRow(LayerRow):
    """The stub's hooks alone, called as a layer's step calls them (``check_contents`` unless the stub
    judges in ``index_topk``, ``index_topk``, ``attention``) on the step's batch: what a layer row costs
    besides mm3's own work, so the layer's row less this one is mm3's host time over the hooks."""

    def __init__(self, setup: Setup) -> None:
        if setup.backend_name != "stub" or not CONTENTS_HOOK:
            raise Unavailable("stub backend with a check_contents hook only")
        super().__init__(setup)

    def _call(self, s: StreamStep, b: Any, caches: mm3.PagedKVCache) -> Call:
        T, p, stub = s.num_tokens, self.setup.params, self.stub
        q, iq, out = self.q[:T], self.iq[:T], self.out[:T]
        rows = self.layer.topk_buffer.rows(0, T)
        word = torch.zeros(1, dtype=torch.int64)
        num_pages = caches.k.shape[0]
        check, index, attend = stub.check_contents, stub.index_topk, stub.attention_forward

        def hooks() -> None:
            check(b, num_pages, word)
            index(iq, caches, b, p, rows, word)
            attend(q, caches, rows, b, p, out)

        def judging_hooks() -> None:   # judges_contents: the index hook judges, handed the word
            index(iq, caches, b, p, rows, word)
            attend(q, caches, rows, b, p, out)
        return (judging_hooks if stub.judges else hooks) if not stub.real else \
            (lambda: self.layer(q, iq, caches, b, out))

#: the rows by name, each made fresh for a run (raising :class:`Unavailable` or ImportError where this
#: checkout lacks the entry point)
ROWS: dict[str, Callable[[Setup], Row]] = {
    "layer": LayerRow,
    "ops": OpsRow,
    "ops, no-op kernels (the dispatcher's floor)": OpsFloorRow,
    "step op (a compiled layer's)": StepOpRow,
    "vllm decode": VllmDecodeRow,
    "tp rank": lambda setup: LayerRow(setup, tp=True),
    "layer, no check_contents hook": lambda setup: _without_contents_hook(setup),
    "sglang decode": lambda setup: _sglang_row(setup),
    "stub hooks alone (the layer's row less this: mm3's own time)": StubHooksRow,
}


def _sglang_row(setup: Setup) -> Row:
    """SGLang's decode entry point (a checkout without the drop-in raises ImportError)."""
    import_module("mm3.integrations.sglang")
    return SglangDecodeRow(setup)


def _without_contents_hook(setup: Setup) -> LayerRow:
    """The layer on a stub without ``check_contents``: mm3's own torch check of a batch's contents (what a
    backend without the hook gets)."""
    if not CONTENTS_HOOK or setup.backend_name != "stub":
        raise Unavailable("no check_contents hook in this checkout" if not CONTENTS_HOOK else "stub backend only")
    return LayerRow(setup, contents_hook=False)


# -- the measurement -------------------------------------------------------------------------------

@dataclass
class Pass:
    """One pass over the stream: per-step host microseconds, host reads and torch ops (when counted)."""

    us: list[float]
    reads: list[int]
    ops: list[int]
    where: list[str]


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


@contextlib.contextmanager
def _count_syncs() -> Iterator[list[int]]:
    """CUDA's own count of synchronising calls: one per ``set_sync_debug_mode("warn")`` warning."""
    got = [0]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield got
        finally:
            torch.cuda.set_sync_debug_mode("default")
            got[0] = sum("synchroniz" in str(w.message) for w in seen)


def run_pass(row: Row, setup: Setup, buffers: EngineBuffers, count: bool) -> Pass:
    """The stream through ``row`` once: timed (``count=False``) or with its reads and ops counted."""
    sync, res = _sync(setup.device), Pass([], [], [], [])
    for i, s in enumerate(setup.stream.steps):
        call = row.prepare(s, *buffers.load(i))
        sync()
        if not count:
            t0 = time.perf_counter()
            call()
            res.us.append((time.perf_counter() - t0) * 1e6)
            continue
        ops = CountOps()
        if setup.device.type == "cuda":
            with _count_syncs() as syncs, ops:
                call()
            res.reads.append(syncs[0])
        else:
            reads = CountHostReads()
            with reads, ops:
                call()
            res.reads.append(reads.count)
            res.where.extend(reads.where)
        res.ops.append(ops.count)
    return res


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _per_step_min(runs: list[list[float]]) -> float:
    """The mean over the stream's steps of each step's fastest run: a step does the same work in every
    run, so its slower runs are this machine's noise (a busy core, a collection)."""
    return _mean([min(ts) for ts in zip(*runs)])


def measure_row(make: Callable[[Setup], Row], setup: Setup, buffers: EngineBuffers, fresh: int = 5,
                again: int = 2) -> dict[str, float]:
    """A row's measures (module docstring): ``fresh`` timed first passes, each on fresh objects and
    followed by ``again`` timed second passes; then one fresh run of both passes, counted. All under
    ``torch.inference_mode()``, as engines call every entry point."""
    with torch.inference_mode():
        return _measure_row(make, setup, buffers, fresh, again)


def _measure_row(make: Callable[[Setup], Row], setup: Setup, buffers: EngineBuffers, fresh: int,
                 again: int) -> dict[str, float]:
    first: list[list[float]] = []
    second: list[list[float]] = []
    for _ in range(fresh):
        row = make(setup)
        try:
            row.prime()
            with _no_collection():
                first.append(run_pass(row, setup, buffers, False).us)
                second.extend(run_pass(row, setup, buffers, False).us for _ in range(again))
        finally:
            getattr(row, "close", lambda: None)()
    row = make(setup)
    try:
        row.prime()
        one, two = run_pass(row, setup, buffers, True), run_pass(row, setup, buffers, True)
    finally:
        getattr(row, "close", lambda: None)()
    n = len(setup.stream.steps)
    return {"host reads / step, pass 1": sum(one.reads) / n,
            "steps with host reads, pass 1": float(sum(r > 0 for r in one.reads)),
            "host reads / step, pass 2": sum(two.reads) / n,
            "host us / step, pass 1": _per_step_min(first), "host us / step, pass 2": _per_step_min(second),
            "torch ops / step, pass 1": sum(one.ops) / n, "torch ops / step, pass 2": sum(two.ops) / n}


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """No garbage collection inside timed passes (one costs more than a step; they run between passes)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def measure_from_device(setup: Setup, buffers: EngineBuffers, repeat: int = 5) -> dict[str, float]:
    """``BatchMetadata.from_device``'s host time (per step, the fastest of ``repeat`` passes; their mean)
    and torch ops per step."""
    S, sync = setup.stream, _sync(setup.device)
    runs: list[list[float]] = []
    with _no_collection():
        for _ in range(repeat):
            runs.append([])
            for i, s in enumerate(S.steps):
                qsl, sl, bt = buffers.load(i)
                sync()
                t0 = time.perf_counter()
                _batch(s, qsl, sl, bt, S.block_size)
                runs[-1].append((time.perf_counter() - t0) * 1e6)
    ops = CountOps()
    for i, s in enumerate(S.steps):
        qsl, sl, bt = buffers.load(i)
        with ops:
            _batch(s, qsl, sl, bt, S.block_size)
    return {"from_device: host us / step": _per_step_min(runs),
            "from_device: torch ops / step": ops.count / len(S.steps)}


def measure_stream(steps: int = 200, *, stub: bool = True, device: str = "cpu", seed: int = 0,
                   log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Every row's measures on a stream of ``steps`` steps at M3 TP8 shapes, bf16, default settings.

    Returns ``{"mm3": where mm3 was imported from, "stream": a line about the stream, "notes": [...],
    "measures": {"ROW: MEASURE": value or None}}`` (None: this checkout lacks the row's entry point).
    """
    dev = torch.device(device)
    threads = torch.get_num_threads()
    if stub:
        torch.set_num_threads(1)    # a host's Python is one thread; the stub's few ops need no more
    try:
        return _measure_stream(steps, stub, dev, seed, log)
    finally:
        torch.set_num_threads(threads)


def _measure_stream(steps: int, stub: bool, dev: torch.device, seed: int,
                    log: Callable[[str], None]) -> dict[str, Any]:
    p = mm3.SparseAttentionParams.minimax_m3(tp_size=8)
    stream = engine_stream(steps, seed=seed, block_size=p.block_size)
    setup = Setup(p, stream, dev, "stub" if stub else "cuda", full=mm3.SparseAttentionParams.minimax_m3(tp_size=1),
                  world=8)
    buffers = EngineBuffers(stream, dev)
    res: dict[str, Any] = {"mm3": mm3.__file__, "notes": [], "measures": {},
                           "backend": ("stub hooks on the CPU, block tables treated as device memory" if stub
                                       else f"the cuda backend on {torch.cuda.get_device_name(dev)}")
                           + ", under torch.inference_mode()"}
    n_mixed = sum(s.prefill is not None for s in stream.steps)
    res["stream"] = (f"{steps} steps ({n_mixed} with a prefill chunk), {stream.new_shapes()} distinct shapes "
                     f"(requests, decodes, tokens); block table {stream.max_blocks} wide, {stream.num_pages} pages")
    with treat_tables_as_device() if stub else contextlib.nullcontext() as note:
        if note:
            res["notes"].append(note)
        try:
            with torch.inference_mode():      # where engines build their metadata
                res["measures"].update(measure_from_device(setup, buffers))
        except Unavailable as e:
            res["notes"].append(f"from_device: n/a ({e})")
            res["measures"].update(dict.fromkeys(("from_device: host us / step", "from_device: torch ops / step")))
        for name, make in ROWS.items():
            log(f"stream: {name} ...")
            t0 = time.perf_counter()
            try:
                got: dict[str, Optional[float]] = dict(measure_row(make, setup, buffers))
            except (ImportError, Unavailable) as e:   # an older checkout without this entry point
                res["notes"].append(f"{name}: n/a ({e})")
                got = dict.fromkeys(MEASURES)
            res["measures"].update({f"{name}: {k}": v for k, v in got.items()})
            log(f"stream: {name} done in {time.perf_counter() - t0:.1f} s")
    return res


MEASURES = ("host reads / step, pass 1", "steps with host reads, pass 1", "host reads / step, pass 2",
            "host us / step, pass 1", "host us / step, pass 2", "torch ops / step, pass 1",
            "torch ops / step, pass 2")


# -- another checkout, side by side ------------------------------------------------------------------

def measure_ref(ref: str, steps: int, *, stub: bool, device: str, seed: int) -> dict[str, Any]:
    """:func:`measure_stream` of git ref ``ref``: a temporary worktree of it, this checkout's
    ``host_overhead.py --stream --json`` run in a subprocess that imports that worktree's ``mm3`` (its
    root first on ``PYTHONPATH``) and its ``backends`` as ``mm3_backends`` (a symlink in a shim folder);
    the measuring code stays this checkout's. The worktree is removed afterwards."""
    import json
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    script = Path(__file__).resolve().parent / "host_overhead.py"
    top = subprocess.run(["git", "-C", str(script.parent), "rev-parse", "--show-toplevel"], check=True,
                         capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="mm3-base-") as tmp:
        tree, shim = Path(tmp) / "tree", Path(tmp) / "shim"
        subprocess.run(["git", "-C", top, "worktree", "add", "--detach", "--quiet", str(tree), ref], check=True)
        try:
            shim.mkdir()
            (shim / "mm3_backends").symlink_to(tree / "backends", target_is_directory=True)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [str(shim), str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]))
            cmd = [sys.executable, str(script), "--stream", "--json", "--steps", str(steps), "--seed", str(seed),
                   "--device", device, *(["--stub"] if stub else [])]
            print(f"stream: measuring {ref} in {tree} ...", file=sys.stderr, flush=True)
            out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
        finally:
            subprocess.run(["git", "-C", top, "worktree", "remove", "--force", str(tree)], check=True)
    got: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    if not Path(got["mm3"]).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the run of {ref} imported mm3 from {got['mm3']}, not from its worktree {tree}")
    return got


def _fmt(measure: str, v: Optional[float]) -> str:
    if v is None:
        return "n/a"
    if "us /" in measure:
        return f"{v:.1f}"
    return f"{v:.0f}" if "steps with" in measure else f"{v:.2f}"


def format_table(here: dict[str, Any], base: Optional[dict[str, Any]] = None, ref: Optional[str] = None) -> str:
    """The measures as a table: one row per measure, a column per checkout (``ref``'s first)."""
    cols = ([(ref or "base", base)] if base is not None else []) + [("this checkout", here)]
    names = list(here["measures"])
    names += [n for c in cols for n in c[1]["measures"] if n not in names]
    w = max(map(len, names))
    lines = [f"stream: {here['stream']}", f"M3 TP8, bf16, check_contracts='first', {here['backend']}", "",
             f"{'':{w}}  " + "  ".join(f"{c[0]:>14}" for c in cols)]
    for n in names:
        lines.append(f"{n:{w}}  " + "  ".join(f"{_fmt(n, c[1]['measures'].get(n)):>14}" for c in cols))
    for label, c in cols:
        lines += [f"note ({label}): {note}" for note in c["notes"]]
    return "\n".join(lines)
