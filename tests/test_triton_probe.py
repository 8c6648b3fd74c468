"""The Triton plugins' answer for CPU tensors names what is really missing first."""

from __future__ import annotations

import pytest

from mm3_backends.triton import plugin_factory


def test_without_triton_the_probe_says_so_rather_than_suggesting_the_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin_factory, "triton_missing", lambda: "Triton is not installed (pip install triton)")
    monkeypatch.setattr(plugin_factory, "_interpreter_on", lambda: False)
    probe = plugin_factory.interpreter_probe("cuda")
    assert not probe.available and "Triton is not installed" in probe.reason
    assert "TRITON_INTERPRET" not in probe.reason
