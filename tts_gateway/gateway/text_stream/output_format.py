"""ElevenLabs' ``output_format`` values, and the conversion of the gateway's audio into them.

The speech service hands out 16-bit PCM at :data:`OUTPUT_SAMPLE_RATE` (its ``pcm`` format);
``pcm_<rate>`` resamples that (soxr, streaming), ``ulaw_8000`` resamples to 8 kHz and encodes
G.711 mu-law (FFmpeg's ``pcm_mulaw`` through PyAV). MP3 and Opus are not offered: the gateway's
encoders write them at 24 kHz only, and ElevenLabs' names promise other rates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import av
import numpy as np
import soxr
from numpy.typing import NDArray

from tts_gateway.gateway.audio_encoding import OUTPUT_SAMPLE_RATE

PCM_RATES: Final = (8000, 16000, 22050, 24000, 44100, 48000)
SUPPORTED_FORMATS: Final = (*(f"pcm_{rate}" for rate in PCM_RATES), "ulaw_8000")


class UnsupportedOutputFormat(ValueError):
    pass


@dataclass(frozen=True)
class OutputFormat:
    codec: Literal["pcm", "ulaw"]
    sample_rate: int

    @classmethod
    def parse(cls, name: str) -> OutputFormat:
        if name not in SUPPORTED_FORMATS:
            raise UnsupportedOutputFormat(
                f"output_format {name!r} is not supported; use one of {', '.join(SUPPORTED_FORMATS)}"
            )
        codec, _, rate = name.partition("_")
        return cls("ulaw" if codec == "ulaw" else "pcm", int(rate))

    def duration_ms(self, data: bytes) -> float:
        """How long ``data`` in this format plays."""
        bytes_per_sample = 1 if self.codec == "ulaw" else 2
        return len(data) / bytes_per_sample / self.sample_rate * 1000

    def converter(self) -> AudioConverter:
        return AudioConverter(self)


class AudioConverter:
    """Converts one context's audio, chunk by chunk; not thread-safe."""

    def __init__(self, fmt: OutputFormat) -> None:
        self.format = fmt
        self._resampler = self._new_resampler()
        self._mulaw: av.AudioCodecContext | None = None
        if fmt.codec == "ulaw":
            context = av.AudioCodecContext.create("pcm_mulaw", "w")
            context.sample_rate = fmt.sample_rate
            context.format = "s16"
            context.layout = "mono"
            context.open()
            self._mulaw = context

    def _new_resampler(self) -> soxr.ResampleStream | None:
        if self.format.sample_rate == OUTPUT_SAMPLE_RATE:
            return None
        return soxr.ResampleStream(OUTPUT_SAMPLE_RATE, self.format.sample_rate, 1, dtype="int16", quality="HQ")

    def convert(self, pcm: bytes, *, last: bool = False) -> bytes:
        """``pcm`` (16-bit little-endian at OUTPUT_SAMPLE_RATE) in the output format.

        ``last`` ends a phrase: the resampler's tail goes out with it, so each phrase's audio is
        whole in its own messages, and the next phrase starts a fresh resampler.
        """
        samples: NDArray[np.int16] = np.frombuffer(pcm, dtype="<i2")
        if self._resampler is not None:
            samples = np.asarray(self._resampler.resample_chunk(samples, last=last), dtype=np.int16)
            if last:
                self._resampler = self._new_resampler()
        if self._mulaw is None:
            return samples.astype("<i2").tobytes()
        if not samples.size:
            return b""
        frame = av.AudioFrame.from_ndarray(samples[np.newaxis, :], format="s16", layout="mono")
        frame.sample_rate = self.format.sample_rate
        return b"".join(bytes(packet) for packet in self._mulaw.encode(frame))
