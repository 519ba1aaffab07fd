"""WSOLA tempo change: length, pitch, timing and streaming behaviour on real signals."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.typing import NDArray

from tts_gateway.gateway.speech.time_stretch import TimeStretcher

RATE = 24_000
TONE_HZ = 300.0


def sine(seconds: float, rate: int = RATE) -> NDArray[np.float32]:
    t = np.arange(round(seconds * rate)) / rate
    samples: NDArray[np.float32] = (0.5 * np.sin(2 * np.pi * TONE_HZ * t)).astype(np.float32)
    return samples


def stretch(samples: NDArray[np.float32], speed: float, chunk: int | None = None) -> NDArray[np.float32]:
    stretcher = TimeStretcher(speed, RATE)
    step = chunk or max(samples.size, 1)
    parts = [stretcher.process(samples[i : i + step]) for i in range(0, samples.size, step)]
    parts.append(stretcher.flush())
    return np.concatenate(parts)


def dominant_frequency(samples: NDArray[np.float32]) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.size)))
    return float(np.fft.rfftfreq(samples.size, 1 / RATE)[np.argmax(spectrum)])


def rms(samples: NDArray[np.float32]) -> float:
    return float(np.sqrt(np.mean(np.square(samples, dtype=np.float64))))


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.25, 2.0, 3.0, 4.0])
def test_length_scales_and_pitch_stays(speed: float) -> None:
    out = stretch(sine(2.0), speed)

    assert out.size / RATE == pytest.approx(2.0 / speed, rel=0.01)
    assert dominant_frequency(out) == pytest.approx(TONE_HZ, abs=2)
    assert rms(out) == pytest.approx(0.5 / np.sqrt(2), rel=0.05)
    assert out.dtype == np.float32


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_streaming_matches_whole_buffer(speed: float) -> None:
    signal = sine(2.0)

    whole = stretch(signal, speed)
    streamed = stretch(signal, speed, chunk=480)

    assert streamed.size == whole.size
    np.testing.assert_allclose(streamed, whole, atol=1e-5)


def test_output_streams_before_flush() -> None:
    stretcher = TimeStretcher(2.0, RATE)
    signal = sine(1.0)

    ready = [stretcher.process(signal[i : i + 480]).size for i in range(0, RATE // 4, 480)]

    assert sum(ready) > 0


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_events_move_in_time_by_the_speed_factor(speed: float) -> None:
    # Tone bursts at known times; in the output they must start at time / speed.
    t = np.arange(2 * RATE) / RATE
    bursts = [(0.0, 0.1), (0.9, 1.0), (1.6, 1.7)]
    signal = np.zeros(t.size, dtype=np.float32)
    for start, end in bursts:
        inside = (t >= start) & (t < end)
        signal[inside] = 0.5 * np.sin(2 * np.pi * TONE_HZ * t[inside])

    out = stretch(signal, speed, chunk=960)

    window = RATE // 200
    envelope = np.array([rms(out[i : i + window]) for i in range(0, out.size - window, window)])
    onsets = np.flatnonzero(np.diff((envelope > 0.1).astype(int)) == 1) * window / RATE
    assert onsets == pytest.approx([start / speed for start, _ in bursts], abs=0.03)


def test_speed_one_is_an_exact_passthrough() -> None:
    stretcher = TimeStretcher(1.0, RATE)
    signal = sine(0.3)

    out = stretcher.process(signal)

    np.testing.assert_array_equal(out, signal)
    assert stretcher.flush().size == 0


def test_empty_input_gives_empty_output() -> None:
    assert stretch(np.zeros(0, dtype=np.float32), 2.0).size == 0


@pytest.mark.parametrize("speed", [0.0, 0.2, 4.5, -1.0])
def test_speed_out_of_range_is_rejected(speed: float) -> None:
    with pytest.raises(ValueError, match="speed"):
        TimeStretcher(speed, RATE)


def test_misuse_is_rejected() -> None:
    with pytest.raises(ValueError, match="sample rate"):
        TimeStretcher(2.0, 0)
    with pytest.raises(ValueError, match="mono"):
        TimeStretcher(2.0, RATE).process(np.zeros((2, 10), dtype=np.float32))
    stretcher = TimeStretcher(2.0, RATE)
    stretcher.flush()
    with pytest.raises(RuntimeError):
        stretcher.process(sine(0.1))
