"""Hop schedule and HiFT chunk joining, checked on exactly known signals."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch import Tensor

from tts_gateway.models.cosyvoice2.model.hift_stream import HiftStreamState, hamming_crossfade
from tts_gateway.models.cosyvoice2.orchestrator.streaming import HopPolicy, HopSchedule

pytestmark = pytest.mark.cosyvoice

RATE = 24_000
SAMPLES_PER_FRAME = 480
TONE_HZ = 220.0
AMPLITUDE = 0.8


def hops(schedule: HopSchedule, count: int) -> list[int]:
    return [schedule.next_hop(i) for i in range(count)]


# --- hop schedule ---------------------------------------------------------------------------------


def test_fixed_policy_keeps_the_base_hop_after_a_short_first_hop() -> None:
    assert hops(HopSchedule(policy=HopPolicy.FIXED), 5) == [15, 25, 25, 25, 25]


def test_exponential_policy_doubles_from_the_base_hop() -> None:
    assert hops(HopSchedule(policy=HopPolicy.EXPONENTIAL), 6) == [15, 25, 50, 100, 200, 400]


def test_exponential_policy_respects_the_cap() -> None:
    assert hops(HopSchedule(policy=HopPolicy.EXPONENTIAL, max_hop=100), 6) == [15, 25, 50, 100, 100, 100]


def test_exponential_policy_stays_bounded_for_very_long_streams() -> None:
    assert HopSchedule(max_hop=100).next_hop(10_000) == 100


def test_time_based_policy_grows_only_while_well_ahead_of_real_time() -> None:
    schedule = HopSchedule(policy=HopPolicy.TIME_BASED)
    assert schedule.next_hop(0) == 15
    # 40 tokens (1.6 s of audio) in 0.1 s over 2 chunks: 30 chunk-times ahead -> one hop beyond the queue.
    assert schedule.next_hop(2, emitted_tokens=40, pending_tokens=40, elapsed_s=0.1) == 45
    # 1.6 s of audio in 1.0 s over 2 chunks: 1.2 chunk-times ahead -> back to the first hop.
    assert schedule.next_hop(2, emitted_tokens=40, pending_tokens=40, elapsed_s=1.0) == 15
    # 1.6 s in 0.6 s over 2 chunks: 3.3 chunk-times ahead -> take the whole hops already queued.
    assert schedule.next_hop(2, emitted_tokens=40, pending_tokens=40, elapsed_s=0.6) == 30
    # Behind real time: never below the first hop.
    assert schedule.next_hop(3, emitted_tokens=40, pending_tokens=2, elapsed_s=5.0) == 15


def test_time_based_policy_respects_the_cap_and_needs_a_measurement() -> None:
    schedule = HopSchedule(policy=HopPolicy.TIME_BASED, max_hop=30)
    assert schedule.next_hop(2, emitted_tokens=40, pending_tokens=200, elapsed_s=0.1) == 30
    assert schedule.next_hop(1, emitted_tokens=15, pending_tokens=200, elapsed_s=0.0) == 15


def test_catching_up_takes_the_largest_ladder_hop_the_pending_tokens_cover() -> None:
    schedule = HopSchedule(max_hop=100)
    # Pending tokens include the 3 look-ahead tokens the chunk also needs.
    assert [schedule.catch_up_hop(25, pending) for pending in (28, 52, 53, 102, 103, 400)] == [25, 25, 50, 50, 100, 100]
    assert schedule.catch_up_hop(100, 400) == 100
    # A cap off the doubling ladder is a hop of its own.
    assert HopSchedule(base_hop=30, max_hop=100).catch_up_hop(30, 103) == 100
    assert HopSchedule(base_hop=30, max_hop=100).catch_up_hop(30, 102) == 60


def test_catching_up_without_a_cap_doubles_as_far_as_the_tokens_go() -> None:
    assert HopSchedule().catch_up_hop(25, 403) == 400
    assert HopSchedule().catch_up_hop(25, 402) == 200


def test_catching_up_only_moves_the_exponential_ladder_and_can_be_turned_off() -> None:
    assert HopSchedule(policy=HopPolicy.FIXED).catch_up_hop(25, 400) == 25
    assert HopSchedule(policy=HopPolicy.TIME_BASED).catch_up_hop(15, 400) == 15
    assert HopSchedule(catch_up=False).catch_up_hop(25, 400) == 25


def test_a_chunk_is_emitted_once_hop_plus_lookahead_tokens_are_unconsumed() -> None:
    schedule = HopSchedule()
    # 17 tokens are too few for the first chunk, 18 enough; 42 too few for the second, 43 enough.
    assert schedule.chunk_end(token_offset=0, hop=15) == 18
    assert schedule.chunk_end(token_offset=15, hop=25) == 43


def test_driving_a_stream_converts_every_token_exactly_once() -> None:
    schedule = HopSchedule(max_hop=100)
    total, offset, chunk, spans = 260, 0, 0, []
    for available in range(1, total + 1):
        hop = schedule.next_hop(chunk)
        if available >= schedule.chunk_end(offset, hop):
            spans.append((offset, offset + hop))
            offset, chunk = offset + hop, chunk + 1
    spans.append((offset, total))  # the final chunk takes the rest, look-ahead included
    assert [b - a for a, b in spans] == [15, 25, 50, 100, 70]
    assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(spans))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"first_hop": 0},
        {"base_hop": 0},
        {"max_hop": 10},
        {"max_first_hop": 10},
        {"pre_lookahead": -1},
        {"token_rate": 0.0},
        {"policy": "x"},
    ],
)
def test_invalid_schedules_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        HopSchedule(**kwargs)  # type: ignore[arg-type]


# --- cross-fade -----------------------------------------------------------------------------------


def test_normalized_ramps_keep_the_hamming_shape_and_sum_to_one() -> None:
    fade_in, fade_out = hamming_crossfade(3840)
    torch.testing.assert_close(fade_in + fade_out, torch.ones(3840))
    assert fade_in[0] < 0.1 and fade_out[0] > 0.9 and torch.all(fade_in[1:] >= fade_in[:-1])


def test_raw_ramps_are_upstreams_hamming_halves() -> None:
    fade_in, fade_out = hamming_crossfade(3840, normalized=False)
    window = np.hamming(7680)
    np.testing.assert_allclose(fade_in.numpy(), window[:3840], rtol=1e-6)
    np.testing.assert_allclose(fade_out.numpy(), window[3840:], rtol=1e-6)


# --- HiFT stream state with a vocoder whose output is known exactly -------------------------------


class ToneVocoder:
    """Stands in for HiFT: frame ``f`` (its index is stored in mel channel 0) becomes 480 samples
    of one continuous tone, so every chunk's audio is known exactly. ``phase_jitter`` shifts each
    call's tone by a random phase, the way a real vocoder's overlap differs from chunk to chunk."""

    def __init__(self, phase_jitter: float = 0.0, seed: int = 0) -> None:
        self.phase_jitter = phase_jitter
        self.rng = np.random.default_rng(seed)
        self.calls: list[tuple[Tensor, Tensor | None]] = []

    def __call__(self, mel: Tensor, cache_source: Tensor | None) -> tuple[Tensor, Tensor]:
        self.calls.append((mel, cache_source))
        first_frame = int(mel[0, 0, 0])
        n = mel.shape[2] * SAMPLES_PER_FRAME
        shift = self.rng.uniform(-self.phase_jitter, self.phase_jitter)
        wav = tone(first_frame * SAMPLES_PER_FRAME, n, shift)
        return wav[None], wav[None, None].clone()


def tone(start: int, count: int, phase: float = 0.0) -> Tensor:
    t = torch.arange(start, start + count, dtype=torch.float64) / RATE
    return (AMPLITUDE * torch.sin(2 * math.pi * TONE_HZ * t + phase)).float()


def frames(start: int, count: int) -> Tensor:
    mel = torch.zeros(1, 80, count)
    mel[0, 0] = torch.arange(start, start + count, dtype=torch.float32)
    return mel


def stream(state: HiftStreamState, vocoder: ToneVocoder, chunk_frames: list[int]) -> tuple[Tensor, list[int]]:
    """Feed consecutive chunks (the last one final); returns the joined audio and the join positions."""
    pieces, joins, start = [], [], 0
    for index, count in enumerate(chunk_frames):
        final = index == len(chunk_frames) - 1
        pieces.append(state.step(frames(start, count), vocoder, final=final))
        joins.append(sum(p.shape[0] for p in pieces))
        start += count
    return torch.cat(pieces), joins[:-1]


CHUNKS = [30, 50, 100, 37]


def test_joined_chunks_reproduce_the_continuous_signal() -> None:
    audio, _ = stream(HiftStreamState(), ToneVocoder(), CHUNKS)
    expected = tone(0, sum(CHUNKS) * SAMPLES_PER_FRAME)
    assert audio.shape == expected.shape
    torch.testing.assert_close(audio, expected, atol=1e-5, rtol=0)


def test_samples_out_equal_samples_in_and_tails_are_withheld() -> None:
    state, vocoder = HiftStreamState(), ToneVocoder()
    first = state.step(frames(0, 30), vocoder, final=False)
    assert first.shape[0] == 30 * 480 - 3840  # 10560 samples: upstream's first chunk of 15 tokens
    second = state.step(frames(30, 50), vocoder, final=False)
    assert second.shape[0] == 50 * 480
    last = state.step(frames(80, 5), vocoder, final=True)
    assert last.shape[0] == 5 * 480 + 3840
    assert first.shape[0] + second.shape[0] + last.shape[0] == 85 * 480
    assert state.finished


def test_later_chunks_revocode_the_cached_frames_with_the_cached_source() -> None:
    state, vocoder = HiftStreamState(), ToneVocoder()
    state.step(frames(0, 30), vocoder, final=False)
    state.step(frames(30, 50), vocoder, final=True)
    (first_mel, first_cache), (second_mel, second_cache) = vocoder.calls
    assert first_cache is None
    assert second_mel.shape[2] == 8 + 50
    torch.testing.assert_close(second_mel[:, :, :8], first_mel[:, :, -8:])
    assert second_cache is not None
    torch.testing.assert_close(second_cache[0, 0], tone(22 * 480, 3840))


def test_recomputed_cached_frames_are_revocoded_instead_of_the_kept_ones() -> None:
    state, vocoder = HiftStreamState(), ToneVocoder()
    state.step(frames(0, 30), vocoder, final=False)
    with pytest.raises(ValueError, match="expected cached frames of shape"):
        state.recompute_cached(frames(22, 7))
    finer = frames(22, 8) + 0.5
    state.recompute_cached(finer)
    state.step(frames(30, 50), vocoder, final=True)
    second_mel = vocoder.calls[1][0]
    torch.testing.assert_close(second_mel[:, :, :8], finer)
    torch.testing.assert_close(second_mel[:, :, 8:], frames(30, 50))


def max_step(audio: Tensor, positions: list[int], radius: int) -> tuple[float, float]:
    """Largest |x[n+1] - x[n]| within ``radius`` samples of the joins, and everywhere else."""
    steps = (audio[1:] - audio[:-1]).abs()
    near = torch.zeros_like(steps, dtype=torch.bool)
    for position in positions:
        near[max(0, position - radius) : position + radius] = True
    return float(steps[near].max()), float(steps[~near].max())


def test_crossfade_hides_joins_between_chunks_that_disagree() -> None:
    # Each vocoder call's tone is shifted by up to 0.15 rad, so the overlaps no longer match.
    audio, joins = stream(HiftStreamState(), ToneVocoder(phase_jitter=0.15, seed=3), CHUNKS)
    # The overlap starts where the previous chunk's emitted audio ended and lasts 3840 samples.
    near_joins, elsewhere = max_step(audio, joins, radius=3840)
    # A Hamming ramp starts at 0.08, not 0: 7.4 % of the two chunks' difference remains as a step.
    assert near_joins < 1.4 * elsewhere


def test_a_hard_splice_of_the_same_chunks_would_click() -> None:
    """Control for the test above: without the cross-fade the same chunks jump at the joins."""
    vocoder = ToneVocoder(phase_jitter=0.15, seed=3)
    pieces, start = [], 0
    for count in CHUNKS:
        pieces.append(vocoder(frames(start, count), None)[0][0])
        start += count
    audio = torch.cat(pieces)
    joins = list(np.cumsum([c * SAMPLES_PER_FRAME for c in CHUNKS[:-1]]))
    near_joins, elsewhere = max_step(audio, joins, radius=2)
    assert near_joins > 2 * elsewhere


def test_upstreams_raw_hamming_halves_bump_the_gain_at_every_join() -> None:
    audio, _ = stream(HiftStreamState(normalized_crossfade=False), ToneVocoder(), CHUNKS)
    expected = tone(0, sum(CHUNKS) * SAMPLES_PER_FRAME)
    # The raw halves add up to ~1.08, so identical overlaps come out ~8 % louder.
    assert 0.05 < float((audio - expected).abs().max()) < 0.1


def test_a_first_chunk_shorter_than_the_cache_keeps_the_bookkeeping_exact() -> None:
    audio, _ = stream(HiftStreamState(), ToneVocoder(), [3, 40, 6])
    torch.testing.assert_close(audio, tone(0, 49 * 480), atol=1e-5, rtol=0)


def test_a_final_chunk_without_new_frames_flushes_the_tail() -> None:
    state, vocoder = HiftStreamState(), ToneVocoder()
    head = state.step(frames(0, 30), vocoder, final=False)
    tail = state.step(frames(30, 0), vocoder, final=True)
    assert tail.shape[0] == 3840
    torch.testing.assert_close(torch.cat([head, tail]), tone(0, 30 * 480), atol=1e-5, rtol=0)


def test_an_empty_stream_yields_no_audio() -> None:
    state = HiftStreamState()
    assert state.step(frames(0, 0), ToneVocoder(), final=True).shape[0] == 0
    assert state.finished


def test_a_finished_stream_refuses_more_chunks() -> None:
    state, vocoder = HiftStreamState(), ToneVocoder()
    state.step(frames(0, 10), vocoder, final=True)
    with pytest.raises(RuntimeError):
        state.step(frames(10, 10), vocoder, final=False)


def test_sizes_are_parameters() -> None:
    state = HiftStreamState(mel_cache_frames=4, samples_per_frame=480)
    assert state.overlap_samples == 1920
    first = state.step(frames(0, 20), ToneVocoder(), final=False)
    assert first.shape[0] == 20 * 480 - 1920
