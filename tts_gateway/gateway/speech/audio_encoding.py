"""Streaming encoders for the response formats of OpenAI's speech API.

Every encoder takes mono float32 audio at the model's sample rate, resamples it
to 24 kHz (the rate OpenAI clients such as Pipecat and LiveKit hard-code for pcm,
used for every format so all outputs agree; ElevenLabs' formats name rates of their
own), and returns encoded bytes as soon as
the codec and container produce them. Compressed formats go through FFmpeg's
encoders in PyAV; pcm and wav are written directly.

An encoder instance belongs to one response, which encodes with it one call at a time,
possibly on a worker thread; only ``close()`` may come from another thread meanwhile, and
waits for the call under way. Nothing is shared between instances.
"""

from __future__ import annotations

import io
import logging
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Final, Literal, Protocol, get_args

import av
import numpy as np
import soxr
from av.audio.stream import AudioStream
from numpy.typing import NDArray

OUTPUT_SAMPLE_RATE: Final = 24_000

AudioFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
AUDIO_FORMATS: Final[tuple[AudioFormat, ...]] = get_args(AudioFormat)

CONTENT_TYPES: Final[Mapping[AudioFormat, str]] = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}

logger = logging.getLogger(__name__)

# Sizes written in a streamed WAV header: the length is unknown when it goes out.
_STREAMING_WAV_SIZE: Final = 0xFFFFFFFF
_BYTES_PER_SAMPLE: Final = 2


class StreamEncoder(Protocol):
    """Encodes one response's audio incrementally."""

    cheap: bool
    """Costs so little (well under a millisecond per second of audio) that a worker thread would cost more."""

    def encode(self, samples: NDArray[np.float32]) -> bytes:
        """Add mono float32 samples in [-1, 1]; return the bytes ready so far (may be empty)."""
        ...

    def finish(self) -> bytes:
        """Flush the resampler, the codec and the container trailer; return the last bytes."""
        ...

    def close(self) -> None:
        """Let go of the codec now, if :meth:`finish` has not (the response ended early); never raises.

        An FFmpeg container left open holds its codec (up to several MiB for flac) in a reference
        cycle that only Python's full garbage collection frees.
        """
        ...


@dataclass(frozen=True)
class _CodecSpec:
    container: str
    codec: str
    bit_rate: int | None = None
    container_options: Mapping[str, str] = field(default_factory=dict)


_CODEC_SPECS: Final[Mapping[AudioFormat, _CodecSpec]] = {
    # Bare MPEG audio frames: no ID3v2 tag and no Xing/LAME info frame, so responses
    # concatenated byte for byte (LibreChat does this) still form one valid stream.
    "mp3": _CodecSpec("mp3", "libmp3lame", 64_000, {"id3v2_version": "0", "write_xing": "0"}),
    # The Ogg muxer holds back the page being filled; 100 ms pages (default 1 s)
    # keep that delay short at about 2 kbit/s of page overhead.
    "opus": _CodecSpec("ogg", "libopus", 48_000, {"page_duration": "100000"}),
    "aac": _CodecSpec("adts", "aac", 64_000),
    "flac": _CodecSpec("flac", "flac"),
}


def _to_int16_bytes(samples: NDArray[np.float32]) -> bytes:
    scaled = samples * np.float32(32767.0)
    np.rint(scaled, out=scaled)
    return scaled.astype("<i2").tobytes()


def _wav_header(data_size: int, sample_rate: int = OUTPUT_SAMPLE_RATE) -> bytes:
    """A canonical 44-byte header for 16-bit mono PCM at ``sample_rate``."""
    riff_size = _STREAMING_WAV_SIZE if data_size == _STREAMING_WAV_SIZE else 36 + data_size
    byte_rate = sample_rate * _BYTES_PER_SAMPLE
    return (
        struct.pack("<4sI4s", b"RIFF", riff_size, b"WAVE")
        + struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, sample_rate, byte_rate, _BYTES_PER_SAMPLE, 16)
        + struct.pack("<4sI", b"data", data_size)
    )


class _Resampler:
    """Streaming resampler to the output rate that also sanitises the samples."""

    def __init__(self, input_sample_rate: int, output_sample_rate: int) -> None:
        if input_sample_rate <= 0:
            raise ValueError(f"invalid input sample rate: {input_sample_rate}")
        self._stream = (
            None
            if input_sample_rate == output_sample_rate
            else soxr.ResampleStream(input_sample_rate, output_sample_rate, 1, dtype="float32", quality="VHQ")
        )

    def process(self, samples: NDArray[np.float32]) -> NDArray[np.float32]:
        samples = np.asarray(samples, dtype=np.float32)
        if samples.ndim != 1:
            raise ValueError(f"expected mono samples (1-D), got shape {samples.shape}")
        if self._stream is not None:
            samples = np.asarray(self._stream.resample_chunk(samples), dtype=np.float32)
        return self._sanitise(samples)

    def flush(self) -> NDArray[np.float32]:
        if self._stream is None:
            return np.zeros(0, dtype=np.float32)
        tail = self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
        return self._sanitise(np.asarray(tail, dtype=np.float32))

    @staticmethod
    def _sanitise(samples: NDArray[np.float32]) -> NDArray[np.float32]:
        # The resampler can overshoot full-scale input slightly; a NaN from a broken
        # model must not reach the codec as garbage.
        # Clipping maps the infinities to full scale; NaN survives it and makes the sum NaN,
        # a cheap test (nan_to_num on every chunk cost more than the rest of the encoding).
        cleaned: NDArray[np.float32] = np.clip(samples, np.float32(-1.0), np.float32(1.0))
        if np.isnan(cleaned.sum()):
            np.nan_to_num(cleaned, copy=False, nan=0.0)
        return cleaned


class _Encoder(ABC):
    """Resampling and life-cycle shared by every format."""

    def __init__(self, input_sample_rate: int, output_sample_rate: int = OUTPUT_SAMPLE_RATE) -> None:
        self._resampler = _Resampler(input_sample_rate, output_sample_rate)
        self._output_rate = output_sample_rate
        self._finished = False
        # A response cancelled while a worker thread encodes its chunk closes the encoder on the event
        # loop: the close waits for that chunk instead of freeing the codec under it.
        self._lock = threading.Lock()

    def encode(self, samples: NDArray[np.float32]) -> bytes:
        with self._lock:
            if self._finished:
                raise RuntimeError("encoder already finished")
            return self._encode_output(self._resampler.process(samples))

    def finish(self) -> bytes:
        with self._lock:
            if self._finished:
                raise RuntimeError("encoder already finished")
            self._finished = True
            return self._encode_output(self._resampler.flush()) + self._close()

    def close(self) -> None:
        with self._lock:
            self._finished = True

    @abstractmethod
    def _encode_output(self, samples: NDArray[np.float32]) -> bytes:
        """Encode samples already at the output rate and clipped to [-1, 1]."""

    @abstractmethod
    def _close(self) -> bytes:
        """Return whatever is still buffered once all samples were encoded."""


class _PcmEncoder(_Encoder):
    cheap = True

    def _encode_output(self, samples: NDArray[np.float32]) -> bytes:
        return _to_int16_bytes(samples)

    def _close(self) -> bytes:
        return b""


class _StreamingWavEncoder(_Encoder):
    """WAV whose header, with unknown sizes, goes out with the first bytes (as OpenAI does)."""

    cheap = True

    def __init__(self, input_sample_rate: int, output_sample_rate: int = OUTPUT_SAMPLE_RATE) -> None:
        super().__init__(input_sample_rate, output_sample_rate)
        self._header_sent = False

    def _header_once(self) -> bytes:
        if self._header_sent:
            return b""
        self._header_sent = True
        return _wav_header(_STREAMING_WAV_SIZE, self._output_rate)

    def _encode_output(self, samples: NDArray[np.float32]) -> bytes:
        return self._header_once() + _to_int16_bytes(samples)

    def _close(self) -> bytes:
        return self._header_once()


class _WholeWavEncoder(_Encoder):
    """WAV with exact sizes: everything is returned by finish()."""

    cheap = True

    def __init__(self, input_sample_rate: int, output_sample_rate: int = OUTPUT_SAMPLE_RATE) -> None:
        super().__init__(input_sample_rate, output_sample_rate)
        self._chunks: list[bytes] = []

    def _encode_output(self, samples: NDArray[np.float32]) -> bytes:
        self._chunks.append(_to_int16_bytes(samples))
        return b""

    def _close(self) -> bytes:
        size = sum(len(chunk) for chunk in self._chunks)
        data = b"".join([_wav_header(size, self._output_rate), *self._chunks])
        self._chunks.clear()
        return data


class _DrainableSink:
    """Write-only in-memory sink. Having no seek() makes FFmpeg treat the output as
    non-seekable, so muxers never go back to patch headers already sent."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def write(self, data: bytes) -> int:
        self._buffer += data
        return len(data)

    def drain(self) -> bytes:
        data = bytes(self._buffer)
        self._buffer.clear()
        return data


class _PyAVEncoder(_Encoder):
    """A compressed format encoded and muxed by FFmpeg through PyAV."""

    cheap = False

    def __init__(
        self,
        spec: _CodecSpec,
        input_sample_rate: int,
        *,
        streaming: bool,
        output_sample_rate: int = OUTPUT_SAMPLE_RATE,
        bit_rate: int | None = None,
    ) -> None:
        super().__init__(input_sample_rate, output_sample_rate)
        self._sink = _DrainableSink() if streaming else None
        # Not streaming: a seekable buffer lets muxers write exact headers (e.g. the
        # FLAC STREAMINFO sample count), and everything is returned by finish().
        self._whole = None if streaming else io.BytesIO()
        options = dict(spec.container_options)
        if streaming:
            # Push each packet out of FFmpeg's I/O buffer as soon as it is muxed.
            options["flush_packets"] = "1"
        self._container = av.open(
            self._sink if self._sink is not None else self._whole,
            mode="w",
            format=spec.container,
            options=options,
        )
        stream = self._container.add_stream(spec.codec, rate=output_sample_rate, layout="mono")
        if not isinstance(stream, AudioStream):
            raise TypeError(f"{spec.codec} is not an audio codec")
        if (rate := bit_rate or spec.bit_rate) is not None:
            stream.bit_rate = rate
        self._stream = stream
        self._next_pts = 0

    def _encode_output(self, samples: NDArray[np.float32]) -> bytes:
        if samples.size:
            frame = av.AudioFrame.from_ndarray(samples[np.newaxis, :], format="flt", layout="mono")
            frame.sample_rate = self._output_rate
            frame.time_base = Fraction(1, self._output_rate)
            frame.pts = self._next_pts
            self._next_pts += samples.size
            self._container.mux(self._stream.encode(frame))
        return self._take()

    def _close(self) -> bytes:
        self._container.mux(self._stream.encode(None))
        self._container.close()
        if self._whole is not None:
            return self._whole.getvalue()
        return self._take()

    def close(self) -> None:
        with self._lock:
            self._finished = True
            try:
                # Also after a finish() that failed before its own close; closing twice is harmless.
                self._container.close()
            except Exception:
                # Called while the response unwinds: the error that ended it is the one to report.
                logger.warning("closing an unfinished %s encoder failed", self._container.format.name, exc_info=True)

    def _take(self) -> bytes:
        return self._sink.drain() if self._sink is not None else b""


def create_encoder(
    fmt: AudioFormat,
    input_sample_rate: int,
    *,
    streaming: bool = True,
    output_sample_rate: int = OUTPUT_SAMPLE_RATE,
    bit_rate: int | None = None,
) -> StreamEncoder:
    """Build a fresh encoder for one response.

    With ``streaming=False`` the output is meant to be sent whole, so headers carry
    exact sizes (wav, flac); bytes may then be held back until ``finish``. Either way
    the file is the concatenation of everything ``encode`` and ``finish`` return.
    ``output_sample_rate`` and ``bit_rate`` serve other APIs' formats (ElevenLabs names
    a rate and a bit rate in each); OpenAI's are 24 kHz at the codec's default bit rate.
    """
    rate = output_sample_rate
    if fmt == "pcm":
        return _PcmEncoder(input_sample_rate, rate)
    if fmt == "wav":
        return _StreamingWavEncoder(input_sample_rate, rate) if streaming else _WholeWavEncoder(input_sample_rate, rate)
    if fmt in _CODEC_SPECS:
        spec = _CODEC_SPECS[fmt]
        return _PyAVEncoder(spec, input_sample_rate, streaming=streaming, output_sample_rate=rate, bit_rate=bit_rate)
    raise ValueError(f"unsupported audio format: {fmt!r}")


def encode_whole(fmt: AudioFormat, samples: NDArray[np.float32], sample_rate: int) -> bytes:
    """Encode a complete recording in one go."""
    encoder = create_encoder(fmt, sample_rate, streaming=False)
    return encoder.encode(samples) + encoder.finish()
