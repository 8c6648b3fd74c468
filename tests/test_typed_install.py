"""A user's type checker sees mm3's types after the README's install.

mm3 ships ``py.typed``; whether mypy finds it depends on how the package was
installed. README's ``pip install -e .`` uses setuptools' strict editable mode
(pyproject.toml, ``[tool.distutils.editable_wheel]``): a plain ``.pth`` path entry
that mypy follows, where the default mode's import hook is invisible to it. This
runs mypy (a ``test`` extra) as a user would: on their own file, in their own
folder, against the interpreter mm3 is installed in.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

USER_CODE = textwrap.dedent("""
    import mm3

    version: int = mm3.__version__          # a str: mypy must say so
    params = mm3.SparseAttentionParams.minimax_m3(tp_size=8)
    reveal_type(params.head_dim)
    reveal_type(mm3.SparseAttention)
""")

# Third-party packages mm3 imports are not followed: the check is about mm3 (and stays a few seconds).
MYPY_INI = textwrap.dedent("""
    [mypy]
    [mypy-torch.*,numpy.*,pydantic.*,pydantic_settings.*,pluggy.*,triton.*,tomli.*]
    follow_imports = skip
""")


def test_mypy_finds_mm3_and_its_types(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    (tmp_path / "user.py").write_text(USER_CODE)
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    r = subprocess.run([sys.executable, "-m", "mypy", "--python-executable", sys.executable, "--config-file",
                        "mypy.ini", "--cache-dir", str(tmp_path / ".mypy_cache"), "--no-error-summary", "user.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert "Cannot find implementation or library stub" not in out, (
        "mypy does not see the installed mm3 (an editable install through an import hook?):\n" + out)
    assert re.search(r'user\.py:4: error: Incompatible types in assignment \(expression has type "str", '
                     r'variable has type "int"\)', out), out
    assert re.search(r'user\.py:6: note: Revealed type is "(builtins\.)?int"', out), out
    assert re.search(r'user\.py:7: note: Revealed type is "def .*mm3\.runtime\.layer\.SparseAttention', out), out
