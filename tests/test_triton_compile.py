"""The Triton kernels compile for NVIDIA sm_90 and AMD gfx942 ahead of time, no GPU needed.

The interpreter tests prove the arithmetic; this proves that every launch the
plugins make at M3 shapes (with their real launch configurations) is accepted
by Triton's GPU compilers, including the rocm plugin's AMD-only options.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "aot_check.py"


@pytest.mark.slow   # minutes on 2 cores: python -m pytest -m slow (CI runs it)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_all_launches_compile_for_sm90_and_gfx942(tmp_path: Path) -> None:
    # Triton's compile cache goes to the test's own folder, not the user's home
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-W", "ignore", str(TOOL)],
                          env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "FAIL" not in proc.stdout and " 0 failed" in proc.stdout
