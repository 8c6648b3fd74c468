"""A mode that fails on any host read of a tensor's value: what a device sync would be on a GPU.

On the CPU no copy is visible, so reads are caught where they start: a tensor's
value turned into a Python number (``aten._local_scalar_dense``: ``int(t)``,
``bool(t)``, ``t.item()``) or a tensor handed to the host (``tolist``,
``numpy``, ``cpu``, ``to("cpu")``). Triton's interpreter copies a kernel's
arguments to run it on the CPU: those copies are the simulated device's, and
frames under it are let through, as are the frames of any ``exempt`` file.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostRead", "NoHostReads", "TRITON_INTERPRETER"]

TRITON_INTERPRETER = os.path.join("triton", "runtime", "interpreter.py")


class HostRead(AssertionError):
    """A tensor's value was read by the host."""


def _exempt(files: tuple[str, ...]) -> bool:
    f = sys._getframe(2)
    while f is not None:
        if any(part in f.f_code.co_filename for part in files):
            return True
        f = f.f_back
    return False


def _to_host(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("tolist", "numpy", "cpu", "item", "__array__"):
        return True
    if name == "to":
        where = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
        return any(torch.device(a).type == "cpu" for a in where)
    return False


class NoHostReads:
    """Raise :class:`HostRead` on any host read of a tensor value, outside the frames of ``exempt`` files."""

    def __init__(self, *exempt: str) -> None:
        files = (TRITON_INTERPRETER, *exempt)

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                kwargs = kwargs or {}
                if _to_host(func, args, kwargs) and not _exempt(files):
                    raise HostRead(f"{getattr(func, '__name__', func)} of a tensor: a device-to-host copy")
                return func(*args, **kwargs)

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func is torch.ops.aten._local_scalar_dense.default and not _exempt(files):
                    raise HostRead("a tensor's value read as a Python number: a device sync")
                return func(*args, **(kwargs or {}))

        self.modes = (Functions(), Dispatch())

    def __enter__(self) -> "NoHostReads":
        for m in self.modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for m in reversed(self.modes):
            m.__exit__(*exc)
