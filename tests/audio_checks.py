"""Decode what the gateway returns and check it is real speech."""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

import av
import numpy as np
import soxr
from numpy.typing import NDArray


@dataclass(frozen=True)
class DecodedAudio:
    samples: NDArray[np.float32]  # mono
    sample_rate: int
    channels: int

    @property
    def duration(self) -> float:
        return self.samples.size / self.sample_rate

    @property
    def rms(self) -> float:
        return float(np.sqrt(np.mean(np.square(self.samples)))) if self.samples.size else 0.0

    @property
    def speaking_seconds(self) -> float:
        """Its length without the pauses: the 10 ms windows louder than an RMS of 0.01.

        Piper draws its pauses at random, so two renderings of one text differ in length by up to a
        second or so; the speech between the pauses varies far less.
        """
        window = self.sample_rate // 100
        frames = self.samples[: self.samples.size // window * window].reshape(-1, window)
        return float(np.count_nonzero(np.sqrt(np.mean(np.square(frames), axis=1)) > 0.01)) / 100


def decode(data: bytes, fmt: str) -> DecodedAudio:
    """Decode a response body of OpenAI ``response_format`` ``fmt`` (FFmpeg reads streamed, unsized files)."""
    if fmt == "pcm":
        assert len(data) % 2 == 0, "pcm must be whole 16-bit samples"
        samples = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
        return DecodedAudio(samples, 24_000, 1)
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray() for frame in container.decode(stream)]
        rate = stream.codec_context.sample_rate
        channels = stream.codec_context.channels
    pcm = np.concatenate([f.reshape(channels, -1) if f.shape[0] == channels else f.T for f in frames], axis=1)
    mono = pcm.mean(axis=0).astype(np.float32)
    if fmt == "opus":
        # Opus always decodes at 48 kHz; the rate the audio was encoded from is in the OpusHead.
        head = data.index(b"OpusHead")
        encoded_rate = struct.unpack("<I", data[head + 12 : head + 16])[0]
        mono = np.asarray(soxr.resample(mono, rate, encoded_rate), dtype=np.float32)
        rate = encoded_rate
    return DecodedAudio(mono, rate, channels)


def assert_speech(audio: DecodedAudio, *, expected_seconds: float, tolerance: float = 0.2) -> None:
    """Mono 24 kHz, about as long as expected, and not silence."""
    assert audio.sample_rate == 24_000, audio.sample_rate
    assert audio.channels == 1, audio.channels
    low, high = expected_seconds * (1 - tolerance), expected_seconds * (1 + tolerance) + 0.15
    assert low <= audio.duration <= high, f"duration {audio.duration:.2f}s outside [{low:.2f}, {high:.2f}]"
    assert audio.rms > 0.01, f"audio is (nearly) silent: rms {audio.rms:.4f}"


def decode_elevenlabs(data: bytes, output_format: str) -> DecodedAudio:
    """Decode audio in an ElevenLabs ``output_format`` (``pcm_16000``, ``ulaw_8000``, ``mp3_22050_32``...)."""
    codec, rate = output_format.split("_")[:2]
    if codec == "pcm":
        assert len(data) % 2 == 0, "pcm must be whole 16-bit samples"
        return DecodedAudio(np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0, int(rate), 1)
    if codec in ("ulaw", "alaw"):
        decoder = av.AudioCodecContext.create("pcm_mulaw" if codec == "ulaw" else "pcm_alaw", "r")
        decoder.sample_rate = int(rate)
        decoder.layout = "mono"
        frames = decoder.decode(av.Packet(data))
        samples = np.concatenate([frame.to_ndarray().ravel() for frame in frames]).astype(np.float32) / 32768.0
        return DecodedAudio(samples, int(rate), 1)
    return decode(data, codec)
