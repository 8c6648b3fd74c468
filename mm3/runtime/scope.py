"""Scoped backend choice: ``with mm3.use_backend("cuda"): ...``.

Like ``torch.nn.attention.sdpa_kernel``, the choice holds for the code inside
the block (per thread and per asyncio task, through a ``ContextVar``) and is
undone on exit. A :class:`~mm3.runtime.layer.SparseAttention` built without an explicit
``backend=`` argument follows the innermost scope on each call.

Example:
    >>> with use_backend("cpu_ref"):
    ...     current_scope().backend
    'cpu_ref'
    >>> current_scope() is None
    True
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Optional

from mm3.runtime.registry import Registry, default_registry

__all__ = ["BackendScope", "use_backend", "current_scope", "SCOPE"]


@dataclass(frozen=True)
class BackendScope:
    """The backend names in force inside a ``use_backend`` block."""

    backend: str
    indexer_backend: Optional[str] = None


SCOPE: ContextVar[Optional[BackendScope]] = ContextVar("mm3_backend_scope", default=None)
"""The innermost active scope (read directly where a call is hot: `current_scope()` is one Python call more)."""


def current_scope() -> Optional[BackendScope]:
    """The innermost active ``use_backend`` scope, or ``None``."""
    return SCOPE.get()


@contextmanager
def use_backend(backend: str, indexer_backend: Optional[str] = None, *,
                registry: Optional[Registry] = None) -> Iterator[BackendScope]:
    """Select ``backend`` (and optionally a different indexer) for the enclosed code.

    The names are checked against ``registry`` (default: the process-wide one)
    when the block opens: an unknown name raises
    :class:`~mm3.contract.errors.UnknownBackendError` there, listing the known ones and
    the closest match, not later at a layer's first step. Whether the backend
    can serve a given layer is still decided (and explained) by that layer.

    Example:
        >>> import mm3
        >>> layer = mm3.SparseAttention(mm3.SparseAttentionParams.minimax_m3(8), max_num_tokens=16)
        >>> with mm3.use_backend("cpu_ref"):
        ...     layer.selection.attention.name
        'cpu_ref'
    """
    reg = registry if registry is not None else default_registry()
    for name in (backend, indexer_backend):
        if name is not None and name != "auto":
            reg.get(name, origin="from use_backend")
    token = SCOPE.set(BackendScope(backend, indexer_backend))
    try:
        yield SCOPE.get()  # type: ignore[misc]
    finally:
        SCOPE.reset(token)
