"""ElevenLabs output formats: the names accepted, and audio converted to the promised rate and codec."""

from __future__ import annotations

import numpy as np
import pytest

from tts_gateway.gateway.audio_encoding import OUTPUT_SAMPLE_RATE
from tts_gateway.gateway.text_stream.output_format import OutputFormat, UnsupportedOutputFormat


def tone(seconds: float) -> bytes:
    t = np.arange(int(seconds * OUTPUT_SAMPLE_RATE)) / OUTPUT_SAMPLE_RATE
    return (np.sin(2 * np.pi * 440 * t) * 16000).astype("<i2").tobytes()


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 24000, 44100, 48000])
def test_pcm_is_resampled_to_the_named_rate(rate: int) -> None:
    converter = OutputFormat.parse(f"pcm_{rate}").converter()
    out = converter.convert(tone(0.5)) + converter.convert(tone(0.5), last=True)
    samples = np.frombuffer(out, dtype="<i2").astype(np.float32)
    assert abs(samples.size - rate) <= rate * 0.01
    spectrum = np.abs(np.fft.rfft(samples))
    assert abs(np.argmax(spectrum) * rate / samples.size - 440) < 5


def test_ulaw_is_one_byte_per_sample_at_8_khz_and_decodes_back() -> None:
    import av

    converter = OutputFormat.parse("ulaw_8000").converter()
    out = converter.convert(tone(1.0), last=True)
    assert abs(len(out) - 8000) <= 80
    decoder = av.AudioCodecContext.create("pcm_mulaw", "r")
    decoder.sample_rate = 8000
    decoder.layout = "mono"
    frames = decoder.decode(av.Packet(out))
    decoded = np.concatenate([frame.to_ndarray().ravel() for frame in frames]).astype(np.float32)
    assert np.max(np.abs(decoded)) == pytest.approx(16000, rel=0.1)


@pytest.mark.parametrize("name", ["mp3_44100_128", "pcm_11025", "opus_48000_64", "", "pcm"])
def test_other_formats_are_refused_with_the_list(name: str) -> None:
    with pytest.raises(UnsupportedOutputFormat, match="pcm_16000"):
        OutputFormat.parse(name)
