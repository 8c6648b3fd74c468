"""No tracked file uses a name that moved out of ``mm3``.

``mm3`` keeps the engine's API; the names it exported before (``mm3.Settings``,
``mm3.Registry``, ``mm3.select``...) still resolve, with a ``DeprecationWarning``
that says where they live (mm3/__init__.py). The code, tests, docs, docstrings,
examples and benchmarks use the new homes, so no reader copies a deprecated
spelling. Running code is covered too: the suite's warning filters
(pyproject.toml) turn such a warning into a failure.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import mm3

REPO = Path(__file__).resolve().parents[1]
# The files that use the old names on purpose: where they are defined, and the tests of the warning.
ON_PURPOSE = {"mm3/__init__.py", "tests/test_public_api.py", "tests/test_docs_snippets.py",
              "tests/test_warning_filters.py", "tests/test_no_moved_names.py"}

MOVED = sorted(mm3._MOVED)
_ATTRIBUTE = re.compile(r"(?<![\w.])mm3\.(" + "|".join(MOVED) + r")\b")
_IMPORT = re.compile(r"^\s*from mm3 import (\([^)]*\)|[^\n]*)", re.MULTILINE)
# Files with remaining uses, each of which must still have one (a clean file leaves the list), so the list
# only shrinks.
PENDING: dict[str, list[str]] = {}


def moved_uses(text: str) -> list[str]:
    """The moved names ``text`` uses: as ``mm3.NAME`` or in ``from mm3 import ...``.

    Example:
        >>> moved_uses("cfg = mm3.Settings()\\nfrom mm3 import SparseAttention, Registry\\nmm3.runtime.config.Settings")
        ['mm3.Settings', 'from mm3 import Registry']
    """
    found = [f"mm3.{m.group(1)}" for m in _ATTRIBUTE.finditer(text)]
    for m in _IMPORT.finditer(text):
        listed = re.sub(r"#[^\n]*", "", m.group(1)).strip("()")
        names = [n.strip().split(" as ")[0] for n in re.split(r"[,\n]", listed) if n.strip()]
        found += [f"from mm3 import {n}" for n in names if n in mm3._MOVED]
    return found


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "*.py", "*.md", "*.toml"], cwd=REPO,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [n for n in out.decode().split("\0") if n and not n.startswith("benchmarks/results/")]


def test_no_tracked_file_uses_a_moved_name() -> None:
    found = {name: uses for name in _tracked() if name not in ON_PURPOSE
             and (uses := moved_uses((REPO / name).read_text(errors="replace")))}
    for name, uses in PENDING.items():
        assert found.pop(name, None) == uses, f"{name} no longer uses {uses}: remove it from PENDING"
    bad = found
    assert not bad, "use the new homes (see mm3/__init__.py _MOVED): " + "; ".join(
        f"{name}: {', '.join(uses)}" for name, uses in sorted(bad.items()))


def test_the_pattern_knows_the_current_api_from_the_old() -> None:
    assert moved_uses("mm3.SparseAttention(p); mm3.plugin.BackendCapabilities; mm3.selection") == []
    assert moved_uses("mm3.BackendCapabilities(name='x')") == ["mm3.BackendCapabilities"]
    assert moved_uses("from mm3 import (\n    Settings,\n    use_backend,\n)\n") == ["from mm3 import Settings"]
