"""``torch.no_grad()`` for the drop-ins' functions, entered only when gradients are on.

An engine calls them under ``torch.inference_mode()`` or ``torch.no_grad()`` already; entering
``torch.no_grad()`` again costs about 3 us of host time per call for nothing. Where gradients are
on, the call runs inside ``torch.no_grad()`` as before: the ops write their outputs in place and
record no graph.

Example:
    >>> import torch
    >>> @without_grad
    ... def f(x):
    ...     return torch.is_grad_enabled()
    >>> f(1), torch.is_grad_enabled()
    (False, True)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

__all__ = ["without_grad"]

F = TypeVar("F", bound=Callable[..., Any])


def without_grad(fn: F) -> F:
    """``fn`` run with gradients off: directly where they are off already, else inside ``torch.no_grad()``."""
    grad_on = torch.is_grad_enabled

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not grad_on():
            return fn(*args, **kwargs)
        with torch.no_grad():
            return fn(*args, **kwargs)
    return call  # type: ignore[return-value]
