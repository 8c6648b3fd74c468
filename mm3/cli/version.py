"""``mm3 version`` (and ``mm3 --version``): what a bug report needs to say about this install.

mm3's version, Python, torch, Triton, the device torch computes on, and every
backend plugin discovered through the ``mm3.backends`` entry points with the
distribution and version it came from (excluded plugins too, with the reason).

The device line asks torch's accelerator API which device is current (its type,
index and how many are visible); what the device *is* is each backend's own
answer: every loaded plugin's line ends with its probe on that device (the
Triton plugins name the GPU there), so mm3 asks no question about the platform.

Example:
    >>> from mm3.cli.main import main
    >>> main(["version"])   # doctest: +ELLIPSIS
    mm3 0.1.0 (...)
    Python 3...
    torch ...
    Triton ...
    device: ...
    backend plugins:
    ...
    0
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
from pathlib import Path
from typing import Any, Optional

__all__ = ["add_arguments", "run", "report", "describe_device", "distribution_version"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def distribution_version(name: str) -> Optional[str]:
    """The installed version of distribution ``name``, or None (read from its metadata: nothing is imported).

    Example:
        >>> distribution_version("no-such-distribution-here") is None
        True
    """
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe_device() -> str:
    """The device torch computes on here: ``"TYPE:INDEX (N visible)"`` for the current accelerator,
    else ``"cpu (ARCH; ...)"``.

    Example:
        >>> first = describe_device().split()[0]
        >>> first == "cpu" or ":" in first
        True
    """
    import torch

    if not torch.accelerator.is_available():
        return f"cpu ({platform.machine() or 'unknown architecture'}; no accelerator found by torch)"
    acc = torch.accelerator.current_accelerator()
    assert acc is not None  # is_available() said there is one
    index = torch.accelerator.current_device_index()
    return f"{acc.type}:{index} ({torch.accelerator.device_count()} visible)"


def _device() -> str:
    """The device the probes are asked about: the current accelerator, else the CPU."""
    import torch

    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return "cpu" if acc is None else f"{acc.type}:{torch.accelerator.current_device_index()}"


def _plugins() -> list[dict[str, Any]]:
    """Every ``mm3.backends`` plugin the registry discovered: loaded backends, then excluded ones.

    A setting that stops the registry from loading (a bad ``MM3_PLUGINS``...) is reported as a
    row: a bug report needs the rest of the lines all the same.
    """
    from mm3.contract.errors import MM3Error
    from mm3.runtime.registry import default_registry

    try:
        reg = default_registry()
        backends = reg.backends()
    except MM3Error as e:
        return [{"name": "(registry)", "distribution": None, "version": None, "entry_point": "-",
                 "status": f"not loaded: {type(e).__name__}: {e}"}]
    device = _device()
    rows = [{"name": b.name, "distribution": b.source.distribution, "version": b.source.version,
             "entry_point": b.source.entry_point, "status": f"loaded; on {device}: {_probe(b, device)}"}
            for b in backends]
    rows += [{"name": p.name, "distribution": p.distribution, "version": p.version,
              "entry_point": p.source.entry_point, "status": f"excluded [{p.stage}]: {p.error}"}
             for p in reg.problems()]
    return rows


def _probe(backend: Any, device: str) -> str:
    got = backend.probe(device)      # a probe never raises (Backend.probe)
    return f"{'available' if got.available else 'not available'} ({got.reason})"


def _facts() -> dict[str, Any]:
    import torch

    import mm3

    return {"mm3": mm3.__version__, "mm3_path": str(Path(mm3.__file__).resolve().parent),
            "python": platform.python_version(), "python_implementation": platform.python_implementation(),
            "platform": f"{platform.system()} {platform.machine()}", "torch": torch.__version__,
            "triton": distribution_version("triton"), "device": describe_device(), "plugins": _plugins()}


def report() -> str:
    """The lines ``mm3 version`` prints."""
    f = _facts()
    lines = [f"mm3 {f['mm3']} ({f['mm3_path']})",
             f"Python {f['python']} ({f['python_implementation']}, {f['platform']})",
             f"torch {f['torch']}",
             f"Triton {f['triton']}" if f["triton"] else "Triton not installed",
             f"device: {f['device']}",
             "backend plugins:"]
    for p in f["plugins"]:
        dist = f"{p['distribution']} {p['version'] or ''}".strip() if p["distribution"] else "no distribution"
        lines.append(f"  {p['name']}: {dist} (entry point {p['entry_point']}), {p['status']}")
    if not f["plugins"]:
        lines.append("  none found (is mm3 installed? `pip install -e .` registers the built-ins)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    print(json.dumps(_facts(), indent=2) if args.json else report())
    return 0
