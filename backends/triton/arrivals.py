"""Arrival counters: how the last program of a group learns that it is last, and finishes the group's work.

A decode step is four launches: the indexer's scores, its top-k, the
attention's splits and their merge. The top-k of a request needs every score
program of that request, and the merge of a (token, KV head) every split of
it, but nothing else: so instead of a launch of its own, the *last* program of
the group to finish can do it (``Algorithms.topk_in_last_program``,
``merge_in_last_program``; where it pays: ``LaunchConfig``'s rules). Each program stores its part, then adds one to
its group's counter (a release/acquire atomic at GPU scope, after a barrier of
the program so all of its threads' stores come before it); the program that
sees ``arrivals - 1`` reads the others' parts (bypassing the L1 cache, which
is not coherent between multiprocessors) and sets the counter back to zero
for the next launch. A launch whose groups all finish leaves every counter at
zero, which is what the next launch needs: the counters are allocated (zeroed)
once and reused, so the fused path costs no extra launch, eager or in a
CUDA graph.

Counters are kept per device *and stream* (per thread for CPU tensors under
the interpreter): two launches that run at once must not count into the same
slots. And per *role* (``"topk"``, ``"merge"``, ``"ready"``): a streamed decode
step (``Algorithms.streamed_decode``) runs the score kernel's top-k counting
and the attention's merge counting at the same time. They are allocated by a
thread of their own on a GPU (:func:`in_own_thread` says why), outside CUDA graph captures only (zeroing one during a capture
would only happen when the graph replays), and never freed or moved while the
process runs: a captured graph keeps their address (``_KEEP``). A capture uses
its stream's counters if that stream ran a decode step eagerly before, else
the device's *graph* counters, which every eager allocation on the device
also sizes; so graphs that replay at the same time on two streams must not
both hold decode steps (replays one after another are fine). When a capture
needs more counters than exist, :func:`arrival_counters` returns None and the
caller launches the separate top-k / merge kernels instead (same results).

A streamed step hands its ready flags from the indexer's launcher to the
attention's through :func:`offer_ready_flags` and :func:`claim_ready_flags`
(host-side, per stream): the attention waits on the flags only when the
indexer call just before it on the same stream raised them for the same top-k
buffer, so an attention after any other indexer never waits on flags nobody
raises.

Example:
    >>> import torch
    >>> c = arrival_counters(torch.device("cpu"), 10)
    >>> int(c.numel()) >= 10, int(c.sum())
    (True, 0)
    >>> c is arrival_counters(torch.device("cpu"), 10)
    True
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from .compat import current_raw_stream

__all__ = ["arrival_counters", "capturing", "capture_matters", "in_own_thread", "stream_key", "MIN_COUNTERS",
           "offer_ready_flags", "claim_ready_flags"]

#: counters allocated at least (int32, 64 KB): enough for 16K (token, KV head) pairs, so a
#: graph captured after a smaller eager step rarely finds them short
MIN_COUNTERS = 16384

_COUNTERS: dict[tuple[torch.device, int, str], torch.Tensor] = {}
#: per device and role: the counters of captures on a stream that has none of its own
_GRAPH_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}
#: per stream: (top-k buffer address, decode requests, ready flags) the last indexer call raises
_READY: dict[tuple[torch.device, int], tuple[int, int, torch.Tensor]] = {}
#: every buffer ever handed out stays alive for the process: a CUDA graph captured with one holds its
#: address and launches on it at each replay, and nothing tells this module when the last such graph
#: is gone, so freeing a replaced buffer would let a replay count into memory the allocator gave to
#: someone else. Bounded: a buffer only grows (by powers of two from 64 KB), one per stream used for
#: decode steps and one per device for captures
_KEEP: list[torch.Tensor] = []
_LOCK = threading.Lock()


def stream_key(device: torch.device) -> tuple[torch.device, int]:
    """What buffers kept for ``device``'s current stream are keyed by: the device and the raw stream
    handle (no Stream object is made), or the calling thread for CPU tensors."""
    if device.type == "cuda":
        return device, current_raw_stream(device.index if device.index is not None else torch.cuda.current_device())
    # CPU tensors (Triton's interpreter): no stream orders two threads' launches, so one set per thread
    return device, threading.get_ident()


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (False for CPU tensors)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def capture_matters(rule: Optional[bool], device: torch.device) -> bool:
    """What a plan needs to know of a capture for an ``Algorithms`` choice ``rule``: whether one is
    under way, if the choice is left to ``LaunchConfig``'s rules (None); else never (False), so a
    fixed choice pays no capture query per step."""
    return rule is None and capturing(device)


def in_own_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run by a new thread (its result, or its exception raised here): the allocations of buffers
    kept across steps (these counters, :mod:`.scratch`'s buffers).

    Why: CUDA memory pools are routed per thread. torch.compile's CUDA-graph trees
    (``mode="reduce-overhead"``) send every allocation the *calling* thread makes during a warm-up
    run into the graphs' private pool (``torch.cuda.use_mem_pool`` routes the same way). A buffer
    carved from that pool and kept after the run is memory the tree takes back for its next
    recording: a later replay writes over the counters (or the tree finds a tensor of its pool alive
    that it did not hand out, and fails). A thread of its own is routed nowhere, so its allocation
    comes from the device's general pool, as outside a warm-up (another stream on the calling thread
    is not enough: the routing does not look at streams). tests/gpu/test_arrivals_gpu.py shows both
    allocations side by side inside ``use_mem_pool``."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box.append((False, e))
    worker = threading.Thread(target=run, name="mm3-kept-buffers")
    worker.start()
    worker.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _zeros(device: torch.device, n: int) -> torch.Tensor:
    size = max(MIN_COUNTERS, 1 << max(0, n - 1).bit_length())
    if device.type != "cuda":
        t = torch.zeros(size, dtype=torch.int32, device=device)
    else:
        # allocated and zeroed outside the calling thread's pool routing (in_own_thread), which
        # then waits for the zeros: the first launch that counts must find them
        def alloc() -> torch.Tensor:
            with torch.cuda.device(device):
                z = torch.zeros(size, dtype=torch.int32, device=device)
                torch.cuda.current_stream(device).synchronize()
            return z
        t = in_own_thread(alloc)
    _KEEP.append(t)
    return t


def arrival_counters(device: torch.device, n: int, role: str = "topk") -> Optional[torch.Tensor]:
    """At least ``n`` zeroed int32 counters of ``role`` for a launch on ``device``'s current stream, or
    None during a CUDA graph capture that finds too few (then launch without them)."""
    key = (*stream_key(device), role)
    have = _COUNTERS.get(key)
    if have is not None and have.numel() >= n:
        return have
    if capturing(device):
        have = _GRAPH_COUNTERS.get((device, role)) if have is None else have
        return have if have is not None and have.numel() >= n else None
    with _LOCK:
        have = _COUNTERS.get(key)
        if have is None or have.numel() < n:
            have = _COUNTERS[key] = _zeros(device, n)
        graph = _GRAPH_COUNTERS.get((device, role))
        if graph is None or graph.numel() < n:
            _GRAPH_COUNTERS[(device, role)] = _zeros(device, n)
    return have


def offer_ready_flags(device: torch.device, topk: torch.Tensor, num_decodes: int,
                      flags: Optional[torch.Tensor]) -> None:
    """Record that the indexer launch just made on ``device``'s current stream raises ``flags[r]`` once
    decode request ``r``'s top-k is in ``topk`` (None: it raises none, and an earlier record goes)."""
    key = stream_key(device)
    if flags is None:
        _READY.pop(key, None)
    else:
        _READY[key] = (topk.data_ptr(), num_decodes, flags)


def claim_ready_flags(device: torch.device, topk: torch.Tensor, num_decodes: int) -> Optional[torch.Tensor]:
    """The ready flags of the indexer launch before this one on the stream, if it filled this ``topk``
    for these ``num_decodes`` requests (the record is used up); else None: wait for nothing."""
    got = _READY.pop(stream_key(device), None)
    if got is None or got[0] != topk.data_ptr() or got[1] != num_decodes:
        return None
    return got[2]
