"""The core never imports a backend and never asks which platform it runs on (docs/architecture.md)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "mm3"
FORBIDDEN_PATTERNS = [
    (re.compile(r"is_rocm|is_hip|is_cuda_platform"), "platform predicate"),
    (re.compile(r"torch\.version\.(hip|cuda)"), "torch build check"),
    (re.compile(r"get_device_name|get_device_properties|device_name"), "device-name test"),
    (re.compile(r"\b(nvidia|amd|rocm|hopper|h100|h200|mi300)\b", re.IGNORECASE), "vendor name in code"),
]


def _core_files() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def _code_without_docstrings(path: Path) -> str:
    """Source with string constants and comments blanked: prose may name vendors, code may not."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    return ast.unparse(tree)


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(CORE.parent)))
def test_core_has_no_platform_checks(path: Path) -> None:
    code = _code_without_docstrings(path)
    for pattern, what in FORBIDDEN_PATTERNS:
        m = pattern.search(code)
        assert m is None, f"{path}: {what} {m.group(0)!r} in the core; move it into a backend's probe"


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(CORE.parent)))
def test_core_imports_no_backend(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        for name in names:
            assert not name.startswith(("mm3_backends", "backends")), (
                f"{path}: imports {name}; the core finds backends through entry points only")


def test_detector_catches_a_platform_check(tmp_path: Path) -> None:
    """The guard itself must be able to fail."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nif torch.version.hip:\n    pass\n")
    code = _code_without_docstrings(bad)
    assert any(p.search(code) for p, _ in FORBIDDEN_PATTERNS)


def test_importing_mm3_loads_no_backend_no_benchmark_and_no_triton() -> None:
    code = ("import sys, mm3, mm3.runtime.layer, mm3.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('mm3_backends', 'backends', 'mm3_benchmarks', 'benchmarks', 'triton')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
