"""The benchmark fixture's tone: configured length, chunking, delay, cancellation."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tts_gateway.bench.fixture import VOICE, FixtureConfig, ToneSource
from tts_gateway.models.request_parsing import ContractError, SynthesisRequest

PARAMS = {"sample_rate": "24000", "audio_seconds": "1.0", "chunk_seconds": "0.3", "first_chunk_delay_ms": "0"}


def request(voice: str | None = VOICE) -> SynthesisRequest:
    return SynthesisRequest(target_text="Hello.", reference_wav=None, reference_text=None, voice=voice)


def never() -> bool:
    return False


def test_chunks_add_up_to_the_configured_duration() -> None:
    chunks = list(ToneSource(FixtureConfig.from_params(PARAMS)).synthesize(request(), never))
    assert [c.size for c in chunks] == [7200, 7200, 7200, 2400]
    audio = np.concatenate(chunks)
    assert audio.dtype == np.float32
    assert np.sqrt(np.mean(audio**2)) == pytest.approx(0.25 / np.sqrt(2), rel=0.01)
    # A 440 Hz tone: 440 rising zero crossings in one second.
    assert np.count_nonzero((audio[:-1] < 0) & (audio[1:] >= 0)) == pytest.approx(440, abs=1)


def test_first_chunk_waits_for_the_configured_delay() -> None:
    source = ToneSource(FixtureConfig.from_params({**PARAMS, "first_chunk_delay_ms": "80"}))
    started = time.monotonic()
    next(iter(source.synthesize(request(), never)))
    assert 0.08 <= time.monotonic() - started < 0.5


def test_cancelled_during_the_delay_yields_nothing() -> None:
    source = ToneSource(FixtureConfig.from_params({**PARAMS, "first_chunk_delay_ms": "5000"}))
    started = time.monotonic()
    assert list(source.synthesize(request(), lambda: time.monotonic() - started > 0.05)) == []
    assert time.monotonic() - started < 1.0


def test_only_its_own_voice() -> None:
    source = ToneSource(FixtureConfig.from_params(PARAMS))
    assert len(list(source.synthesize(request(None), never))) == 4
    with pytest.raises(ContractError, match="unknown voice"):
        list(source.synthesize(request("joe"), never))


@pytest.mark.parametrize(
    "change",
    [{"audio_seconds": "0"}, {"chunk_seconds": "-1"}, {"sample_rate": "0"}, {"first_chunk_delay_ms": "-5"}],
)
def test_config_rejects_nonsense(change: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="must be"):
        FixtureConfig.from_params({**PARAMS, **change})
