"""A model process's CUDA MPS client priority: the variable the driver reads, and when it comes too late."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tts_gateway.models import mps_priority
from tts_gateway.models.mps_priority import VARIABLE, cuda_initialised, set_client_priority


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

    monkeypatch.setattr(mps_priority.ctypes, "CDLL", load)


@pytest.mark.parametrize(("level", "value"), [("normal", "0"), ("below_normal", "1")])
def test_a_level_sets_the_variable_the_driver_reads(monkeypatch: pytest.MonkeyPatch, level: str, value: str) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    driver(monkeypatch, 3)
    assert set_client_priority(level)
    assert os.environ[VARIABLE] == value


def test_a_level_after_cuda_started_is_reported_too_late(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    driver(monkeypatch, 0)
    assert cuda_initialised()
    assert not set_client_priority("below_normal")


def test_without_a_driver_the_level_is_set_for_nothing_to_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    driver(monkeypatch, None)
    assert not cuda_initialised()
    assert set_client_priority("below_normal")


def test_an_unknown_level_names_the_levels_and_sets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    with pytest.raises(ValueError, match="normal, below_normal, not 'high'"):
        set_client_priority("high")
    assert VARIABLE not in os.environ
