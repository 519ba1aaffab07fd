"""The watch over a process's CUDA memory: it reports steps of its high-water mark, not every wobble."""

from __future__ import annotations

import pytest
import torch

from tts_gateway.models.cosyvoice2.engines.cuda_memory import ReservedMemoryWatch

pytestmark = pytest.mark.cosyvoice

MIB = 1 << 20


def test_a_rise_is_reported_once_and_only_past_the_step() -> None:
    readings = iter([100 * MIB, 150 * MIB, 200 * MIB, 180 * MIB, 210 * MIB, 300 * MIB])
    watch = ReservedMemoryWatch(lambda: next(readings), min_step=64 * MIB)
    assert watch.rise() is None  # +50 MiB: below the step
    assert watch.rise() == (100 * MIB, 200 * MIB)
    assert watch.rise() is None  # fell back: the mark stays
    assert watch.rise() is None  # +10 MiB over the mark
    assert watch.rise() == (200 * MIB, 300 * MIB)
    assert watch.high == 300 * MIB


def test_no_watch_off_cuda() -> None:
    assert ReservedMemoryWatch.for_device(torch.device("cpu")) is None
