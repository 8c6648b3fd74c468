"""Scratch kept per (device, stream) for eager decode steps (backends/triton/scratch.py)."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("triton")

from mm3_backends.triton import scratch as sc  # noqa: E402

CPU = torch.device("cpu")


def test_the_same_request_gets_the_same_tensor_and_a_smaller_one_the_same_memory() -> None:
    a = sc.scratch(CPU, "t-same", (3, 5))
    assert sc.scratch(CPU, "t-same", (3, 5)) is a
    b = sc.scratch(CPU, "t-same", (2, 4))
    assert b.shape == (2, 4) and b.data_ptr() == a.data_ptr() and b.is_contiguous()
    other = sc.scratch(CPU, "t-other-slot", (3, 5))
    assert other.data_ptr() != a.data_ptr()


def test_a_larger_request_grows_the_slot() -> None:
    small = sc.scratch(CPU, "t-grow", (10,))
    big = sc.scratch(CPU, "t-grow", (1000,))
    assert big.numel() == 1000 and big.data_ptr() != small.data_ptr()
    assert sc.scratch(CPU, "t-grow", (10,)).data_ptr() == big.data_ptr()


def test_parts_are_consecutive_and_dtype_is_part_of_the_slot() -> None:
    m, l, acc = sc.scratch_parts(CPU, "t-parts", (4, 4, 12))
    size = m.element_size()
    assert (l.data_ptr() - m.data_ptr(), acc.data_ptr() - l.data_ptr()) == (4 * size, 4 * size)
    assert acc.numel() == 12 and sc.scratch_parts(CPU, "t-parts", (4, 4, 12))[2] is acc
    assert sc.scratch(CPU, "t-parts", (4,), torch.int64).dtype == torch.int64


def test_a_capture_gets_new_memory_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    kept = sc.scratch(CPU, "t-capture", (8,))
    monkeypatch.setattr(sc, "capturing", lambda device: True)
    a, b = sc.scratch(CPU, "t-capture", (8,)), sc.scratch(CPU, "t-capture", (8,))
    assert a is not b and a.data_ptr() != kept.data_ptr() and b.data_ptr() != kept.data_ptr()


def test_threads_on_the_cpu_get_their_own() -> None:
    mine = sc.scratch(CPU, "t-thread", (16,))
    theirs: list = []
    worker = threading.Thread(target=lambda: theirs.append(sc.scratch(CPU, "t-thread", (16,))))
    worker.start()
    worker.join()
    assert theirs[0].data_ptr() != mine.data_ptr()
