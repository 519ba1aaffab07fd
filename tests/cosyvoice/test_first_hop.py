"""The first hop sized by recent gaps to the second chunk (tts_gateway/models/cosyvoice2/orchestrator/first_hop.py)."""

from __future__ import annotations

import pytest

from tts_gateway.models.cosyvoice2.orchestrator.first_hop import AdaptiveFirstHop


def test_the_ladder_doubles_up_to_the_largest_first_hop() -> None:
    assert AdaptiveFirstHop(25, 100).ladder == [25, 50, 100]
    assert AdaptiveFirstHop(25, 60).ladder == [25, 50, 60]
    assert AdaptiveFirstHop(25, 25).ladder == [25]


def test_a_hop_plays_its_tokens_less_the_withheld_tail() -> None:
    hops = AdaptiveFirstHop(25, 100)
    assert hops.audio_s(25) == pytest.approx(0.84)
    assert hops.audio_s(50) == pytest.approx(1.84)


def test_without_gaps_the_first_hop_is_the_smallest() -> None:
    assert AdaptiveFirstHop(25, 100).begin() == 25


def test_the_smallest_hop_that_covers_the_gaps_seen_at_this_load() -> None:
    hops = AdaptiveFirstHop(25, 100, window=1)
    hops.begin()
    for gap, hop in ((0.5, 25), (0.9, 50), (2.0, 100), (9.0, 100)):
        hops.record(gap)
        assert hops.choose() == hop, gap


def test_gaps_scale_with_the_square_root_of_the_streams_in_flight() -> None:
    hops = AdaptiveFirstHop(25, 100)
    for _ in range(4):
        hops.begin()
    hops.record(0.6)  # seen with 4 streams in flight
    assert hops.choose() == 25
    assert [hops.begin() for _ in range(4)] == [25, 25, 25, 50]  # 5-8 streams: 0.67, 0.73, 0.79, 0.85 s
    for _ in range(7):
        hops.end()
    assert hops.in_flight == 1
    assert hops.choose() == 25  # 0.3 s


def test_the_load_exponent_sets_how_gaps_scale() -> None:
    proportional = AdaptiveFirstHop(25, 100, load_exponent=1.0)
    fixed = AdaptiveFirstHop(25, 100, load_exponent=0.0)
    for hops in (proportional, fixed):
        hops.begin()
        hops.record(0.5)
        hops.begin()
    assert (proportional.choose(), fixed.choose()) == (50, 25)


def test_the_upper_quartile_of_the_recent_gaps_counts() -> None:
    hops = AdaptiveFirstHop(25, 100, window=4)
    hops.begin()
    for gap in (0.3, 0.3, 0.3, 5.0):
        hops.record(gap)
    assert hops.choose() == 25, "one long gap of four is not the upper quartile"
    hops.record(5.0)
    assert hops.choose() == 100
    for gap in (0.3, 0.3, 0.3):
        hops.record(gap)
    assert hops.choose() == 25, "the long gaps left the window"


def test_ending_a_stream_that_never_began_is_a_bug() -> None:
    hops = AdaptiveFirstHop(25, 50)
    with pytest.raises(RuntimeError):
        hops.end()


@pytest.mark.parametrize(
    ("first", "largest", "options"),
    [
        (0, 50, {}),
        (50, 25, {}),
        (25, 50, {"token_rate": 0.0}),
        (25, 50, {"window": 0}),
        (25, 50, {"withheld_s": -1}),
        (25, 50, {"load_exponent": -1}),
    ],
)
def test_bad_settings_are_refused(first: int, largest: int, options: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AdaptiveFirstHop(first, largest, **options)  # type: ignore[arg-type]
