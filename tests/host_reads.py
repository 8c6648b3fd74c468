"""A mode that fails on any host read of a tensor's value: what a device sync would be on a GPU.

On the CPU no copy is visible, so reads are caught where they start: a tensor's
value turned into a Python number (``aten._local_scalar_dense``: ``int(t)``,
``bool(t)``, ``t.item()``) or a tensor handed to the host (``tolist``,
``numpy``, ``cpu``, ``to("cpu")``). Triton's interpreter copies a kernel's
arguments to run it on the CPU: those copies are the simulated device's, and
frames under it are let through, as are the frames of any ``exempt`` file.
"""

from __future__ import annotations

from types import FrameType
from typing import Optional

from mm3_benchmarks.host_reads import TRITON_INTERPRETER, CountHostReads

__all__ = ["HostRead", "NoHostReads", "TRITON_INTERPRETER"]


class HostRead(AssertionError):
    """A tensor's value was read by the host."""


class NoHostReads(CountHostReads):
    """Raise :class:`HostRead` at the first host read of a tensor value outside the frames of ``exempt``
    files: the benchmarks' counting mode (one detection of a read for both), stopping where it counts."""

    def _read(self, frame: Optional[FrameType]) -> None:
        before = self.count
        super()._read(frame)
        if self.count > before:
            raise HostRead(f"a tensor's value read on the host ({self.where[-1]}): a device sync on a GPU")
