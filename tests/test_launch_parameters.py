"""Every launch of both Triton plugins keeps the launch parameters recorded in tests/data.

A change of the configs or the launchers that changes any grid, constexpr,
argument or launch option of any kernel, on either plugin, on either platform
or under the interpreter, fails here. No kernel runs (tests/launch_dump.py);
rewrite the file only for an intended change of what the GPU runs:
``python tests/launch_dump.py``.
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


def test_a_decode_plan_is_derived_once_per_shape_class() -> None:
    """The launch parameters of a decode step depend on shapes only: a plan is derived on the first
    step of a shape class and the same object is handed back after (a step pays a dict lookup)."""
    import torch

    from mm3_backends.cuda.tuning import NVIDIA_LAUNCH
    from mm3_backends.triton.plans import decode_attention_plan

    cfg = NVIDIA_LAUNCH.for_device_sms(132)
    shape = (cfg, 1, 1, 8, 16, 128, 128, torch.bfloat16, torch.bfloat16, False)
    plan = decode_attention_plan(*shape)
    assert decode_attention_plan(*shape) is plan
    assert (plan.flat, plan.splits, plan.merge) == (True, 16, True)
    assert decode_attention_plan(cfg, 2, *shape[2:]) is not plan
