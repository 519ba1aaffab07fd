"""The first hop sized by recent gaps to the second chunk (tts_backends/cosyvoice2/first_hop.py)."""

from __future__ import annotations

import pytest

from tts_backends.cosyvoice2.first_hop import AdaptiveFirstHop


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chooser(clock: Clock, **overrides: object) -> AdaptiveFirstHop:
    values: dict[str, object] = {"window": 4, "horizon_s": 10.0, "clock": clock}
    values.update(overrides)
    return AdaptiveFirstHop(25, 100, **values)  # type: ignore[arg-type]


def test_the_ladder_doubles_up_to_the_largest_first_hop() -> None:
    assert AdaptiveFirstHop(25, 100).ladder == [25, 50, 100]
    assert AdaptiveFirstHop(25, 60).ladder == [25, 50, 60]
    assert AdaptiveFirstHop(25, 25).ladder == [25]


def test_a_hop_plays_its_tokens_less_the_withheld_tail() -> None:
    hops = AdaptiveFirstHop(25, 100)
    assert hops.audio_s(25) == pytest.approx(0.84)
    assert hops.audio_s(50) == pytest.approx(1.84)


def test_without_gaps_the_first_hop_is_the_smallest() -> None:
    assert chooser(Clock()).choose() == 25


def test_the_smallest_hop_that_covers_the_longest_recent_gap() -> None:
    hops = chooser(Clock())
    hops.record(0.5)
    assert hops.choose() == 25
    hops.record(0.9)
    assert hops.choose() == 50
    hops.record(2.0)
    assert hops.choose() == 100
    hops.record(9.0)
    assert hops.choose() == 100, "capped at the largest first hop"


def test_old_gaps_are_forgotten() -> None:
    clock = Clock()
    hops = chooser(clock)
    hops.record(1.5)
    clock.now += 9.0
    hops.record(0.9)
    assert hops.choose() == 50
    clock.now += 1.5
    assert hops.choose() == 50, "the 1.5 s gap is past the horizon, the 0.9 s one is not"
    clock.now += 9.0
    assert hops.choose() == 25


def test_only_the_last_window_of_gaps_counts() -> None:
    hops = chooser(Clock(), window=2)
    hops.record(2.0)
    hops.record(0.3)
    assert hops.choose() == 100
    hops.record(0.3)
    assert hops.choose() == 25


@pytest.mark.parametrize(
    ("first", "largest", "options"),
    [(0, 50, {}), (50, 25, {}), (25, 50, {"token_rate": 0.0}), (25, 50, {"window": 0}), (25, 50, {"withheld_s": -1})],
)
def test_bad_settings_are_refused(first: int, largest: int, options: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AdaptiveFirstHop(first, largest, **options)  # type: ignore[arg-type]
