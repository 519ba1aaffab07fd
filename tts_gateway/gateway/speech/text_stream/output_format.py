"""ElevenLabs' ``output_format`` values, one table for its REST API and its WebSocket, and the
conversion of the gateway's audio into them.

The speech service hands out 16-bit PCM at :data:`OUTPUT_SAMPLE_RATE` (its ``pcm`` format).
``pcm_<rate>`` resamples that (soxr, streaming); ``ulaw_8000`` and ``alaw_8000`` resample to 8 kHz
and encode G.711 (FFmpeg's ``pcm_mulaw`` / ``pcm_alaw`` through PyAV); ``mp3_<rate>_<kbps>``,
``opus_48000_<kbps>`` (Ogg Opus) and ``wav_<rate>`` go through the gateway's own encoders
(:mod:`speech.audio_encoding`) at the rate and bit rate the name gives. ``wav`` is served over REST
only: on the socket every message is a piece of one stream, which a header per context would break.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

import av
import numpy as np
import soxr
from numpy.typing import NDArray

from tts_gateway.gateway.speech.audio_encoding import OUTPUT_SAMPLE_RATE, AudioFormat, StreamEncoder, create_encoder
from tts_gateway.gateway.speech.audio_threads import run_audio_work_unless_cheap

Codec = Literal["pcm", "ulaw", "alaw", "mp3", "opus", "wav"]

# The longest audio one message or streamed piece carries: a model that returns a sentence whole (Piper) still
# reaches a client in pieces that a real-time player can start on and keep up with.
MAX_PIECE_MS: Final = 200
_MAX_PIECE_BYTES: Final = OUTPUT_SAMPLE_RATE * MAX_PIECE_MS // 1000 * 2

PCM_RATES: Final = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
# ElevenLabs' mp3 formats: (sample rate, kbit/s).
MP3_FORMATS: Final = ((22050, 32), (24000, 48), (44100, 32), (44100, 64), (44100, 96), (44100, 128), (44100, 192))
OPUS_BIT_RATES: Final = (32, 64, 96, 128, 192)

_CONTENT_TYPES: Final[Mapping[Codec, str]] = {
    "pcm": "audio/pcm",
    "ulaw": "audio/basic",
    "alaw": "audio/x-alaw-basic",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "wav": "audio/wav",
}
_G711_CODECS: Final[Mapping[Codec, str]] = {"ulaw": "pcm_mulaw", "alaw": "pcm_alaw"}
_ENCODED: Final[Mapping[Codec, AudioFormat]] = {"mp3": "mp3", "opus": "opus", "wav": "wav"}
_SUMMARY: Final = (
    f"pcm_<{'|'.join(map(str, PCM_RATES))}>, ulaw_8000, alaw_8000, "
    f"mp3_22050_32, mp3_24000_48, mp3_44100_<32|64|96|128|192>, opus_48000_<{'|'.join(map(str, OPUS_BIT_RATES))}>"
)


def pcm_pieces(pcm: bytes) -> list[bytes]:
    """``pcm`` (16-bit at OUTPUT_SAMPLE_RATE) in pieces of at most :data:`MAX_PIECE_MS`."""
    return [pcm[start : start + _MAX_PIECE_BYTES] for start in range(0, len(pcm), _MAX_PIECE_BYTES)]


class UnsupportedOutputFormat(ValueError):
    pass


@dataclass(frozen=True)
class OutputFormat:
    name: str
    codec: Codec
    sample_rate: int
    bit_rate: int | None = None
    """Bits per second of a compressed format."""

    @classmethod
    def parse(cls, name: str, *, socket: bool = False) -> OutputFormat:
        """The format ``name`` stands for; the socket's choice leaves out ``wav``."""
        fmt = FORMATS.get(name)
        if fmt is None or (socket and fmt.codec == "wav"):
            rest = "" if socket else f", wav_<{'|'.join(map(str, PCM_RATES))}>"
            raise UnsupportedOutputFormat(f"output_format {name!r} is not supported; use {_SUMMARY}{rest}")
        return fmt

    @property
    def content_type(self) -> str:
        return _CONTENT_TYPES[self.codec]

    def converter(self, *, streaming: bool = True) -> AudioConverter:
        """A converter for one response or context; ``streaming=False``: the audio is sent whole (exact
        sizes in a wav header)."""
        return AudioConverter(self, streaming=streaming)


def _formats() -> dict[str, OutputFormat]:
    formats = [OutputFormat(f"pcm_{rate}", "pcm", rate) for rate in PCM_RATES]
    formats += [OutputFormat("ulaw_8000", "ulaw", 8000), OutputFormat("alaw_8000", "alaw", 8000)]
    formats += [OutputFormat(f"mp3_{rate}_{kbps}", "mp3", rate, kbps * 1000) for rate, kbps in MP3_FORMATS]
    # LiveKit's plugin also offers the bare name, which ElevenLabs serves at its default bit rate.
    formats.append(OutputFormat("mp3_44100", "mp3", 44100, 128_000))
    formats += [OutputFormat(f"opus_48000_{kbps}", "opus", 48000, kbps * 1000) for kbps in OPUS_BIT_RATES]
    formats += [OutputFormat(f"wav_{rate}", "wav", rate) for rate in PCM_RATES]
    return {fmt.name: fmt for fmt in formats}


FORMATS: Final[Mapping[str, OutputFormat]] = _formats()


@dataclass(frozen=True)
class ConvertedAudio:
    data: bytes
    duration_ms: float
    """How long the audio handed in plays: a compressed format's bytes may lag behind it (the encoder's delay)."""


class AudioConverter:
    """Converts one response's or one context's audio, chunk by chunk; not thread-safe."""

    def __init__(self, fmt: OutputFormat, *, streaming: bool = True) -> None:
        self.format = fmt
        self._encoder: StreamEncoder | None = None
        self._resampler: soxr.ResampleStream | None = None
        self._g711: av.AudioCodecContext | None = None
        if fmt.codec in _ENCODED:
            self._encoder = create_encoder(
                _ENCODED[fmt.codec],
                OUTPUT_SAMPLE_RATE,
                streaming=streaming,
                output_sample_rate=fmt.sample_rate,
                bit_rate=fmt.bit_rate,
            )
            return
        self._resampler = self._new_resampler()
        if fmt.codec in _G711_CODECS:
            context = av.AudioCodecContext.create(_G711_CODECS[fmt.codec], "w")
            if not isinstance(context, av.AudioCodecContext):
                raise TypeError(f"{_G711_CODECS[fmt.codec]} is not an audio codec")
            context.sample_rate = fmt.sample_rate
            context.format = "s16"
            context.layout = "mono"
            context.open()
            self._g711 = context

    @property
    def cheap(self) -> bool:
        """Costs so little that a worker thread would cost more."""
        return self._encoder is None or self._encoder.cheap

    def _new_resampler(self) -> soxr.ResampleStream | None:
        if self.format.sample_rate == OUTPUT_SAMPLE_RATE:
            return None
        return soxr.ResampleStream(OUTPUT_SAMPLE_RATE, self.format.sample_rate, 1, dtype="int16", quality="HQ")

    def convert(self, pcm: bytes, *, last: bool = False) -> ConvertedAudio:
        """``pcm`` (16-bit little-endian at OUTPUT_SAMPLE_RATE) in the output format.

        ``last`` ends a phrase: the resampler's tail goes out with it, so each phrase's audio is
        whole in its own messages, and the next phrase starts a fresh resampler. A compressed
        format's encoder runs on across phrases (one stream per context); :meth:`finish` ends it.
        """
        samples: NDArray[np.int16] = np.frombuffer(pcm, dtype="<i2")
        if self._encoder is not None:
            data = self._encoder.encode(samples.astype(np.float32) / np.float32(32767.0))
            return ConvertedAudio(data, samples.size / OUTPUT_SAMPLE_RATE * 1000)
        if self._resampler is not None:
            samples = np.asarray(self._resampler.resample_chunk(samples, last=last), dtype=np.int16)
            if last:
                self._resampler = self._new_resampler()
        duration_ms = samples.size / self.format.sample_rate * 1000
        if self._g711 is None:
            return ConvertedAudio(samples.astype("<i2").tobytes(), duration_ms)
        if not samples.size:
            return ConvertedAudio(b"", 0.0)
        frame = av.AudioFrame.from_ndarray(samples[np.newaxis, :], format="s16", layout="mono")
        frame.sample_rate = self.format.sample_rate
        return ConvertedAudio(b"".join(bytes(packet) for packet in self._g711.encode(frame)), duration_ms)

    async def convert_async(self, pcm: bytes, *, last: bool = False) -> ConvertedAudio:
        """:meth:`convert`, on a worker thread where the codec is costly (mp3, Opus)."""
        return await run_audio_work_unless_cheap(self.cheap, self.convert, pcm, last=last)

    async def finish(self) -> bytes:
        """What a compressed format's encoder still holds (empty for the others)."""
        if self._encoder is None:
            return b""
        return await run_audio_work_unless_cheap(self._encoder.cheap, self._encoder.finish)

    def close(self) -> None:
        """Let go of a compressed format's codec if :meth:`finish` has not: the audio ended early."""
        if self._encoder is not None:
            self._encoder.close()
