"""The playback guard's horizon: fixed, off, or learnt from the queue's recent groups."""

from __future__ import annotations

import pytest

from tts_gateway.models.cosyvoice2.engines.playback_guard import PlaybackGuard


def test_a_fixed_guard_keeps_its_horizon_whatever_the_groups_take() -> None:
    guard = PlaybackGuard.parse("300")
    guard.record(2.0, later_chunks=True)
    assert guard.horizon_s() == pytest.approx(0.3)
    assert PlaybackGuard.parse(" 0 ").horizon_s() == 0.0


def test_the_adaptive_horizon_adds_the_longest_recent_group_of_each_kind() -> None:
    guard = PlaybackGuard.parse("auto")
    assert guard.horizon_s() == 0.0
    guard.record(0.1, later_chunks=False)
    assert guard.horizon_s() == pytest.approx(0.1)
    for seconds in (0.3, 0.2):
        guard.record(seconds, later_chunks=True)
    guard.record(0.05, later_chunks=False)
    assert guard.horizon_s() == pytest.approx(0.1 + 0.3)


def test_the_adaptive_horizon_shrinks_when_the_long_groups_leave_its_window() -> None:
    guard = PlaybackGuard(adaptive=True, window=3)
    guard.record(0.2, later_chunks=False)
    guard.record(0.8, later_chunks=True)
    for _ in range(3):
        guard.record(0.1, later_chunks=True)
    assert guard.horizon_s() == pytest.approx(0.2 + 0.1)


@pytest.mark.parametrize("value", ["", "fast", "0.5", "-1"])
def test_bad_settings_are_refused(value: str) -> None:
    with pytest.raises(ValueError):
        PlaybackGuard.parse(value)


def test_a_guard_is_fixed_or_adaptive_and_remembers_at_least_one_group() -> None:
    with pytest.raises(ValueError):
        PlaybackGuard(0.3, adaptive=True)
    with pytest.raises(ValueError):
        PlaybackGuard(adaptive=True, window=0)
