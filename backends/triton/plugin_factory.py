"""Build a platform plugin's pluggy hooks from one declarative :class:`TritonPlatform`.

The ``cuda`` and ``rocm`` plugins run the same kernels; they differ in their
capabilities (name, top-k layout), their probe (which platform they accept)
and their launch configuration, which each plugin owns; nothing here knows a platform. Each plugin module is therefore a
:class:`TritonPlatform` plus one line that binds the hooks this factory returns::

    (backend_capabilities, backend_probe, alloc_topk_buffer,
     index_topk, attention_forward, index_scores) = make_hookimpls(PLATFORM)

Triton and the kernel modules are imported on first use, never at plugin
import, so ``mm3 backends`` stays cheap and works where Triton is missing.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import torch

from mm3.plugin import BackendCapabilities, Probe, SparseAttentionParams, TopkBuffer, hookimpl

from . import compat
from .interpreter_config import for_interpreter
from .launch import LaunchConfig

if TYPE_CHECKING:
    from mm3.plugin import BatchMetadata
    from mm3.plugin import PagedKVCache

__all__ = ["TritonPlatform", "TritonHooks", "make_hookimpls", "triton_missing", "interpreter_probe",
           "SUPPORTED_TILE_SIZES"]

#: head dims, index head dims and block sizes the kernels tile (powers of two >= 16)
SUPPORTED_TILE_SIZES = frozenset({16, 32, 64, 128, 256})


def triton_missing() -> str:
    """Why Triton cannot be used here ('' when it can)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install 'mm3[triton]')"
    return ""


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_probe(backend: str) -> Probe:
    """The answer for CPU tensors: only through Triton's interpreter, which is for tests."""
    missing = triton_missing()   # first: the interpreter is no help without Triton
    if missing:
        return Probe.no(missing)
    if not _interpreter_on():
        return Probe.no(f"{backend} runs on CPU tensors only through Triton's interpreter (test-only): "
                        f"set TRITON_INTERPRET=1 before the kernels are imported")
    kernels = _loaded_kernel_mode()
    if kernels == "compiled":
        return Probe.no(f"{backend}: the Triton kernels were imported before TRITON_INTERPRET=1 was set, "
                        f"so they are compiled for a GPU; set it before importing mm3_backends.triton")
    if compat.interpreter_problem():
        return Probe.no(f"{backend}: {compat.interpreter_problem()}")
    return Probe.named_only(_with_release_note("Triton interpreter on CPU tensors (TRITON_INTERPRET=1; "
                                               "test-only, slow)"))


def _with_release_note(reason: str) -> str:
    """``reason``, and where the installed Triton is not a release :mod:`.compat` was checked on, that too."""
    note = compat.release_note()
    return f"{reason}; {note}" if note else reason


def _kernels_interpreted() -> bool:
    """The imported kernels run in Triton's interpreter (asked per step: the answer is kept once the
    kernels are imported, as it cannot change after; before, whether TRITON_INTERPRET is set)."""
    global _INTERPRETED
    if _INTERPRETED is None:
        mode = _loaded_kernel_mode()
        if not mode:
            return _interpreter_on()
        _INTERPRETED = mode == "interpreted"
    return _INTERPRETED


_INTERPRETED: Optional[bool] = None


def _loaded_kernel_mode() -> str:
    """'interpreted' / 'compiled' for already imported kernels, '' if not imported yet."""
    import sys

    mod = sys.modules.get(f"{__package__}.attention")
    if mod is None:
        return ""
    return compat.kernel_mode(getattr(mod, "_decode_attention_kernel"))


@dataclass(frozen=True)
class TritonPlatform:
    """Everything that distinguishes one Triton platform plugin from another.

    ``platform_check()`` answers for a GPU device: ``(problem, note)``; a non-empty
    problem makes the probe say no with it, else the note is the probe's reason.
    ``native()`` says whether the running PyTorch is this platform's build; when it
    is not (a test-only override), the kernels launch with ``launch.portable()``.
    """

    name: str
    description: str
    topk_layout: str            # "head_major" | "token_major": its capabilities validate it
    platform_check: Callable[[], tuple[str, str]]
    launch: LaunchConfig
    native: Callable[[], bool]
    priority: int = 100
    kv_cache_layout: str = "NHD"
    max_decode_query_len: int = SparseAttentionParams.MINIMAX_M3_MAX_DECODE_QUERY_LEN

    def probe(self, device: torch.device) -> Probe:
        """CPU: the interpreter only; GPU: the platform check, a visible device, Triton."""
        if device.type == "cpu":
            return interpreter_probe(self.name)
        if device.type != "cuda":
            return Probe.no(f"{self.name} serves GPU tensors (torch device type 'cuda'), not {device.type!r}")
        problem, note = self.platform_check()
        if problem:
            return Probe.no(problem)
        if not torch.cuda.is_available():
            return Probe.no("no GPU is visible (torch.cuda.is_available() is False)")
        if triton_missing():
            return Probe.no(triton_missing())
        # the GPU's own name: what `mm3 version` shows for the device (a backend may ask its platform)
        return Probe.yes(_with_release_note(f"{note}; {torch.cuda.get_device_name(device)}"))

    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            name=self.name, description=self.description, priority=self.priority,
            # "cpu" only so the interpreter path can be probed; the probe says no
            # on CPU unless TRITON_INTERPRET=1
            device_types={"cuda", "cpu"}, ops={"index_topk", "attention", "index_scores"},
            topk_layout=self.topk_layout, topk_requires_contiguous=False, topk_order="ascending",
            kv_cache_layout=self.kv_cache_layout,
            dtypes={"bfloat16", "float16", "float32"},
            index_cache_dtypes={"bfloat16", "float16", "float32", "float8_e4m3fn", "nvfp4"},
            kv_cache_dtypes={"bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fn_unscaled",
                             "nvfp4"},
            query_dtypes={"float8_e4m3fn"},
            head_dims=SUPPORTED_TILE_SIZES, index_head_dims=SUPPORTED_TILE_SIZES,
            block_sizes=SUPPORTED_TILE_SIZES, max_topk=64, max_gqa_group=64,
            max_decode_query_len=self.max_decode_query_len, cuda_graph_safe=True, reports_bad_page_ids=True,
            judges_contents=True,
            kv_slot_scales=True, addressings={"pages", "slots"})

    def launch_config(self, device: torch.device) -> LaunchConfig:
        """The launch config for ``device``: sized for its multiprocessor count, or the interpreter's
        (:func:`.interpreter_config.for_interpreter`) for CPU tensors; cached per device."""
        interpreted = device.type != "cuda" or _kernels_interpreted()
        if interpreted:
            index, native = -1, True
        else:
            index = device.index if device.index is not None else torch.cuda.current_device()
            native = self.native()
        # every step asks: a dict lookup by the config's identity, not a hash of the whole config
        key = (id(self.launch), index, native)
        hit = _SIZED.get(key)
        if hit is None or hit[0] is not self.launch:
            cfg = for_interpreter(self.launch) if interpreted else \
                _sized_config(self.launch if native else self.launch.portable(), index)
            hit = _SIZED[key] = (self.launch, cfg)
        return hit[1]


_SIZED: dict[tuple[int, int, bool], tuple[LaunchConfig, LaunchConfig]] = {}


@functools.lru_cache(maxsize=None)
def _sized_config(launch: LaunchConfig, device_index: int) -> LaunchConfig:
    # one device-properties query per (config, GPU); never inside a captured graph's hot path
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return launch.for_device_sms(sms)


@functools.lru_cache(maxsize=None)
def _kernel_modules() -> tuple[Any, Any, Any, Any]:
    """(indexer, attention, index_scores, contents): imported at the first step, not with the plugin (they
    import Triton), then kept (an import statement per hook call costs host time)."""
    from . import attention, contents, index_scores, indexer

    return indexer, attention, index_scores, contents


class TritonHooks(NamedTuple):
    """The seven hook implementations of one plugin, in hookspec order."""

    backend_capabilities: Callable[..., BackendCapabilities]
    backend_probe: Callable[..., Probe]
    alloc_topk_buffer: Callable[..., TopkBuffer]
    index_topk: Callable[..., None]
    attention_forward: Callable[..., None]
    index_scores: Callable[..., None]
    check_contents: Callable[..., None]


def make_hookimpls(platform: TritonPlatform) -> TritonHooks:
    """The pluggy hook implementations of a Triton plugin for ``platform``."""
    caps = platform.capabilities()

    @hookimpl
    def backend_capabilities() -> BackendCapabilities:
        return caps

    @hookimpl
    def backend_probe(device: torch.device) -> Probe:
        return platform.probe(torch.device(device))

    @hookimpl
    def alloc_topk_buffer(num_tokens: int, num_heads: int, topk: int, device: torch.device) -> TopkBuffer:
        return TopkBuffer.allocate(num_tokens, num_heads, topk, layout=platform.topk_layout, device=device)

    @hookimpl
    def index_topk(index_q: torch.Tensor, caches: "PagedKVCache", batch: "BatchMetadata",
                   params: "SparseAttentionParams", out: TopkBuffer,
                   page_faults: Optional[torch.Tensor] = None) -> None:
        # mm3 admitted the call: the arguments, the declared limits (index_q's dtype too) and this
        # plugin's probe on the tensors' device (CPU tensors only under the interpreter)
        indexer, _, _, contents = _kernel_modules()
        # it judges the contents where it is handed the word (judges_contents), a step without tokens too
        if batch.num_tokens:
            indexer.index_topk(index_q, caches, batch, params, out, platform.launch_config(caches.device),
                               page_faults, judge=True)
        elif page_faults is not None:
            contents.check_contents(batch, caches.num_pages, page_faults, platform.launch_config(caches.device))

    @hookimpl
    def attention_forward(q: torch.Tensor, caches: "PagedKVCache", topk: TopkBuffer, batch: "BatchMetadata",
                          params: "SparseAttentionParams", out: torch.Tensor) -> None:
        _, attention, _, _ = _kernel_modules()
        if batch.num_tokens:
            attention.attention_forward(q, caches, topk, batch, params, out,
                                        platform.launch_config(caches.device))

    @hookimpl
    def index_scores(index_q: torch.Tensor, caches: "PagedKVCache", batch: "BatchMetadata",
                     params: "SparseAttentionParams", out: torch.Tensor,
                     page_faults: Optional[torch.Tensor] = None) -> None:
        _, _, scores, _ = _kernel_modules()
        if batch.num_tokens:
            scores.index_scores(index_q, caches, batch, params, out, platform.launch_config(caches.device),
                                page_faults)

    @hookimpl
    def check_contents(batch: "BatchMetadata", num_pages: int, word: torch.Tensor) -> None:
        _, _, _, contents = _kernel_modules()
        contents.check_contents(batch, num_pages, word, platform.launch_config(word.device))

    return TritonHooks(backend_capabilities, backend_probe, alloc_topk_buffer, index_topk, attention_forward,
                       index_scores, check_contents)
