"""Input validation at the plugin boundary: clear :class:`mm3.InputError` s, never a kernel crash.

The kernels are stride-generic, so no contiguity is demanded; what they do
need is checked here: consistent shapes, supported dtypes, one device that
the kernels can run on, power-of-two tile sizes, and a top-k buffer with room
for the step's rows.
"""

from __future__ import annotations

from typing import Callable

import torch

from mm3.contract import BatchMetadata
from mm3.contract import PagedKVCache, TopkBuffer
from mm3.contract import InputError
from mm3.contract import check_hook_args
from mm3.contract import SparseAttentionParams

__all__ = ["check_index_inputs", "check_attention_inputs", "ATTENTION_DTYPES", "INDEX_Q_DTYPES",
           "INDEX_CACHE_DTYPES", "MIN_TILE"]

ATTENTION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
#: tl.dot needs every tile side >= 16; tiles are powers of two
MIN_TILE = 16


def _fail(backend: str, msg: str) -> InputError:
    return InputError(f"{backend}: {msg}")


def _pow2_dim(backend: str, label: str, value: int) -> None:
    if value < MIN_TILE or value & (value - 1):
        raise _fail(backend, f"{label} = {value} is not supported: the Triton kernels tile it, so it must be "
                             f"a power of two >= {MIN_TILE}; use the cpu_ref backend for other sizes")


def _check_device(backend: str, device: torch.device, device_ok: Callable[[torch.device], str]) -> None:
    why = device_ok(device)
    if why:
        raise _fail(backend, why)


def _check_backend_limits(backend: str, caches: PagedKVCache, batch: BatchMetadata, params: SparseAttentionParams,
                          max_decode_query_len: int, device_ok: Callable[[torch.device], str]) -> None:
    _check_device(backend, caches.device, device_ok)
    _pow2_dim(backend, "block_size", params.block_size)
    if batch.decode_query_len > max_decode_query_len and batch.num_decodes > 0:
        raise _fail(backend, f"decode query length {batch.decode_query_len} exceeds this backend's "
                             f"max_decode_query_len {max_decode_query_len}")


def check_index_inputs(backend: str, index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                       params: SparseAttentionParams, out: TopkBuffer, *, max_decode_query_len: int,
                       device_ok: Callable[[torch.device], str]) -> None:
    """Validate the indexer's inputs (SPEC §2-3); raises :class:`InputError` naming ``backend``."""
    H, Di = params.num_index_heads, params.index_head_dim
    check_hook_args(backend, caches, batch, params, topk=out, rows={
        "index_q": (index_q, (H, Di), "= [num_tokens, num_index_heads, index_head_dim]")})
    _check_backend_limits(backend, caches, batch, params, max_decode_query_len, device_ok)
    if caches.index_head_dim != Di:
        raise _fail(backend, f"index head dim mismatch: index_q {Di}, index cache {caches.index_head_dim}, "
                             f"params {params.index_head_dim}")
    _pow2_dim(backend, "index_head_dim", Di)
    if index_q.dtype not in INDEX_Q_DTYPES:
        raise _fail(backend, f"index_q dtype {index_q.dtype} unsupported; use bfloat16, float16 or float32")
    if caches.index_dtype not in INDEX_CACHE_DTYPES:
        raise _fail(backend, f"index cache dtype {caches.index_dtype} unsupported; use bfloat16 or "
                             f"float8_e4m3fn")


def check_attention_inputs(backend: str, q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer,
                           batch: BatchMetadata, params: SparseAttentionParams, out: torch.Tensor, *,
                           max_decode_query_len: int, device_ok: Callable[[torch.device], str]) -> None:
    """Validate the attention's inputs (SPEC §2, §4); raises :class:`InputError` naming ``backend``."""
    Hq, D = params.num_heads, params.head_dim
    hint = "= [num_tokens, num_heads, head_dim]"
    check_hook_args(backend, caches, batch, params, topk=topk, rows={"q": (q, (Hq, D), hint),
                                                                     "out": (out, (Hq, D), hint)})
    _check_backend_limits(backend, caches, batch, params, max_decode_query_len, device_ok)
    if caches.head_dim != D:
        raise _fail(backend, f"head dim mismatch: q {D}, KV cache {caches.head_dim}, params {params.head_dim}")
    _pow2_dim(backend, "head_dim", D)
    if q.dtype not in ATTENTION_DTYPES:
        raise _fail(backend, f"q dtype {q.dtype} unsupported; use bfloat16 or float16 (float32 accepted)")
    if caches.dtype != q.dtype:
        raise _fail(backend, f"KV cache dtype {caches.dtype} differs from q's {q.dtype}; cast one of them")
    if out.dtype != q.dtype:
        raise _fail(backend, f"out dtype {out.dtype} differs from q's {q.dtype} (SPEC §4: output in q's dtype)")
