"""Token2Wav with the real flow and HiFT on a tiny random-weight checkpoint in the official layout."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

from tts_gateway.models.cosyvoice2.engines.cuda_memory import STEP_LOG_PREFIX, ReservedMemoryWatch
from tts_gateway.models.cosyvoice2.engines.token2wav import Conversion, StreamStateError, Token2Wav
from tts_gateway.models.cosyvoice2.model.frontend import VoicePrompt
from tts_gateway.models.cosyvoice2.model.hift_stream import HiftStreamState

pytestmark = pytest.mark.cosyvoice

SAMPLES_PER_TOKEN = 960
PROMPT_TOKENS = 12
LOOKAHEAD = 3
MIB = 1 << 20


@pytest.fixture(scope="module")
def t2w(token2wav_dir: Path) -> Token2Wav:
    return Token2Wav.from_model_dir(token2wav_dir, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompt() -> VoicePrompt:
    rng = np.random.default_rng(0)
    return VoicePrompt(
        speech_tokens=rng.integers(0, 6561, PROMPT_TOKENS),
        feats=rng.standard_normal((2 * PROMPT_TOKENS, 80)).astype(np.float32),
        embedding=rng.standard_normal(192).astype(np.float32),
    )


def speech_tokens(count: int, seed: int = 1) -> NDArray[np.int64]:
    return np.random.default_rng(seed).integers(0, 6561, count)


def stream(
    t2w: Token2Wav, request_id: str, tokens: NDArray[np.int64], prompt: VoicePrompt, hops: list[int]
) -> list[NDArray[np.float32]]:
    """Convert ``tokens`` in chunks of ``hops`` tokens (plus look-ahead), then a final chunk."""
    chunks, offset = [], 0
    for hop in hops:
        chunks.append(t2w.stream_chunk(request_id, tokens[: offset + hop + LOOKAHEAD], prompt, offset, False))
        offset += hop
    chunks.append(t2w.stream_chunk(request_id, tokens, prompt, offset, True))
    return chunks


def test_offline_yields_960_samples_per_token(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    wav = t2w.offline(speech_tokens(40), prompt)
    assert t2w.sample_rate == 24_000
    assert wav.dtype == np.float32 and wav.shape == (40 * SAMPLES_PER_TOKEN,)
    assert np.isfinite(wav).all()
    assert float(np.abs(wav).max()) <= 0.99
    assert float(wav.std()) > 1e-3


def test_offline_is_deterministic(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    tokens = speech_tokens(30)
    np.testing.assert_array_equal(t2w.offline(tokens, prompt), t2w.offline(tokens, prompt))


@pytest.mark.parametrize(("speed", "frames"), [(2.0, 30), (0.5, 120), (1.5, 40)])
def test_speed_stretches_the_mel_before_vocoding(
    t2w: Token2Wav, prompt: VoicePrompt, speed: float, frames: int
) -> None:
    wav = t2w.offline(speech_tokens(30), prompt, speed=speed)
    assert wav.shape == (frames * 480,)
    assert float(wav.std()) > 1e-3


@pytest.mark.parametrize("speed", [0.0, -1.0, float("nan"), float("inf")])
def test_invalid_speed_is_rejected(t2w: Token2Wav, prompt: VoicePrompt, speed: float) -> None:
    with pytest.raises(ValueError, match="speed"):
        t2w.offline(speech_tokens(10), prompt, speed=speed)


def test_offline_needs_tokens(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    with pytest.raises(ValueError, match="no speech tokens"):
        t2w.offline(np.zeros(0, dtype=np.int64), prompt)


def test_a_stream_emits_every_sample_once_with_upstreams_first_chunk_size(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    tokens = speech_tokens(70)
    chunks = stream(t2w, "request-a", tokens, prompt, [15, 25])
    # 15 tokens = 30 frames = 14400 samples, minus the 3840 withheld for the cross-fade.
    assert [chunk.shape[0] for chunk in chunks] == [10_560, 25 * 960, 30 * 960 + 3840]
    joined = np.concatenate(chunks)
    assert joined.shape == t2w.offline(tokens, prompt).shape
    assert np.isfinite(joined).all() and float(joined.std()) > 1e-3
    assert t2w.active_streams == 0


def test_a_single_final_chunk_equals_offline_synthesis(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    tokens = speech_tokens(25)
    np.testing.assert_array_equal(t2w.stream_chunk("once", tokens, prompt, 0, True), t2w.offline(tokens, prompt))


def test_concurrent_streams_do_not_mix(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    requests = {f"request-{i}": speech_tokens(36, seed=10 + i) for i in range(2)}
    alone = {key: stream(t2w, key, tokens, prompt, [15]) for key, tokens in requests.items()}
    start = threading.Barrier(len(requests))

    def run(key: str) -> list[NDArray[np.float32]]:
        start.wait()
        return stream(t2w, key, requests[key], prompt, [15])

    with ThreadPoolExecutor(len(requests)) as pool:
        together = dict(zip(requests, pool.map(run, requests), strict=True))
    for key in requests:
        for expected, actual in zip(alone[key], together[key], strict=True):
            np.testing.assert_array_equal(actual, expected)
    assert t2w.active_streams == 0


def test_an_empty_request_id_is_rejected(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        t2w.stream_chunk("", speech_tokens(18), prompt, 0, False)


def test_continuing_an_unknown_stream_is_an_error(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    with pytest.raises(StreamStateError, match="unknown"):
        t2w.stream_chunk("never-started", speech_tokens(43), prompt, 15, False)


def test_a_chunk_must_start_where_the_previous_one_stopped(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    tokens = speech_tokens(60)
    t2w.stream_chunk("gap", tokens[:18], prompt, 0, False)
    with pytest.raises(StreamStateError, match="converted 15 tokens"):
        t2w.stream_chunk("gap", tokens[:48], prompt, 20, False)
    # A second request reusing the id from the start is refused too, instead of sharing the state.
    with pytest.raises(StreamStateError, match="token_offset 0"):
        t2w.stream_chunk("gap", tokens[:18], prompt, 0, False)
    t2w.release("gap")


def test_one_request_cannot_run_two_chunks_at_once(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    tokens = speech_tokens(18)
    start = threading.Barrier(2)

    def first_chunk() -> str:
        start.wait()
        try:
            t2w.stream_chunk("twice", tokens, prompt, 0, False)
        except StreamStateError:
            return "refused"
        return "converted"

    with ThreadPoolExecutor(2) as pool:
        outcomes = sorted(pool.map(lambda _: first_chunk(), range(2)))
    assert outcomes == ["converted", "refused"]
    t2w.release("twice")


def test_tokens_must_reach_past_the_offset_and_look_ahead(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    with pytest.raises(ValueError, match="look-ahead"):
        t2w.stream_chunk("short", speech_tokens(2), prompt, 0, False)
    assert t2w.active_streams == 0


def test_finalize_and_release_drop_the_state(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    tokens = speech_tokens(40)
    t2w.stream_chunk("done", tokens[:18], prompt, 0, False)
    t2w.stream_chunk("cancelled", tokens[:18], prompt, 0, False)
    assert t2w.active_streams == 2
    t2w.stream_chunk("done", tokens, prompt, 15, True)
    t2w.release("cancelled")
    t2w.release("cancelled")
    assert t2w.active_streams == 0
    with pytest.raises(StreamStateError):
        t2w.stream_chunk("cancelled", tokens, prompt, 15, True)
    # A finished id may start a new stream from scratch.
    assert t2w.stream_chunk("done", tokens, prompt, 0, True).shape == (40 * SAMPLES_PER_TOKEN,)


def test_a_failing_chunk_drops_the_state(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    tokens = speech_tokens(40)
    t2w.stream_chunk("broken", tokens[:18], prompt, 0, False)
    other_voice = VoicePrompt(
        speech_tokens=prompt.speech_tokens, feats=prompt.feats, embedding=np.zeros(64, dtype=np.float32)
    )
    with pytest.raises(ValueError, match="embedding"):
        t2w.stream_chunk("broken", tokens, other_voice, 15, True)
    assert t2w.active_streams == 0


def test_idle_states_expire(token2wav_dir: Path, t2w: Token2Wav, prompt: VoicePrompt) -> None:
    now = [0.0]
    expiring = Token2Wav(t2w.flow, t2w.hift, state_ttl_s=60.0, clock=lambda: now[0])
    tokens = speech_tokens(40)
    expiring.stream_chunk("abandoned", tokens[:18], prompt, 0, False)
    now[0] = 59.0
    assert expiring.evict_stale() == 0
    expiring.stream_chunk("live", tokens[:18], prompt, 0, False)
    now[0] = 61.0
    assert expiring.evict_stale() == 1
    assert expiring.active_streams == 1
    # Eviction also runs on every chunk: starting "another" drops "live", idle since 59 s.
    now[0] = 121.0
    expiring.stream_chunk("another", tokens[:18], prompt, 0, False)
    assert expiring.active_streams == 1
    with pytest.raises(StreamStateError, match="expired"):
        expiring.stream_chunk("live", tokens, prompt, 15, True)


def test_a_rise_of_its_cuda_memory_is_logged_with_the_work_that_took_it(
    t2w: Token2Wav, prompt: VoicePrompt, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    readings = iter([0, 0, 512 * MIB])
    monkeypatch.setattr(t2w, "memory_watch", ReservedMemoryWatch(lambda: next(readings)))
    tokens = speech_tokens(20)
    with caplog.at_level(logging.INFO, logger="tts_gateway.models.cosyvoice2.engines.token2wav"):
        t2w.offline(tokens, prompt)  # the watch reads 0: nothing to say
        assert not [r for r in caplog.records if "CUDA memory" in r.message]
        t2w.offline(tokens, prompt)
    (line,) = [r.getMessage() for r in caplog.records if "CUDA memory" in r.message]
    # 12 prompt + 20 target tokens, 2 mel frames a token; without graphs every call is solved and vocoded eagerly.
    assert line == (
        "CUDA memory reserved rose from 0 to 512 MiB while converting 1 calls of up to 64 mel frames"
        " (flow solved eagerly: 1 x 64 frames; HiFT batches vocoded eagerly: 1 x 40 frames)"
    )
    assert line.startswith(STEP_LOG_PREFIX)  # what the memory soak's report collects


def test_the_reserving_call_runs_the_padded_path_and_leaves_the_global_generator_alone(
    t2w: Token2Wav, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made at load on CUDA only; here on the CPU for its shapes and its draws."""
    vocoded: list[tuple[tuple[int, ...], bool]] = []
    vocode = t2w.hift.vocode

    def recording(mel: torch.Tensor, *args: Any) -> Any:
        vocoded.append((tuple(mel.shape), args[2] is not None))
        return vocode(mel, *args)

    monkeypatch.setattr(t2w.hift, "vocode", recording)
    state = torch.get_rng_state()
    t2w._reserve_eager_vocoding()
    assert torch.equal(torch.get_rng_state(), state)
    assert vocoded == [((32, 80, 100), True)]


def test_a_first_chunk_can_be_solved_in_fewer_steps_than_the_rest(
    t2w: Token2Wav, prompt: VoicePrompt, monkeypatch: pytest.MonkeyPatch
) -> None:
    quick = Token2Wav(t2w.flow, t2w.hift, n_timesteps=10, first_chunk_timesteps=5)
    five = Token2Wav(t2w.flow, t2w.hift, n_timesteps=5)
    tokens = speech_tokens(70, seed=5)
    full_chunks = stream(t2w, "full", tokens, prompt, [15, 25])
    five_first = stream(five, "five", tokens, prompt, [15, 25])[0]
    steps: list[int] = []
    mels: list[torch.Tensor] = []
    solve = t2w.flow.inference_batch

    def counted(items: Any, **kwargs: Any) -> Any:
        steps.append(kwargs["n_timesteps"])
        solved = solve(items, **kwargs)
        mels.append(solved[0])
        return solved

    recomputed: list[torch.Tensor] = []
    replace = HiftStreamState.recompute_cached

    def kept(state: HiftStreamState, mel: torch.Tensor) -> None:
        recomputed.append(mel.clone())
        replace(state, mel)

    monkeypatch.setattr(t2w.flow, "inference_batch", counted)
    monkeypatch.setattr(HiftStreamState, "recompute_cached", kept)
    quick_chunks = stream(quick, "quick", tokens, prompt, [15, 25])
    assert steps == [5, 10, 10]
    # The first chunk is five steps' audio. HiFT kept its last 8 of 30 frames; the second chunk re-vocodes
    # them from its own ten-step solve, so that the change falls inside the cross-fade.
    np.testing.assert_array_equal(quick_chunks[0], five_first)
    assert float(np.abs(quick_chunks[0] - full_chunks[0]).max()) > 1e-4
    assert len(recomputed) == 1
    torch.testing.assert_close(recomputed[0][0], mels[1][:, 22:30])
    assert float((recomputed[0][0] - mels[0][:, 22:30]).abs().max()) > 1e-3
    assert [chunk.shape for chunk in quick_chunks] == [chunk.shape for chunk in full_chunks]
    joined = np.concatenate(quick_chunks)
    assert np.isfinite(joined).all() and float(joined.std()) > 1e-3
    # A first chunk that is also the last, and offline calls, take every step.
    short = speech_tokens(25, seed=6)
    del steps[:]
    once, whole = quick.stream_chunk("once", short, prompt, 0, True), quick.offline(short, prompt)
    assert steps == [10, 10]
    np.testing.assert_array_equal(once, t2w.offline(short, prompt))
    np.testing.assert_array_equal(whole, t2w.offline(short, prompt))


def test_first_chunks_solved_in_fewer_steps_are_answered_before_final_ones(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    quick = Token2Wav(t2w.flow, t2w.hift, n_timesteps=10, first_chunk_timesteps=5)
    opening, whole = speech_tokens(18, seed=7), speech_tokens(20, seed=8)
    answered: list[int] = []
    calls = [Conversion("b", whole, prompt, 0, True), Conversion("a", opening, prompt, 0, False)]
    together = quick.convert(calls, on_result=lambda index, _: answered.append(index))
    # The five-step chunk waits for no ten-step solve: its own group, answered first.
    assert answered == [1, 0]
    quick.release("a")
    alone = quick.stream_chunk("a", opening, prompt, 0, False)
    quick.release("a")
    np.testing.assert_allclose(together[1], alone, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(together[0], t2w.offline(whole, prompt), rtol=1e-4, atol=1e-5)


def test_a_coarse_first_chunk_shorter_than_the_kept_frames_joins_the_next(t2w: Token2Wav, prompt: VoicePrompt) -> None:
    quick = Token2Wav(t2w.flow, t2w.hift, n_timesteps=10, first_chunk_timesteps=5)
    tokens = speech_tokens(30, seed=9)
    # A first hop of 3 tokens: 6 mel frames, fewer than the 8 HiFT keeps from a chunk.
    chunks = stream(quick, "short-first", tokens, prompt, [3, 12])
    assert sum(chunk.shape[0] for chunk in chunks) == 30 * SAMPLES_PER_TOKEN
    assert np.isfinite(np.concatenate(chunks)).all()


def test_step_counts_below_one_are_refused(t2w: Token2Wav) -> None:
    with pytest.raises(ValueError, match="n_timesteps must be positive"):
        Token2Wav(t2w.flow, t2w.hift, n_timesteps=10, first_chunk_timesteps=-1)
