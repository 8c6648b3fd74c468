"""Scoped backend choice: ``with mm3.use_backend("cuda"): ...``.

Like ``torch.nn.attention.sdpa_kernel``, the choice holds for the code inside
the block (per thread and per asyncio task, through a ``ContextVar``) and is
undone on exit. A :class:`~mm3.layer.SparseAttention` built without an explicit
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

__all__ = ["BackendScope", "use_backend", "current_scope"]


@dataclass(frozen=True)
class BackendScope:
    """The backend names in force inside a ``use_backend`` block."""

    backend: str
    indexer_backend: Optional[str] = None


_SCOPE: ContextVar[Optional[BackendScope]] = ContextVar("mm3_backend_scope", default=None)


def current_scope() -> Optional[BackendScope]:
    """The innermost active ``use_backend`` scope, or ``None``."""
    return _SCOPE.get()


@contextmanager
def use_backend(backend: str, indexer_backend: Optional[str] = None) -> Iterator[BackendScope]:
    """Select ``backend`` (and optionally a different indexer) for the enclosed code.

    The names are checked when a layer selects, so an unknown name raises
    :class:`~mm3.errors.UnknownBackendError` there, listing the known ones.
    """
    token = _SCOPE.set(BackendScope(backend, indexer_backend))
    try:
        yield _SCOPE.get()  # type: ignore[misc]
    finally:
        _SCOPE.reset(token)
