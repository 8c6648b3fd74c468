"""The path of one steady step from ``SparseAttention.forward`` to the first hook: few files, one way.

A profiler (``sys.setprofile``) records every Python call from the layer's
``forward`` until the plugin's first hook runs, on a steady decode step (the
target's plan made, the guard's first step of the kind passed). Consecutive
calls in one file are one stop. docs/architecture.md shows the path; this test
holds it to at most 4 files and at most 1 return to a file already left, for a
batch seen before and for a new batch object of a new shape (an engine's
traffic), with the default settings.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any, Optional

import torch

import mm3
import mm3.runtime.step as step_mod
from mm3.plugin import BackendCapabilities, hookimpl
from mm3.runtime.registry import Registry
from mm3_backends.cpu_ref import plugin as cpu_ref

P = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2, index_head_dim=16,
                              block_size=16, topk=4)


class _Quick:
    """A backend whose hooks return at once once ``real`` is off (before: cpu_ref's, for the guard's first
    step), and which judges contents in its own (here: empty) launch."""

    real = True

    @hookimpl
    def backend_capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(name="quick", ops={"index_topk", "attention"}, device_types={"cpu"},
                                   topk_layout="head_major", reports_bad_page_ids=True,
                                   kv_cache_dtypes={"float32"}, dtypes={"float32"}, index_cache_dtypes={"float32"})

    @hookimpl
    def check_contents(self, batch: Any, num_pages: int, word: torch.Tensor) -> None:
        return None

    @hookimpl
    def index_topk(self, index_q: Any, caches: Any, batch: Any, params: Any, out: Any, page_faults: Any = None) -> None:
        if self.real:
            cpu_ref.index_topk(index_q=index_q, caches=caches, batch=batch, params=params, out=out)

    @hookimpl
    def attention_forward(self, q: Any, caches: Any, topk: Any, batch: Any, params: Any, out: Any) -> None:
        if self.real:
            cpu_ref.attention_forward(q=q, caches=caches, topk=topk, batch=batch, params=params, out=out)


def _device_table(batch: mm3.BatchMetadata) -> bool:
    return False     # the CPU table stands in for a device one (step.on_host)


def _batch(seq_lens: list[int]) -> mm3.BatchMetadata:
    R = len(seq_lens)
    qsl = torch.arange(R + 1, dtype=torch.int32)
    table = torch.arange(R * 8, dtype=torch.int32).reshape(R, 8)
    return mm3.BatchMetadata.from_device(qsl, torch.tensor(seq_lens, dtype=torch.int32), table, num_decodes=R,
                                         num_tokens=R, max_query_len=1, block_size=16)


def _stops(fn: Any, first_hook: str) -> list[str]:
    """The files Python runs in from the layer's ``forward`` until ``first_hook`` is called, one entry per
    run of consecutive code in one file (a call into another file is a stop, and so is the return)."""
    files: list[str] = []
    done = False

    def profile(frame: FrameType, event: str, arg: Optional[object]) -> None:
        nonlocal done
        if done or event not in ("call", "return") or (not files and frame.f_code.co_name != "forward"):
            return
        code = frame.f_code if event == "call" else frame.f_back.f_code if frame.f_back else None
        if code is None:
            return
        name = code.co_filename
        if code.co_name == _device_table.__name__:
            name = step_mod.__file__     # it stands in for step.on_host, a function of step.py
        if not files or files[-1] != name:
            files.append(name)
        if event == "call" and code.co_name == first_hook and name == __file__:
            done = True

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    assert done, "the hook was never called"
    return files


def test_a_steady_step_reaches_its_first_hook_through_few_files(monkeypatch: Any) -> None:
    monkeypatch.setattr(step_mod, "on_host", _device_table)
    quick = _Quick()
    layer = mm3.SparseAttention(P, dtype=torch.float32, index_dtype=torch.float32, max_num_tokens=16, backend="quick",
                                registry=Registry([quick], entry_points=False))
    caches = mm3.PagedKVCache(*(torch.randn(64, 16, P.num_kv_heads, P.head_dim) for _ in "kv"),
                              torch.randn(64, 16, P.index_head_dim))

    def tensors(T: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(T, P.num_heads, P.head_dim), torch.randn(T, P.num_index_heads, P.index_head_dim),
                torch.empty(T, P.num_heads, P.head_dim))

    first = _batch([40, 17])
    q, iq, out = tensors(2)
    layer(q, iq, caches, first, out)          # the plan, the guard's first decode step, the one host check
    quick.real = False
    layer(q, iq, caches, first, out)
    # the first hook a steady step calls: the backend's check of what the batch holds now (every call)
    again = _stops(lambda: layer(q, iq, caches, first, out), "check_contents")
    fresh = _batch([41, 18, 90])              # an engine's next step: a new shape, a new batch object
    q3, iq3, out3 = tensors(3)
    new = _stops(lambda: layer(q3, iq3, caches, fresh, out3), "check_contents")
    for stops in (again, new):
        names = [os.path.relpath(f) if os.path.exists(f) else f for f in stops]
        assert len(set(stops)) <= 4, names
        assert len(stops) - len(set(stops)) <= 1, names
        assert stops[-1] == __file__ and "layer.py" in stops[0] and any("step.py" in f for f in stops), names
