"""A model process's share of the GPU under CUDA MPS: the variable the driver reads, and when it comes too late."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tts_gateway.models import mps_share
from tts_gateway.models.mps_share import VARIABLE, cuda_initialised, limit_active_threads, parse_percentage


class FakeDriver:
    """libcuda's ``cuDeviceGetCount`` answering ``status`` (3: CUDA not initialised yet)."""

    def __init__(self, status: int) -> None:
        self.status = status

    def cuDeviceGetCount(self, count: Any) -> int:
        return self.status


def driver(monkeypatch: pytest.MonkeyPatch, status: int | None) -> None:
    """libcuda as a fake answering ``status``, or missing (None)."""

    def load(name: str) -> FakeDriver:
        assert name == "libcuda.so.1"
        if status is None:
            raise OSError(name)
        return FakeDriver(status)

    monkeypatch.setattr(mps_share.ctypes, "CDLL", load)


@pytest.mark.parametrize("value", ["1", "80", "100", " 60 "])
def test_a_percentage_sets_the_variable_the_driver_reads(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    driver(monkeypatch, 3)
    assert limit_active_threads(value)
    assert os.environ[VARIABLE] == value.strip()


def test_a_limit_after_cuda_started_is_reported_too_late(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    driver(monkeypatch, 0)
    assert cuda_initialised()
    assert not limit_active_threads("80")


def test_without_a_driver_the_limit_is_set_for_nothing_to_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    driver(monkeypatch, None)
    assert not cuda_initialised()
    assert limit_active_threads("80")


@pytest.mark.parametrize("value", ["0", "101", "80.5", "most", ""])
def test_anything_but_a_whole_percentage_is_refused_and_sets_nothing(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    with pytest.raises(ValueError, match="a whole number from 1 to 100"):
        limit_active_threads(value)
    assert VARIABLE not in os.environ
    with pytest.raises(ValueError):
        parse_percentage(value)
