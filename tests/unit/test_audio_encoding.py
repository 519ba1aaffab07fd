"""The encoders' output decoded by real decoders (FFmpeg through PyAV, libsndfile)."""

from __future__ import annotations

import gc
import io
import struct
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import av
import numpy as np
import pytest
import soundfile as sf
from numpy.typing import NDArray

from tts_gateway.gateway.speech.audio_encoding import (
    AUDIO_FORMATS,
    CONTENT_TYPES,
    OUTPUT_SAMPLE_RATE,
    AudioFormat,
    create_encoder,
    encode_whole,
)

INPUT_RATE = 22_050
TONE_HZ = 440.0
COMPRESSED: tuple[AudioFormat, ...] = ("mp3", "opus", "aac", "flac")


def sine(seconds: float, rate: int, freq: float = TONE_HZ, amplitude: float = 0.5) -> NDArray[np.float32]:
    t = np.arange(round(seconds * rate)) / rate
    samples: NDArray[np.float32] = (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    return samples


def encode_in_chunks(
    fmt: AudioFormat, samples: NDArray[np.float32], rate: int, chunk_seconds: float = 0.02
) -> tuple[list[bytes], bytes]:
    encoder = create_encoder(fmt, rate)
    step = round(chunk_seconds * rate)
    parts = [encoder.encode(samples[i : i + step]) for i in range(0, samples.size, step)]
    return parts, encoder.finish()


def decode_pyav(data: bytes) -> tuple[NDArray[np.float32], int, int]:
    """Decode with FFmpeg; returns (mono samples, decoded rate, channel count)."""
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray() for frame in container.decode(stream)]
        rate = stream.codec_context.sample_rate
        channels = stream.codec_context.channels
    decoded = np.concatenate(frames, axis=1)[0]  # one channel, planar or packed alike
    if decoded.dtype.kind == "i":
        return decoded.astype(np.float32) / np.iinfo(decoded.dtype).max, rate, channels
    return decoded.astype(np.float32), rate, channels


def opus_input_rate(data: bytes) -> int:
    """The original sample rate recorded in the OpusHead (Opus always decodes at 48 kHz)."""
    with av.open(io.BytesIO(data), mode="r") as container:
        head = container.streams.audio[0].codec_context.extradata
    assert head is not None
    assert head[:8] == b"OpusHead"
    rate: int = struct.unpack_from("<I", head, 12)[0]
    return rate


def decode(fmt: AudioFormat, data: bytes) -> tuple[NDArray[np.float32], int]:
    """Decode ``data`` and check it is mono; returns (samples, rate of the encoded audio)."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767, OUTPUT_SAMPLE_RATE
    if fmt == "wav":
        samples, rate = sf.read(io.BytesIO(data), dtype="float32")
        assert samples.ndim == 1
        return samples, rate
    samples, rate, channels = decode_pyav(data)
    assert channels == 1
    if fmt == "opus":
        assert rate == 48_000
        assert opus_input_rate(data) == OUTPUT_SAMPLE_RATE
    return samples, rate


def dominant_frequency(samples: NDArray[np.float32], rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.size)))
    return float(np.fft.rfftfreq(samples.size, 1 / rate)[np.argmax(spectrum)])


def rms(samples: NDArray[np.float32]) -> float:
    return float(np.sqrt(np.mean(np.square(samples, dtype=np.float64))))


# Decoded length minus input length: mp3 and aac decoders also output the encoder's
# priming samples and the padding of the last frame.
EXTRA_SECONDS = {"mp3": 0.1, "aac": 0.1, "opus": 0.005, "flac": 0.005, "wav": 0.005, "pcm": 0.005}


@pytest.mark.parametrize("fmt", AUDIO_FORMATS)
def test_streamed_sine_decodes_at_24khz_with_pitch_and_length(fmt: AudioFormat) -> None:
    parts, tail = encode_in_chunks(fmt, sine(2.0, INPUT_RATE), INPUT_RATE)

    assert any(parts), "nothing was streamed before finish()"
    samples, rate = decode(fmt, b"".join(parts) + tail)
    if fmt != "opus":
        assert rate == OUTPUT_SAMPLE_RATE
    duration = samples.size / rate
    assert 2.0 - 0.005 <= duration <= 2.0 + EXTRA_SECONDS[fmt]
    middle = samples[rate // 2 : 3 * rate // 2]
    assert rms(middle) == pytest.approx(0.5 / np.sqrt(2), rel=0.1)
    assert dominant_frequency(middle, rate) == pytest.approx(TONE_HZ, abs=2)


@pytest.mark.parametrize("fmt", AUDIO_FORMATS)
def test_bytes_flow_before_finish(fmt: AudioFormat) -> None:
    parts, _ = encode_in_chunks(fmt, sine(3.0, INPUT_RATE), INPUT_RATE, chunk_seconds=0.25)

    # Every format delivers audio during the first second, not only at the end.
    assert sum(len(part) for part in parts[:4]) > 0
    assert sum(1 for part in parts if part) >= len(parts) // 2


@pytest.mark.parametrize("fmt", AUDIO_FORMATS)
def test_encode_whole_is_a_complete_file(fmt: AudioFormat) -> None:
    data = encode_whole(fmt, sine(1.0, INPUT_RATE), INPUT_RATE)

    samples, rate = decode(fmt, data)
    assert 1.0 - 0.005 <= samples.size / rate <= 1.0 + EXTRA_SECONDS[fmt]
    assert dominant_frequency(samples, rate) == pytest.approx(TONE_HZ, abs=3)


def test_whole_flac_header_has_exact_length() -> None:
    data = encode_whole("flac", sine(1.5, OUTPUT_SAMPLE_RATE), OUTPUT_SAMPLE_RATE)

    info = sf.info(io.BytesIO(data))
    assert info.frames == round(1.5 * OUTPUT_SAMPLE_RATE)
    assert info.samplerate == OUTPUT_SAMPLE_RATE
    assert info.channels == 1


def test_streamed_wav_header_goes_out_first_with_unknown_sizes() -> None:
    encoder = create_encoder("wav", INPUT_RATE)

    first = encoder.encode(np.zeros(0, dtype=np.float32))
    assert len(first) == 44
    riff, riff_size, wave = struct.unpack_from("<4sI4s", first, 0)
    assert (riff, riff_size, wave) == (b"RIFF", 0xFFFFFFFF, b"WAVE")
    fmt_id, fmt_size, codec, channels, rate, byte_rate, block_align, bits = struct.unpack_from("<4sIHHIIHH", first, 12)
    assert (fmt_id, fmt_size, codec, channels) == (b"fmt ", 16, 1, 1)
    assert (rate, byte_rate, block_align, bits) == (24_000, 48_000, 2, 16)
    assert struct.unpack_from("<4sI", first, 36) == (b"data", 0xFFFFFFFF)

    rest = encoder.encode(sine(0.5, INPUT_RATE)) + encoder.finish()
    assert not rest.startswith(b"RIFF")
    assert len(rest) == 2 * round(0.5 * OUTPUT_SAMPLE_RATE)


def test_streamed_wav_header_is_sent_even_without_audio() -> None:
    assert create_encoder("wav", OUTPUT_SAMPLE_RATE).finish()[:4] == b"RIFF"


def test_whole_wav_header_has_exact_sizes() -> None:
    data = encode_whole("wav", sine(0.5, OUTPUT_SAMPLE_RATE), OUTPUT_SAMPLE_RATE)

    data_size = 2 * OUTPUT_SAMPLE_RATE // 2
    assert len(data) == 44 + data_size
    assert struct.unpack_from("<I", data, 4)[0] == 36 + data_size
    assert struct.unpack_from("<I", data, 40)[0] == data_size


def test_pythons_wave_reads_the_true_length_of_a_whole_wav_only() -> None:
    # Python's wave believes the header's sizes; libsndfile and FFmpeg read a streamed file to its end.
    whole = encode_whole("wav", sine(12.0, INPUT_RATE), INPUT_RATE)
    parts, tail = encode_in_chunks("wav", sine(12.0, INPUT_RATE), INPUT_RATE, chunk_seconds=0.5)
    with wave.open(io.BytesIO(whole)) as reader:
        assert reader.getnframes() / reader.getframerate() == pytest.approx(12.0, abs=0.001)
    with wave.open(io.BytesIO(b"".join(parts) + tail)) as reader:
        assert reader.getnframes() == 0xFFFFFFFF // 2
    assert b"".join(parts) + tail == whole[:4] + b"\xff" * 4 + whole[8:40] + b"\xff" * 4 + whole[44:]


def test_pcm_at_24khz_is_passed_through_unresampled() -> None:
    samples = sine(0.1, OUTPUT_SAMPLE_RATE)

    data = encode_whole("pcm", samples, OUTPUT_SAMPLE_RATE)

    expected = np.round(samples * 32767).astype("<i2").tobytes()
    assert data == expected


def test_out_of_range_and_non_finite_samples_are_clipped() -> None:
    samples = np.array([1.5, -2.0, np.nan, np.inf, -np.inf, 0.25], dtype=np.float32)

    data = encode_whole("pcm", samples, OUTPUT_SAMPLE_RATE)

    assert np.frombuffer(data, dtype="<i2").tolist() == [32767, -32767, 0, 32767, -32767, 8192]


def test_mp3_is_bare_frames_and_concatenated_responses_decode_as_one_stream() -> None:
    one = encode_whole("mp3", sine(1.0, INPUT_RATE), INPUT_RATE)
    two = encode_whole("mp3", sine(1.5, INPUT_RATE, freq=660.0), INPUT_RATE)

    for data in (one, two):
        assert not data.startswith(b"ID3")
        assert data[0] == 0xFF and data[1] & 0xE0 == 0xE0, "must start with an MPEG frame sync"
        assert b"Xing" not in data[:2048] and b"Info" not in data[:2048]

    samples, rate = decode("mp3", one + two)
    assert rate == OUTPUT_SAMPLE_RATE
    assert 2.5 <= samples.size / rate <= 2.5 + 2 * EXTRA_SECONDS["mp3"]
    start, end = samples[: rate // 2], samples[-rate // 2 - rate // 10 : -rate // 10]
    assert dominant_frequency(start, rate) == pytest.approx(440, abs=3)
    assert dominant_frequency(end, rate) == pytest.approx(660, abs=3)


def test_opus_keeps_its_tail() -> None:
    seconds = 1.234  # not a multiple of the 20 ms Opus frame
    parts, tail = encode_in_chunks("opus", sine(seconds, INPUT_RATE), INPUT_RATE, chunk_seconds=0.1)

    samples, rate = decode("opus", b"".join(parts) + tail)

    assert abs(samples.size / rate - seconds) <= 0.03
    last_40ms = samples[-round(0.06 * rate) : -round(0.02 * rate)]
    assert rms(last_40ms) > 0.25


def test_content_types() -> None:
    assert dict(CONTENT_TYPES) == {
        "mp3": "audio/mpeg",
        "opus": "audio/ogg",
        "aac": "audio/aac",
        "flac": "audio/flac",
        "wav": "audio/wav",
        "pcm": "audio/pcm",
    }
    assert set(AUDIO_FORMATS) == set(CONTENT_TYPES)


@pytest.mark.parametrize("fmt", COMPRESSED)
def test_concurrent_encoders_do_not_interfere(fmt: AudioFormat) -> None:
    samples = sine(0.5, INPUT_RATE)
    reference = decode_pyav(encode_whole(fmt, samples, INPUT_RATE))[0]

    def run(_: int) -> NDArray[np.float32]:
        parts, tail = encode_in_chunks(fmt, samples, INPUT_RATE)
        # Compared decoded: Ogg serial numbers are random, streamed FLAC headers lack the length.
        return decode_pyav(b"".join(parts) + tail)[0]

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, range(4)))

    for result in results:
        np.testing.assert_array_equal(result, reference)


@pytest.fixture()
def garbage() -> Iterator[list[object]]:
    """``gc.garbage``, where each collection during the test leaves what it found unreachable; no
    collection runs unless the test asks for one."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("fmt", COMPRESSED)
def test_an_encoder_closed_before_its_end_frees_its_codec_at_once(
    fmt: AudioFormat, streaming: bool, garbage: list[object]
) -> None:
    # A response whose client left: without close(), FFmpeg's container and stream hold each other
    # (and the codec, up to several MiB) until Python's next full collection.
    encoder = create_encoder(fmt, INPUT_RATE, streaming=streaming)
    encoder.encode(sine(0.5, INPUT_RATE))
    encoder.close()
    encoder.close()
    del encoder
    unopened = create_encoder(fmt, INPUT_RATE, streaming=streaming)
    unopened.close()
    del unopened
    gc.collect()
    assert not [thing for thing in garbage if type(thing).__module__.startswith("av.")]


def test_close_after_finish_leaves_the_file_whole() -> None:
    encoder = create_encoder("flac", INPUT_RATE)
    data = encoder.encode(sine(0.5, INPUT_RATE)) + encoder.finish()
    encoder.close()
    assert decode_pyav(data)[0].size == round(0.5 * OUTPUT_SAMPLE_RATE)


@pytest.mark.parametrize("ending", ["finish", "close"])
def test_an_ended_encoder_takes_no_more_audio(ending: str) -> None:
    encoder = create_encoder("mp3", INPUT_RATE)
    getattr(encoder, ending)()
    with pytest.raises(RuntimeError):
        encoder.encode(sine(0.1, INPUT_RATE))
    with pytest.raises(RuntimeError):
        encoder.finish()


def test_bad_rates_and_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="sample rate"):
        create_encoder("pcm", 0)
    with pytest.raises(ValueError, match="mono"):
        create_encoder("pcm", INPUT_RATE).encode(np.zeros((2, 100), dtype=np.float32))
