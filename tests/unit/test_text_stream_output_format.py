"""ElevenLabs output formats: the names accepted (REST and socket), and audio converted to the promised
rate and codec."""

from __future__ import annotations

import asyncio

import av
import numpy as np
import pytest

from tests.audio_checks import decode_elevenlabs
from tts_gateway.gateway.speech.audio_encoding import OUTPUT_SAMPLE_RATE
from tts_gateway.gateway.speech.text_stream.output_format import (
    FORMATS,
    MAX_PIECE_MS,
    OutputFormat,
    UnsupportedOutputFormat,
    pcm_pieces,
)


def tone(seconds: float) -> bytes:
    t = np.arange(int(seconds * OUTPUT_SAMPLE_RATE)) / OUTPUT_SAMPLE_RATE
    return (np.sin(2 * np.pi * 440 * t) * 16000).astype("<i2").tobytes()


def peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.argmax(spectrum) * rate / samples.size)


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 24000, 32000, 44100, 48000])
def test_pcm_is_resampled_to_the_named_rate(rate: int) -> None:
    converter = OutputFormat.parse(f"pcm_{rate}").converter()
    first, second = converter.convert(tone(0.5)), converter.convert(tone(0.5), last=True)
    samples = np.frombuffer(first.data + second.data, dtype="<i2").astype(np.float32)
    assert abs(samples.size - rate) <= rate * 0.01
    assert first.duration_ms + second.duration_ms == pytest.approx(samples.size / rate * 1000)
    assert abs(peak_hz(samples, rate) - 440) < 5


@pytest.mark.parametrize(("name", "codec"), [("ulaw_8000", "pcm_mulaw"), ("alaw_8000", "pcm_alaw")])
def test_g711_is_one_byte_per_sample_at_8_khz_and_decodes_back(name: str, codec: str) -> None:
    out = OutputFormat.parse(name, socket=True).converter().convert(tone(1.0), last=True)
    assert abs(len(out.data) - 8000) <= 80
    assert out.duration_ms == pytest.approx(len(out.data) / 8)
    decoder = av.AudioCodecContext.create(codec, "r")
    decoder.sample_rate = 8000
    decoder.layout = "mono"
    frames = decoder.decode(av.Packet(out.data))
    decoded = np.concatenate([frame.to_ndarray().ravel() for frame in frames]).astype(np.float32)
    assert np.max(np.abs(decoded)) == pytest.approx(16000, rel=0.1)


@pytest.mark.parametrize(
    "name", ["mp3_22050_32", "mp3_24000_48", "mp3_44100_128", "mp3_44100", "opus_48000_64", "wav_16000", "pcm_44100"]
)
def test_every_piece_and_the_tail_make_one_file_at_the_named_rate(name: str) -> None:
    fmt = OutputFormat.parse(name)
    converter = fmt.converter()
    pieces = [converter.convert(tone(0.25), last=index == 3) for index in range(4)]
    data = b"".join(piece.data for piece in pieces) + asyncio.run(converter.finish())
    audio = decode_elevenlabs(data, name)
    assert audio.sample_rate == fmt.sample_rate
    assert sum(piece.duration_ms for piece in pieces) == pytest.approx(1000, abs=25)
    assert audio.duration == pytest.approx(1.0, abs=0.08)
    assert abs(peak_hz(audio.samples, audio.sample_rate) - 440) < 5


def test_mp3_bit_rates_follow_the_name() -> None:
    sizes = {}
    for name in ("mp3_44100_32", "mp3_44100_192"):
        converter = OutputFormat.parse(name).converter()
        sizes[name] = len(converter.convert(tone(2.0)).data + asyncio.run(converter.finish()))
    assert sizes["mp3_44100_32"] == pytest.approx(2 * 32_000 / 8, rel=0.15)
    assert sizes["mp3_44100_192"] == pytest.approx(2 * 192_000 / 8, rel=0.15)


def test_whole_wav_carries_exact_sizes() -> None:
    converter = OutputFormat.parse("wav_8000").converter(streaming=False)
    data = converter.convert(tone(0.5), last=True).data + asyncio.run(converter.finish())
    assert int.from_bytes(data[40:44], "little") == len(data) - 44 == 2 * 4000
    assert int.from_bytes(data[24:28], "little") == 8000


def test_every_socket_format_is_a_rest_format_and_wav_is_rest_only() -> None:
    for name in FORMATS:
        if name.startswith("wav_"):
            with pytest.raises(UnsupportedOutputFormat):
                OutputFormat.parse(name, socket=True)
        else:
            assert OutputFormat.parse(name, socket=True) == OutputFormat.parse(name)


@pytest.mark.parametrize("name", ["pcm_11025", "mp3_48000_128", "opus_24000_64", "ulaw_16000", "", "pcm", "mp3"])
def test_other_formats_are_refused_with_the_list(name: str) -> None:
    with pytest.raises(UnsupportedOutputFormat, match=r"pcm_<8000\|16000.*mp3_44100_<32.*opus_48000_"):
        OutputFormat.parse(name)


def test_pcm_pieces_are_short_whole_samples_and_join_to_the_input() -> None:
    pcm = tone(0.95)
    pieces = pcm_pieces(pcm)
    assert b"".join(pieces) == pcm
    assert len(pieces) == 5
    assert all(len(piece) % 2 == 0 and len(piece) / 2 / OUTPUT_SAMPLE_RATE <= MAX_PIECE_MS / 1000 for piece in pieces)
    assert pcm_pieces(b"") == []
