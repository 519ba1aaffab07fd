"""Reference recordings in real file formats, written with libsndfile and FFmpeg."""

from __future__ import annotations

import io
import struct
import tracemalloc
from collections.abc import Callable

import av
import numpy as np
import pytest
import soundfile as sf
from av.audio.stream import AudioStream
from numpy.typing import NDArray

from tests.hostile_audio import flac_silence_bomb, wav_with_header
from tts_gateway.gateway.speech.reference_audio import (
    MAX_INPUT_SAMPLE_RATE,
    ReferenceAudio,
    ReferenceAudioError,
    load_reference_audio,
)
from tts_gateway.models.contract import REFERENCE_SAMPLE_RATE

TONE_HZ = 440.0

FileMaker = Callable[[NDArray[np.float64], int], bytes]


def voice_like(seconds: float, rate: int, channels: int = 1, level: float = 0.5) -> NDArray[np.float64]:
    """A 440 Hz tone with a syllable-rate loudness contour, shape (frames, channels)."""
    t = np.arange(round(seconds * rate)) / rate
    mono = level * np.sin(2 * np.pi * TONE_HZ * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    return np.repeat(mono[:, np.newaxis], channels, axis=1)


def with_silence(signal: NDArray[np.float64], rate: int, before: float, after: float) -> NDArray[np.float64]:
    channels = signal.shape[1]
    return np.concatenate(
        [np.zeros((round(before * rate), channels)), signal, np.zeros((round(after * rate), channels))]
    )


def soundfile_bytes(signal: NDArray[np.float64], rate: int, fmt: str = "WAV", subtype: str = "PCM_16") -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, signal, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def ffmpeg_bytes(signal: NDArray[np.float64], rate: int, container: str, codec: str) -> bytes:
    layout = "mono" if signal.shape[1] == 1 else "stereo"
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as output:
        stream = output.add_stream(codec, rate=rate, layout=layout)
        assert isinstance(stream, AudioStream)
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(signal.T, dtype=np.float32), format="fltp", layout=layout
        )
        frame.sample_rate = rate
        output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return buffer.getvalue()


def dominant_frequency(samples: NDArray[np.float32], rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.size)))
    return float(np.fft.rfftfreq(samples.size, 1 / rate)[np.argmax(spectrum)])


def assert_normalised_tone(reference: ReferenceAudio, seconds: float, tolerance: float = 0.05) -> None:
    assert reference.sample_rate == REFERENCE_SAMPLE_RATE
    assert reference.samples.ndim == 1
    assert reference.samples.dtype == np.float32
    assert reference.duration == pytest.approx(seconds, abs=tolerance)
    assert float(np.max(np.abs(reference.samples))) == pytest.approx(0.9, abs=0.01)
    assert dominant_frequency(reference.samples, REFERENCE_SAMPLE_RATE) == pytest.approx(TONE_HZ, abs=2)


@pytest.mark.parametrize(
    ("rate", "channels", "subtype"),
    [
        (8_000, 1, "PCM_U8"),
        (16_000, 1, "PCM_16"),
        (22_050, 2, "PCM_16"),
        (44_100, 1, "PCM_24"),
        (48_000, 2, "FLOAT"),
        (96_000, 1, "PCM_32"),
        (192_000, 2, "DOUBLE"),
    ],
)
def test_wav_variants(rate: int, channels: int, subtype: str) -> None:
    data = soundfile_bytes(voice_like(2.0, rate, channels), rate, subtype=subtype)

    assert_normalised_tone(load_reference_audio(data), 2.0)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda s, r: soundfile_bytes(s, r, "FLAC", "PCM_16"), id="flac"),
        pytest.param(lambda s, r: soundfile_bytes(s, r, "OGG", "VORBIS"), id="ogg-vorbis"),
        pytest.param(lambda s, r: soundfile_bytes(s, r, "AIFF", "PCM_16"), id="aiff"),
        pytest.param(lambda s, r: ffmpeg_bytes(s, r, "mp3", "libmp3lame"), id="mp3"),
        pytest.param(lambda s, r: ffmpeg_bytes(s, r, "ogg", "libopus"), id="ogg-opus"),
        pytest.param(lambda s, r: ffmpeg_bytes(s, r, "webm", "libopus"), id="webm-opus"),
        pytest.param(lambda s, r: ffmpeg_bytes(s, r, "adts", "aac"), id="aac-adts"),
        pytest.param(lambda s, r: ffmpeg_bytes(s, r, "mp4", "aac"), id="m4a"),
    ],
)
@pytest.mark.parametrize("channels", [1, 2])
def test_compressed_formats(make: FileMaker, channels: int) -> None:
    data = make(voice_like(2.0, 48_000, channels), 48_000)

    # Lossy codecs add priming samples; the trimming margin absorbs them.
    assert_normalised_tone(load_reference_audio(data), 2.0, tolerance=0.1)


def test_leading_and_trailing_silence_is_trimmed() -> None:
    rate = 24_000
    signal = with_silence(voice_like(1.5, rate), rate, before=0.7, after=0.9)

    reference = load_reference_audio(soundfile_bytes(signal, rate))

    # 0.1 s of margin is kept on each side.
    assert 1.5 <= reference.duration <= 1.5 + 0.2 + 0.02
    assert_normalised_tone(reference, 1.6, tolerance=0.11)


def test_low_noise_floor_is_trimmed_too() -> None:
    rate = 16_000
    noise = np.random.default_rng(0).normal(0, 1e-4, size=(rate, 1))
    signal = np.concatenate([noise, voice_like(1.5, rate), noise])

    reference = load_reference_audio(soundfile_bytes(signal, rate, subtype="FLOAT"))

    assert 1.5 <= reference.duration <= 1.72


def test_sound_without_silence_is_kept_whole() -> None:
    reference = load_reference_audio(soundfile_bytes(voice_like(3.0, 16_000), 16_000))

    assert reference.samples.size == 3 * REFERENCE_SAMPLE_RATE


def test_quiet_recording_is_amplified_to_the_target_peak() -> None:
    reference = load_reference_audio(soundfile_bytes(voice_like(2.0, 16_000, level=0.01), 16_000))

    assert float(np.max(np.abs(reference.samples))) == pytest.approx(0.9, abs=0.01)


def test_limits_are_configurable() -> None:
    data = soundfile_bytes(voice_like(4.0, 16_000), 16_000)

    assert load_reference_audio(data, min_seconds=3.5, max_seconds=5.0).duration == pytest.approx(4.0)
    with pytest.raises(ReferenceAudioError, match="at least 5 s"):
        load_reference_audio(data, min_seconds=5.0)
    with pytest.raises(ReferenceAudioError, match="at most 3 s"):
        load_reference_audio(data, max_seconds=3.0)


def nan_wav() -> bytes:
    signal = voice_like(2.0, 16_000)
    signal[1000] = np.nan
    return soundfile_bytes(signal, 16_000, subtype="FLOAT")


def inf_wav() -> bytes:
    signal = voice_like(2.0, 16_000)
    signal[-5] = -np.inf
    return soundfile_bytes(signal, 16_000, subtype="FLOAT")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(b"", "empty", id="empty"),
        pytest.param(b"this is a text file, not a recording\n" * 20, "could not be decoded", id="text"),
        pytest.param(np.random.default_rng(7).bytes(20_000), "could not be decoded", id="random"),
        pytest.param(soundfile_bytes(voice_like(2.0, 16_000), 16_000)[:30], "could not be decoded", id="cut-hdr"),
        pytest.param(soundfile_bytes(np.zeros((0, 1)), 16_000), "no samples", id="zero-length"),
        pytest.param(wav_with_header(1_000), "unsupported sample rate of 1000 Hz", id="rate-low"),
        pytest.param(wav_with_header(3_999), "unsupported sample rate", id="rate-just-low"),
        pytest.param(wav_with_header(MAX_INPUT_SAMPLE_RATE + 1), "unsupported sample rate", id="rate-high"),
        pytest.param(wav_with_header(2_000_000_000), "unsupported sample rate", id="rate-absurd"),
        pytest.param(nan_wav(), "NaN or infinity", id="nan"),
        pytest.param(inf_wav(), "NaN or infinity", id="inf"),
        pytest.param(soundfile_bytes(np.zeros((32_000, 1)), 16_000), "silent", id="digital-silence"),
        pytest.param(
            soundfile_bytes(voice_like(2.0, 16_000, level=5e-4), 16_000, subtype="FLOAT"),
            "silent",
            id="near-silence",
        ),
        pytest.param(soundfile_bytes(voice_like(0.6, 16_000), 16_000), "too short: 0.6 s", id="short"),
        pytest.param(
            soundfile_bytes(with_silence(voice_like(0.5, 16_000), 16_000, 2.0, 2.0), 16_000),
            "too short: 0.7 s",
            id="short-after-trim",
        ),
        pytest.param(soundfile_bytes(voice_like(31.0, 16_000), 16_000), "too long: 31.0 s", id="long"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_message(data: bytes, message: str) -> None:
    with pytest.raises(ReferenceAudioError, match=message):
        load_reference_audio(data)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda s, r: soundfile_bytes(s, r, "FLAC", "PCM_16"), id="flac"),
        pytest.param(lambda s, r: ffmpeg_bytes(s, r, "ogg", "libopus"), id="opus"),
    ],
)
def test_decoding_stops_early_on_very_long_input(make: FileMaker) -> None:
    # Ten minutes of silence compress to a few kilobytes; decoding must stop at
    # twice the allowed length instead of expanding all of it.
    data = make(np.zeros((600 * 48_000, 1)), 48_000)
    assert len(data) < 1_000_000

    with pytest.raises(ReferenceAudioError, match="runs past 60 s, at most 30 s of sound is allowed"):
        load_reference_audio(data)


def test_decompression_bomb_is_stopped_at_the_cap_with_little_memory() -> None:
    data = flac_silence_bomb()
    assert len(data) < 400_000

    tracemalloc.start()
    try:
        with pytest.raises(ReferenceAudioError, match="runs past 20 s"):
            load_reference_audio(data, max_seconds=10.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Decoding it all would take 330 MB; up to the cap it is 20 s at 8 kHz, plus one block.
    assert peak < 8 * 1024 * 1024


def test_header_claiming_more_data_than_present_decodes_what_is_there() -> None:
    data = bytearray(soundfile_bytes(voice_like(2.0, 16_000), 16_000))
    struct.pack_into("<I", data, 40, 0x7FFFFFF0)  # data chunk size

    assert load_reference_audio(bytes(data)).duration == pytest.approx(2.0, abs=0.01)


def test_many_channels_are_mixed_down() -> None:
    data = soundfile_bytes(voice_like(2.0, 16_000, channels=64), 16_000)

    assert_normalised_tone(load_reference_audio(data), 2.0)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda s, r: soundfile_bytes(s, r), id="wav"),
        pytest.param(lambda s, r: soundfile_bytes(s, r, "FLAC", "PCM_16"), id="flac"),
        pytest.param(lambda s, r: ffmpeg_bytes(s, r, "mp3", "libmp3lame"), id="mp3"),
        pytest.param(lambda s, r: ffmpeg_bytes(s, r, "ogg", "libopus"), id="opus"),
        pytest.param(lambda s, r: ffmpeg_bytes(s, r, "adts", "aac"), id="aac"),
        pytest.param(lambda s, r: ffmpeg_bytes(s, r, "mp4", "aac"), id="m4a"),
    ],
)
def test_damaged_files_never_raise_anything_else(make: FileMaker) -> None:
    original = make(voice_like(2.0, 24_000, channels=2), 24_000)
    rng = np.random.default_rng(1234)
    for attempt in range(40):
        if attempt % 2:
            damaged = original[: int(rng.integers(1, len(original)))]
        else:
            mutable = bytearray(original)
            for position in rng.integers(0, len(original), size=int(rng.integers(1, 30))):
                mutable[position] = int(rng.integers(0, 256))
            damaged = bytes(mutable)
        try:
            reference = load_reference_audio(damaged)
        except ReferenceAudioError:
            continue
        assert 1.0 <= reference.duration <= 30.0
        assert np.all(np.isfinite(reference.samples))
        assert float(np.max(np.abs(reference.samples))) == pytest.approx(0.9, abs=0.01)


def test_truncated_file_keeps_its_first_part() -> None:
    data = ffmpeg_bytes(voice_like(3.0, 24_000), 24_000, "adts", "aac")

    reference = load_reference_audio(data[: len(data) // 2])

    assert reference.duration == pytest.approx(1.5, abs=0.2)


def test_sha256_is_stable_and_content_addressed() -> None:
    data = soundfile_bytes(voice_like(2.0, 22_050), 22_050)

    first = load_reference_audio(data)
    second = load_reference_audio(data)
    other = load_reference_audio(soundfile_bytes(voice_like(2.5, 22_050), 22_050))

    assert first.sha256() == second.sha256()
    assert len(first.sha256()) == 64
    assert int(first.sha256(), 16) >= 0
    assert first.sha256() != other.sha256()


def test_to_wav_bytes_round_trips() -> None:
    reference = load_reference_audio(soundfile_bytes(voice_like(2.0, 44_100, channels=2), 44_100))

    wav = reference.to_wav_bytes()

    info = sf.info(io.BytesIO(wav))
    assert (info.format, info.subtype, info.samplerate, info.channels) == ("WAV", "PCM_16", 16_000, 1)
    samples, _ = sf.read(io.BytesIO(wav), dtype="float32")
    np.testing.assert_allclose(samples, reference.samples, atol=1 / 32_000)
    reloaded = load_reference_audio(wav)
    assert reloaded.samples.size == reference.samples.size


def test_reference_audio_is_immutable_and_checked() -> None:
    reference = load_reference_audio(soundfile_bytes(voice_like(2.0, 16_000), 16_000))

    with pytest.raises(ValueError, match="read-only"):
        reference.samples[0] = 1.0
    with pytest.raises(ValueError, match="16000"):
        ReferenceAudio(reference.samples, sample_rate=24_000)
    with pytest.raises(ValueError, match="float32"):
        ReferenceAudio(np.zeros(10, dtype=np.float64))
