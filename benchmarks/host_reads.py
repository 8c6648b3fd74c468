"""Counting modes for the CPU stand-in of a GPU: host reads of tensor values, and torch ops dispatched.

On the CPU no device-to-host copy is visible, so a read is counted where it
starts (as ``tests/host_reads.py``'s ``NoHostReads`` raises there): a tensor's
value turned into a Python number (``aten._local_scalar_dense``: ``int(t)``,
``bool(t)``, ``t.item()``) or a tensor handed to the host (``tolist``,
``numpy``, ``cpu``, ``to("cpu")``). On a GPU each is a device sync. Frames
under Triton's interpreter (the simulated device's own copies) and under any
``exempt`` file are not counted.

A custom op (``torch.ops.mm3.*``) is one call to a mode, which is switched off
while it handles the call: the op's Python kernel would run unseen. Both
counters therefore run a custom op's kernel themselves, with the modes on
(:class:`_SeeInside`), so what the kernel reads and dispatches is counted.

Example:
    >>> import torch
    >>> t = torch.arange(4, dtype=torch.int32)
    >>> with CountHostReads() as reads:
    ...     _ = int(t[1]), t.tolist(), t + 1
    >>> reads.count
    2
    >>> with CountOps() as ops:
    ...     _ = t + 1
    >>> ops.count
    1
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any, Callable, Optional

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CountHostReads", "CountOps", "TRITON_INTERPRETER"]

TRITON_INTERPRETER = os.path.join("triton", "runtime", "interpreter.py")
_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _to_host(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("tolist", "numpy", "cpu", "item", "__array__"):
        return True
    if name == "to":
        where = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
        return any(torch.device(a).type == "cpu" for a in where)
    return False


def _caller(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The innermost frame outside torch and this module (where the read was asked for)."""
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH) or
                                 os.path.abspath(frame.f_code.co_filename) == _HERE):
        frame = frame.f_back
    return frame


def _custom_op(func: Any) -> Optional[OpOverload]:
    op = getattr(func, "default", None) if isinstance(func, OpOverloadPacket) else func
    return op if isinstance(op, OpOverload) and op.namespace not in ("aten", "prim", "prims") else None


def _device_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> "torch._C.DispatchKeySet":
    dev = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), torch.device("cpu"))
    return torch._C.DispatchKeySet({"cuda": torch._C.DispatchKey.CUDA}.get(dev.type, torch._C.DispatchKey.CPU))


class _SeeInside(TorchFunctionMode):
    """Runs a custom op's kernel below the dispatcher's Python key with this mode on again, so the
    modes below see the torch calls the kernel makes (the dispatch modes stay on throughout)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        op = _custom_op(func)
        if op is None:
            return func(*args, **kwargs)
        with self:
            return op.redispatch(_device_key(args, kwargs), *args, **kwargs)


class _Modes:
    """Entered: the modes in ``_modes``, in order (and left in reverse)."""

    _modes: tuple[Any, ...] = ()

    def __enter__(self) -> Any:
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)


class CountHostReads(_Modes):
    """Count host reads of tensor values (see the module docstring) while entered.

    ``count``: the reads; ``where``: for each read, in order, ``"file:line function"`` of its innermost
    three frames outside torch (innermost first, joined by ``" < "``). Reads under frames of ``exempt``
    files (substrings of their paths), or of Triton's interpreter, are not counted. Counting goes on
    after a read: the call runs as it would.
    """

    def __init__(self, *exempt: str) -> None:
        self.exempt = (TRITON_INTERPRETER, *exempt)
        self.count = 0
        self.where: list[str] = []
        self._reading = False
        counter = self

        class Functions(_SeeInside):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if not _to_host(func, args, kwargs or {}):
                    return super().__torch_function__(func, types, args, kwargs)
                counter._read(sys._getframe(1))
                counter._reading = True     # one read: not again as the scalar it dispatches (item)
                try:
                    return super().__torch_function__(func, types, args, kwargs)
                finally:
                    counter._reading = False

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func is torch.ops.aten._local_scalar_dense.default and not counter._reading:
                    counter._read(sys._getframe(1))
                return func(*args, **(kwargs or {}))

        self._modes = (Functions(), Dispatch())

    def _read(self, frame: Optional[FrameType]) -> None:
        f = frame
        while f is not None:
            if any(part in f.f_code.co_filename for part in self.exempt):
                return
            f = f.f_back
        self.count += 1
        at, chain = _caller(frame), list[str]()
        while at is not None and len(chain) < 3:
            chain.append(f"{os.path.basename(at.f_code.co_filename)}:{at.f_lineno} {at.f_code.co_name}")
            at = at.f_back
        self.where.append(" < ".join(chain) or "?")


class CountOps(_Modes):
    """Count the torch ops dispatched while entered (on a GPU, each one that computes is a launch);
    a custom op counts as the ops its kernel dispatches."""

    def __init__(self) -> None:
        self.count = 0
        counter = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                counter.count += 1
                return func(*args, **(kwargs or {}))

        self._modes = (_SeeInside(), Dispatch())
