"""``tl.topk`` and ``tl.sort`` under Triton's interpreter, computed by one numpy sort.

Under ``TRITON_INTERPRET=1`` Triton's own top-k is a bitonic network run one
element-wise numpy operation at a time; profiled on the indexer's fuzz test it
was three quarters of the time of every interpreter test that runs the
indexer. Both functions return *values* (sorted, the largest ``k`` for top-k),
never positions, so no tie can come out in a different order: a numpy sort of
the same values is the same tensor. The indexer kernels sort int64 keys that
pack (score, block id) exactly for this reason. Float inputs are refused
rather than guessed (NaN ordering is where a numpy sort and a bitonic network
could differ), so a kernel that starts sorting floats fails loudly here.

What stays tested under the interpreter is everything around the sort: the key
packing, the chunked merge of top-k lists, the unpacking. On a GPU nothing is
patched and Triton's network runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton.language as tl
from triton.runtime.interpreter import TensorHandle

__all__ = ["install"]


def _value(c: Any) -> Any:
    return getattr(c, "value", c)


def _sort_values(x: Any, k: Any = None, dim: Any = None, descending: Any = False) -> Any:
    k, dim, descending = _value(k), _value(dim), bool(_value(descending))
    data = x.handle.data
    if dim is not None and dim not in (-1, data.ndim - 1):
        raise NotImplementedError(f"sort along dim {dim}: Triton sorts the minor dimension only")
    if not np.issubdtype(data.dtype, np.integer):
        raise NotImplementedError(f"interpreter sort of {data.dtype} values: only integer keys are "
                                  f"sorted by numpy here (see tests/interpreter_sort.py)")
    out = np.sort(data, axis=-1)
    if descending:
        out = out[..., ::-1]
    if k is not None:
        out = out[..., :k]
    out = np.ascontiguousarray(out)
    return tl.tensor(TensorHandle(out, x.handle.dtype), tl.block_type(x.dtype, list(out.shape)))


def _topk(x: Any, k: Any, dim: Any = None, descending: Any = True) -> Any:
    return _sort_values(x, k=k, dim=dim, descending=descending)


def _sort(x: Any, dim: Any = None, descending: Any = False) -> Any:
    return _sort_values(x, dim=dim, descending=descending)


def install() -> None:
    """Replace ``tl.topk`` / ``tl.sort`` for the interpreter (call only when it is on)."""
    for module in (tl, tl.standard):
        module.topk = _topk
        module.sort = _sort
