"""Every launch of both Triton plugins keeps the launch parameters recorded in tests/data.

The golden file pins the effective launches, not the shape of the config
objects, so a regrouping of the configs that changes any grid, constexpr or
launch option of any kernel, on either plugin and on either platform, fails here. No kernel runs (tests/launch_dump.py); rewrite
the file only for an intended tuning change: ``python tests/launch_dump.py``.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(pathlib.Path(__file__).parent))

from launch_dump import dump_launches  # noqa: E402

GOLDEN = pathlib.Path(__file__).parent / "data" / "launch_parameters.json"


def test_launch_parameters_match_the_recorded_ones() -> None:
    got = json.loads(json.dumps(dump_launches(), sort_keys=True))
    want = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want)
    for scenario in want:
        assert got[scenario] == want[scenario], scenario
