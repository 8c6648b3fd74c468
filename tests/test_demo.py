"""`mm3 demo` as a new user runs it: what its lines say, and which hints it gives."""

from __future__ import annotations

import pytest

import mm3.cli as cli
import mm3.cli.demo as demo


def test_demo_names_the_heads_and_hints_only_what_would_help(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "SLOW_CALL_S", 0.0)         # every call counts as slow: the note is printed
    monkeypatch.setattr(demo, "STEPS", (demo.StepSpec("small", decodes=(300,), decode_query_len=1,
                                                      prefills=((16, 200),)),))
    assert cli.main(["demo", "--device", "cpu", "--backend", "cpu_ref", "--no-check", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "(8 query / 1 KV / 1 index heads, D=128, blocks of 128, top-16)" in out, out
    assert "took" in out and "--repeats 1" not in out, out   # already the shortest run: no hint to shorten it

    assert cli.main(["demo", "--device", "cpu", "--backend", "cpu_ref", "--no-check", "--repeats", "2"]) == 0
    assert "(--repeats 1 to shorten)" in capsys.readouterr().out
