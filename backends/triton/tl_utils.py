"""Small helpers shared by the kernels and their launchers (dtype choices, launch options, page loads).

Nothing here asks which GPU vendor runs: the options come from the plugin's
:class:`LaunchConfig` (see :meth:`LaunchConfig.portable`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from . import compat
from .launch import LaunchConfig

__all__ = ["dot_config", "launch_options", "decode_launch_options", "interpreting", "pdl_enabled", "pdl_prologue",
           "streamed_enabled", "pdl_available", "release_dependents", "grid_wait",
           "TL_DTYPES", "kv_scale_args", "kv_scale", "slot_scales", "load_page", "arrive_last", "step_kernel"]

try:  # programmatic dependent launch (Hopper+): Triton >= 3.4 has these
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    _gdc_wait = _gdc_launch_dependents = None

TL_DTYPES: dict[torch.dtype, Any] = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
}


def step_kernel(*per_step: str) -> Any:
    """``triton.jit`` for a kernel whose parameters ``per_step`` change from one step to the next
    (a prefill's first token, token and request counts, block count): Triton compiles them
    unspecialized (``do_not_specialize``: no constant 1, no divisibility hint), so one binary
    serves every step and :mod:`.fast_launch` launches it directly on later steps instead of
    binding every argument through Triton again.

    Example:
        >>> from mm3_backends.triton.compat import unspecialized_params
        >>> @step_kernel("n")
        ... def fill(x_ptr, n, B: tl.constexpr):
        ...     tl.store(x_ptr + tl.arange(0, B), n)
        >>> unspecialized_params(fill)
        {'n'}
    """
    return triton.jit(do_not_specialize=list(per_step))


@triton.jit
def _decorated() -> None:
    """Nothing: what Triton makes of a function decorated now tells how it decorates the kernels."""
    pass


#: Triton's own decision, taken when it decorated the function above: whether kernels run in its
#: interpreter (it reads TRITON_INTERPRET then, and the kernel modules are decorated in the same
#: process with the same setting). Kept, as every launch asks (reading the environment costs a
#: microsecond, and could disagree with how Triton read it).
_INTERPRETING = compat.kernel_mode(_decorated) == "interpreted"


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1`` when they were decorated)."""
    return _INTERPRETING


if interpreting():
    # every kernel module imports this one, so whoever runs a kernel under the interpreter (a plugin's
    # hook, `mm3 check`, a test, a direct call) has both in force first; each reaches Triton's private
    # interpreter through .compat, and says so in a warning where this Triton's is not what it knows
    from . import interpreter, interpreter_speed

    interpreter.install()          # bf16, e4m3 NaNs and e5m2 as a GPU computes them
    interpreter_speed.install()    # exact shortcuts through the interpreter's own machinery


def dot_config(a: torch.dtype, b: torch.dtype, fp8_as_f16: bool = False) -> tuple[Any, str, bool]:
    """``(operand dtype, input_precision, SCALE_Q)`` for a ``tl.dot`` of an ``a`` tile with a ``b`` tile.

    Same 16-bit dtype: native tensor-core dot. An fp8 ``b`` (an e4m3 index or K/V
    cache, an e5m2 K/V cache) with a 16-bit ``a``: ``b`` is widened exactly to ``a``'s
    dtype; with ``fp8_as_f16`` a bf16 ``a`` is dotted in fp16 instead, because e4m3 ->
    fp16 is one native conversion per two values on sm_89+ and e4m3 -> bf16 several
    (e5m2 -> fp16 keeps fp16's exponent: the byte is the fp16's upper half),
    and its rows are then scaled into fp16's range (``SCALE_Q``:
    :func:`.tiles.load_query_rows`). An NVFP4 ``b`` (uint8) is unpacked to ``a``'s 16-bit
    dtype (fp16 for fp8 queries), in which its values are exact (:mod:`.nvfp4`). Anything
    else (fp32, or two different 16-bit types) goes through fp32 with ``ieee`` precision, because tf32 would
    round scores to about 1e-3, the size of the selection tolerance itself.

    Example:
        >>> dot_config(torch.bfloat16, torch.float8_e4m3fn, fp8_as_f16=True)[1:]
        ('tf32', True)
        >>> dot_config(torch.float16, torch.float8_e5m2)[1:]
        ('tf32', False)
        >>> dot_config(torch.bfloat16, torch.uint8, fp8_as_f16=True)    # NVFP4: exact in bf16, no row scaling
        (triton.language.bfloat16, 'tf32', False)
    """
    if a == b and a in (torch.float16, torch.bfloat16):
        return TL_DTYPES[a], "tf32", False
    # an NVFP4 cache (uint8): its values, e2m1 x e4m3 products, are exact in fp16 and bf16 (.nvfp4)
    if b == torch.uint8:
        if a in (torch.float16, torch.bfloat16):
            return TL_DTYPES[a], "tf32", False
        if a == torch.float8_e4m3fn:
            return tl.float16, "tf32", False
        return tl.float32, "ieee", False
    # fp8 queries (docs/spec.md §1): e4m3 widens exactly to fp16 and bf16, and so does an fp8 K/V tile to fp16,
    # so the dots stay 16-bit and exact in their inputs (fp16 for two fp8 tiles: one native conversion on sm_89+)
    if a == torch.float8_e4m3fn and b in (torch.float16, torch.bfloat16):
        return TL_DTYPES[b], "tf32", False
    if a == torch.float8_e4m3fn and b.itemsize == 1 and b.is_floating_point:
        return tl.float16, "tf32", False
    # an fp8 K/V cache: the only one-byte floats a call can bring (the boundary admitted its dtype)
    if b.itemsize == 1 and b.is_floating_point and a in (torch.float16, torch.bfloat16):
        if fp8_as_f16 and a == torch.bfloat16:
            return tl.float16, "tf32", True
        return TL_DTYPES[a], "tf32", False
    # (an fp8 K/V cache with scales: the same; its scales are applied outside the dots, see kv_scale)
    return tl.float32, "ieee", False


def pdl_enabled(cfg: LaunchConfig, num_tokens: int, num_kv_heads: int) -> bool:
    """Whether this step's decode kernels launch with programmatic dependent launch.

    :meth:`LaunchConfig.use_pdl` decides (the plugins turn it off where the GPU has no
    PDL); only with a Triton that has the grid-dependency instructions, never under
    the interpreter, which has none.
    """
    return pdl_available() and cfg.use_pdl(num_tokens, num_kv_heads)


def streamed_enabled(cfg: LaunchConfig, num_requests: int, rows_per_request: int) -> bool:
    """Whether this decode step's attention overlaps its indexer (:meth:`LaunchConfig.use_streamed_decode`).

    A plugin's explicit choice stands (the interpreter tests run the streamed kernels in
    sequence); the rule needs PDL, without which the attention cannot start early.
    """
    if cfg.algorithms.streamed_decode is not None:
        return cfg.algorithms.streamed_decode
    return pdl_available() and cfg.use_streamed_decode(num_requests, rows_per_request)


def pdl_available() -> bool:
    """Whether kernels can be compiled with the grid-dependency instructions (Triton has them and
    the kernels run on a GPU, not through the interpreter)."""
    return _gdc_wait is not None and not interpreting()


@triton.jit
def release_dependents(TRIGGER: tl.constexpr):
    """Let the next kernel in the stream launch now (``TRIGGER``), after this thread's earlier writes:
    a GPU-scope fence first, so a dependent that starts at once cannot read what this program has
    just overwritten (the ready flags a streamed score kernel lowers before its scores)."""
    if TRIGGER:
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, $1;", "=r,r", [tl.program_id(0)],
                                  dtype=tl.int32, is_pure=False, pack=1)
        _gdc_launch_dependents()


@triton.jit
def grid_wait(WAIT: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible (``WAIT``)."""
    if WAIT:
        _gdc_wait()


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of a PDL-launched kernel: wait until the previous kernel in the stream has
    finished and its writes are visible (every input may be its output), then let the next kernel
    be scheduled, so its launch overlaps this kernel instead of following it."""
    if PDL:
        _gdc_wait()
        _gdc_launch_dependents()


def launch_options(cfg: LaunchConfig) -> dict[str, Any]:
    """The config's extra launch options; none under the interpreter, which takes no GPU options.

    The plugin passes only options its GPU accepts (``LaunchConfig.portable``
    drops AMD's ``waves_per_eu`` for the rocm plugin's test-only run on NVIDIA).
    """
    return {} if interpreting() else dict(cfg.launch_options)


def decode_launch_options(cfg: LaunchConfig, pdl: bool) -> dict[str, Any]:
    """:func:`launch_options` plus ``launch_pdl`` for a decode kernel when ``pdl``."""
    opts = launch_options(cfg)
    if pdl:
        opts["launch_pdl"] = True
    return opts


def kv_scale_args(caches: Any, dummy: torch.Tensor) -> tuple[tuple[Any, int, Any, int], bool, bool]:
    """``((k_scale, head stride, v_scale, head stride), KV_SCALED, SLOT_SCALED)`` for a kernel that reads ``caches``.

    Scaled fp8 K/V (docs/spec.md §1) pass their scales, read in place, so a
    captured graph sees scales updated in place: ``[Hkv]`` ones (stride 0 for a
    per-tensor scale) with ``KV_SCALED``; ``[Hkv, num_slots]`` ones with
    ``SLOT_SCALED``, whose slots the kernels address as ``page * block_size +
    offset`` (consecutive slots adjacent: a view with another slot stride is
    copied). Otherwise ``dummy`` stands in and is never read.
    """
    if not caches.kv_scaled:
        return (dummy, 0, dummy, 0), False, False
    ks, vs = caches.k_scale, caches.v_scale
    if caches.slot_scaled:
        ks, vs = (s if s.stride(1) == 1 else s.contiguous() for s in (ks, vs))
        return (ks, ks.stride(0), vs, vs.stride(0)), False, True
    return (ks, ks.stride(0), vs, vs.stride(0)), True, False


@triton.jit
def kv_scale(scale_ptr, h, s_scale, KV_SCALED: tl.constexpr):
    """KV head ``h``'s dequantization factor: ``scale[h]`` for scaled fp8 K/V, else 1.

    The kernels fold the K factor into the softmax scale (``qk_scale * k_scale``:
    the logits of ``q . stored_k``) and apply the V factor once to the
    accumulator before it is stored, so no loaded K/V tile is multiplied.
    """
    if KV_SCALED:
        s = tl.load(scale_ptr + h * s_scale)
    else:
        s = 1.0
    return s


@triton.jit
def slot_scales(row_ptr, offs_j, SLOT_SCALED: tl.constexpr, mask=None):
    """The dequantization factors of a page's keys ``offs_j`` for one KV head (``row_ptr``: its
    scale row at the page's first slot, ``scale + h * stride + page * block_size``), or 1 without
    per-slot scales. The K factors multiply the logits, the V factors the softmax weights before
    the second dot (the softmax sum stays unscaled). ``mask`` as for ``tl.load`` (0 where off)."""
    f = 1.0
    if SLOT_SCALED:
        if mask is None:
            f = tl.load(row_ptr + offs_j)
        else:
            f = tl.load(row_ptr + offs_j, mask=mask, other=0.0)
    return f


@triton.jit
def load_page(entry_ptr, num_pages, mask=None):
    """The block-table entry at ``entry_ptr`` clamped into ``[0, num_pages)`` (int64, for page offsets).

    Every kernel takes its page ids through here, so a page id is only ever used
    as an address after this clamp. A bad id (negative, or past the cache) then
    reads a real page of the cache, whose values are wrong but whose address is
    valid, instead of memory outside it: an illegal access would poison the
    whole CUDA context. The bad id itself is reported by the indexer
    (:func:`load_reported_page`), which reads every used entry. Cost:
    two integer ops on a value already loaded. ``mask`` as for ``tl.load``;
    masked-off lanes give page 0.
    """
    if mask is None:
        page = tl.load(entry_ptr)
    else:
        page = tl.load(entry_ptr, mask=mask, other=0)
    return tl.maximum(tl.minimum(page, num_pages - 1), 0).to(tl.int64)


@triton.jit
def load_reported_page(entry_ptr, num_pages, faults_ptr, request, block):
    """:func:`load_page` of ``block_table[request, block]`` that also reports a bad id: it lowers
    the word at ``faults_ptr`` to ``request << 32 | block`` (mm3.contract.contents), so the layer
    learns of it with no check of its own. The indexer loads every used entry: it reports for
    the step. Cost: a compare on a value already loaded; the word is read and written only for a
    bad id. The word is host memory mapped into the device, where atomics are not portable: a
    plain load and store, so of programs that meet bad ids at once any one may win."""
    page = tl.load(entry_ptr)
    if (page < 0) | (page >= num_pages):
        code = request.to(tl.int64) * 4294967296 + block
        if code < tl.load(faults_ptr, volatile=True):
            tl.store(faults_ptr, code)
    return tl.maximum(tl.minimum(page, num_pages - 1), 0).to(tl.int64)


@triton.jit
def arrive_last(counter_ptr, group, arrivals):
    """Count this program into ``group``'s arrivals; True for the last of ``arrivals`` (:mod:`.arrivals`).

    The barrier puts every thread's earlier stores before the count; the count is
    a release/acquire atomic at GPU scope, so the last program sees the others'
    stores (it must read them past L1: ``cache_modifier=".cg"``). The last program
    sets the counter back to zero for the next launch.
    """
    tl.debug_barrier()
    old = tl.atomic_add(counter_ptr + group, 1, sem="acq_rel", scope="gpu")
    last = old == arrivals - 1
    if last:
        tl.store(counter_ptr + group, 0)
    return last
