"""Input validation at the plugin boundary: clear :class:`mm3.errors.InputError` s, never a kernel crash.

The kernels are stride-generic, so no contiguity is demanded; what they do
need is checked here: consistent shapes, supported dtypes, one device that
the kernels can run on, power-of-two tile sizes, and a top-k buffer with room
for the step's rows.
"""

from __future__ import annotations

from typing import Callable

import torch

from mm3.batch import BatchMetadata
from mm3.buffers import PagedKVCache, TopkBuffer
from mm3.errors import InputError
from mm3.params import SparseAttentionParams

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


def _check_common(backend: str, T: int, caches: PagedKVCache, batch: BatchMetadata,
                  params: SparseAttentionParams, topk: TopkBuffer, tensors: dict[str, torch.Tensor],
                  max_decode_query_len: int, device_ok: Callable[[torch.device], str]) -> None:
    if not isinstance(caches, PagedKVCache):
        raise _fail(backend, f"caches must be a PagedKVCache, got {type(caches).__name__}")
    if not isinstance(batch, BatchMetadata):
        raise _fail(backend, f"batch must be a BatchMetadata, got {type(batch).__name__}")
    if not isinstance(topk, TopkBuffer):
        raise _fail(backend, f"the top-k buffer must be a TopkBuffer, got {type(topk).__name__}")
    dev = caches.device
    _check_device(backend, dev, device_ok)
    named = dict(tensors)
    named.update({"batch.block_table": batch.block_table, "batch.query_start_loc": batch.query_start_loc,
                  "batch.token_positions": batch.token_positions, "top-k buffer": topk.storage})
    for name, t in named.items():
        if t.device != dev:
            raise _fail(backend, f"{name} is on {t.device} but the caches are on {dev}; move every input "
                                 f"of the step to one device")
    if T != batch.num_tokens:
        raise _fail(backend, f"the step has {batch.num_tokens} tokens (batch) but the inputs have {T} rows")
    B = params.block_size
    if caches.block_size != B or batch.block_size != B:
        raise _fail(backend, f"block size mismatch: params {B}, caches {caches.block_size}, "
                             f"batch {batch.block_size}")
    _pow2_dim(backend, "block_size", B)
    if caches.num_kv_heads != params.num_kv_heads:
        raise _fail(backend, f"caches have {caches.num_kv_heads} KV heads, params say {params.num_kv_heads}")
    if batch.decode_query_len > max_decode_query_len and batch.num_decodes > 0:
        raise _fail(backend, f"decode query length {batch.decode_query_len} exceeds this backend's "
                             f"max_decode_query_len {max_decode_query_len}")
    if (topk.num_heads, topk.topk) != (params.num_kv_heads, params.topk):
        raise _fail(backend, f"top-k buffer is [H={topk.num_heads}, K={topk.topk}] but params need "
                             f"[H={params.num_kv_heads}, K={params.topk}]")
    if topk.num_tokens < T:
        raise _fail(backend, f"top-k buffer holds {topk.num_tokens} rows but the step has {T} tokens; pass "
                             f"buffer.rows(0, T) of a buffer sized for max tokens per step")


def check_index_inputs(backend: str, index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                       params: SparseAttentionParams, out: TopkBuffer, *, max_decode_query_len: int,
                       device_ok: Callable[[torch.device], str]) -> None:
    """Validate the indexer's inputs (SPEC §2-3); raises :class:`InputError` naming ``backend``."""
    if not isinstance(index_q, torch.Tensor) or index_q.dim() != 3:
        raise _fail(backend, f"index_q must be a 3-D tensor [T, Hidx, Di], got "
                             f"{getattr(index_q, 'shape', type(index_q).__name__)}")
    T, H, Di = index_q.shape
    _check_common(backend, T, caches, batch, params, out, {"index_q": index_q},
                  max_decode_query_len, device_ok)
    if H != params.num_index_heads:
        raise _fail(backend, f"index_q has {H} heads, params.num_index_heads is {params.num_index_heads}")
    if Di != params.index_head_dim or caches.index_head_dim != Di:
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
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise _fail(backend, f"q must be a 3-D tensor [T, Hq, D], got {getattr(q, 'shape', type(q).__name__)}")
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        raise _fail(backend, f"out must be a 3-D tensor [T, Hq, D], got "
                             f"{getattr(out, 'shape', type(out).__name__)}")
    T, Hq, D = q.shape
    _check_common(backend, T, caches, batch, params, topk, {"q": q, "out": out},
                  max_decode_query_len, device_ok)
    if Hq != params.num_heads:
        raise _fail(backend, f"q has {Hq} heads, params.num_heads is {params.num_heads}")
    if D != params.head_dim or caches.head_dim != D:
        raise _fail(backend, f"head dim mismatch: q {D}, KV cache {caches.head_dim}, params {params.head_dim}")
    _pow2_dim(backend, "head_dim", D)
    if q.dtype not in ATTENTION_DTYPES:
        raise _fail(backend, f"q dtype {q.dtype} unsupported; use bfloat16 or float16 (float32 accepted)")
    if caches.dtype != q.dtype:
        raise _fail(backend, f"KV cache dtype {caches.dtype} differs from q's {q.dtype}; cast one of them")
    if out.dtype != q.dtype:
        raise _fail(backend, f"out dtype {out.dtype} differs from q's {q.dtype} (SPEC §4: output in q's dtype)")
    if out.shape[0] < T or tuple(out.shape[1:]) != (Hq, D):
        raise _fail(backend, f"out has shape {tuple(out.shape)}; need [>= {T}, {Hq}, {D}]")
