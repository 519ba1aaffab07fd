"""Decoding, validation and normalisation of voice reference recordings.

Voice cloning conditions the model on a short recording of the target voice. Users
upload it in whatever format their phone or browser produced, so this module
accepts any common format, and turns it into what every model expects (see
:mod:`tts_gateway.models.contract`): mono float32 at 16 kHz, without leading or trailing
silence, peak-normalised. Uploads are untrusted: every problem surfaces as
:class:`ReferenceAudioError` with a message fit for the API user, and decoding
stops early rather than expanding a small hostile file into unbounded memory.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import av
import numpy as np
import soundfile as sf
import soxr
from av.audio.stream import AudioStream
from av.container import InputContainer
from numpy.typing import NDArray

from tts_gateway.models.contract import REFERENCE_SAMPLE_RATE

MIN_INPUT_SAMPLE_RATE: Final = 4_000
MAX_INPUT_SAMPLE_RATE: Final = 384_000

_TARGET_PEAK: Final = 0.9
# Peaks below -60 dBFS are silence or a muted microphone; normalising them would
# only amplify noise.
_SILENT_PEAK: Final = 1e-3
# Trimming: 10 ms frames quieter than -40 dB relative to the loudest frame count
# as silence; 100 ms of margin keeps soft onsets and decays.
_TRIM_FRAME_SECONDS: Final = 0.01
_TRIM_RELATIVE_LEVEL: Final = 10 ** (-40 / 20)
_TRIM_MARGIN_SECONDS: Final = 0.1
# Decoding stops once this many times the allowed duration has been decoded: room for the
# silence trimmed afterwards, and a bound on the memory and time a small file can claim.
_DECODE_LIMIT_FACTOR: Final = 2.0
# Leading bytes of the containers left to libsndfile (WAV, RF64, Wave64, FLAC, Ogg,
# AIFF); everything else goes to FFmpeg, so libsndfile's many exotic parsers never
# see untrusted input and its mp3 decoder never writes warnings to stderr.
_SOUNDFILE_MAGIC: Final = (b"RIFF", b"RF64", b"riff", b"fLaC", b"OggS", b"FORM")
_UNDECODABLE: Final = "reference audio could not be decoded: unsupported or corrupt file"
# Samples (all channels) per block read from libsndfile.
_BLOCK_SAMPLES: Final = 1 << 18


class ReferenceAudioError(ValueError):
    """Message is safe to show to API users."""


@dataclass(frozen=True, eq=False)
class ReferenceAudio:
    """A validated reference recording: mono, 16 kHz, peak-normalised."""

    samples: NDArray[np.float32]
    sample_rate: int = REFERENCE_SAMPLE_RATE

    def __post_init__(self) -> None:
        if self.sample_rate != REFERENCE_SAMPLE_RATE:
            raise ValueError(f"reference audio must be at {REFERENCE_SAMPLE_RATE} Hz")
        if self.samples.ndim != 1 or self.samples.dtype != np.float32:
            raise ValueError("reference audio samples must be 1-D float32")

    @property
    def duration(self) -> float:
        """Length in seconds."""
        return self.samples.size / self.sample_rate

    def sha256(self) -> str:
        """Hex digest of the samples: a stable key for caches of derived features."""
        return hashlib.sha256(self.samples.astype("<f4", copy=False).tobytes()).hexdigest()

    def to_wav_bytes(self) -> bytes:
        """16-bit PCM WAV, for persisting uploads."""
        buffer = io.BytesIO()
        sf.write(buffer, self.samples, self.sample_rate, format="WAV", subtype="PCM_16")
        return buffer.getvalue()


def load_reference_audio(data: bytes, *, min_seconds: float = 1.0, max_seconds: float = 30.0) -> ReferenceAudio:
    """Decode ``data`` (any common audio format) into a normalised reference recording.

    Raises :class:`ReferenceAudioError` for anything that is not usable audio of
    ``min_seconds`` to ``max_seconds`` once silence is trimmed.
    """
    if not data:
        raise ReferenceAudioError("reference audio is empty")
    samples = _decode(data, max_seconds)
    if samples.size == 0:
        raise ReferenceAudioError("reference audio contains no samples")
    if float(np.max(np.abs(samples))) < _SILENT_PEAK:
        raise ReferenceAudioError("reference audio is silent")
    samples = _trim_silence(samples)
    duration = samples.size / REFERENCE_SAMPLE_RATE
    if duration < min_seconds:
        raise ReferenceAudioError(
            f"reference audio is too short: {duration:.1f} s of sound after trimming silence,"
            f" at least {min_seconds:g} s is needed"
        )
    if duration > max_seconds:
        raise ReferenceAudioError(
            f"reference audio is too long: {duration:.1f} s of sound after trimming silence,"
            f" at most {max_seconds:g} s is allowed"
        )
    peak = float(np.max(np.abs(samples)))
    normalised = (samples * np.float32(_TARGET_PEAK / peak)).astype(np.float32)
    normalised.setflags(write=False)
    return ReferenceAudio(normalised)


class _MonoCollector:
    """Collects decoded blocks as mono 16 kHz audio, enforcing the decoding limits."""

    def __init__(self, sample_rate: int, max_seconds: float) -> None:
        if not MIN_INPUT_SAMPLE_RATE <= sample_rate <= MAX_INPUT_SAMPLE_RATE:
            raise ReferenceAudioError(
                f"reference audio has an unsupported sample rate of {sample_rate} Hz"
                f" (supported: {MIN_INPUT_SAMPLE_RATE} to {MAX_INPUT_SAMPLE_RATE} Hz)"
            )
        self.sample_rate = sample_rate
        self._max_seconds = max_seconds
        self._max_frames = int(max_seconds * _DECODE_LIMIT_FACTOR * sample_rate)
        self._frames = 0
        self._resampler = (
            None
            if sample_rate == REFERENCE_SAMPLE_RATE
            else soxr.ResampleStream(sample_rate, REFERENCE_SAMPLE_RATE, 1, dtype="float32", quality="VHQ")
        )
        self._chunks: list[NDArray[np.float32]] = []

    def add(self, block: NDArray[np.float32], sample_rate: int) -> None:
        """Add a (frames, channels) block of float samples."""
        if sample_rate != self.sample_rate:
            raise ReferenceAudioError("reference audio changes sample rate midway")
        if not np.all(np.isfinite(block)):
            raise ReferenceAudioError("reference audio contains invalid samples (NaN or infinity)")
        self._frames += block.shape[0]
        if self._frames > self._max_frames:
            raise ReferenceAudioError(
                f"reference audio is too long: it runs past {self._max_seconds * _DECODE_LIMIT_FACTOR:g} s,"
                f" at most {self._max_seconds:g} s of sound is allowed"
            )
        mono = np.mean(block, axis=1, dtype=np.float32)
        if self._resampler is not None:
            mono = np.asarray(self._resampler.resample_chunk(mono), dtype=np.float32)
        self._chunks.append(mono)

    def finish(self) -> NDArray[np.float32]:
        if self._resampler is not None:
            tail = self._resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
            self._chunks.append(np.asarray(tail, dtype=np.float32))
        return np.concatenate(self._chunks) if self._chunks else np.zeros(0, dtype=np.float32)


def _decode(data: bytes, max_seconds: float) -> NDArray[np.float32]:
    """Decode with libsndfile (wav, flac, ogg), else with FFmpeg (mp3, aac, m4a, webm, ...)."""
    if not data.startswith(_SOUNDFILE_MAGIC):
        return _decode_with_ffmpeg(data, max_seconds)
    try:
        sound_file = sf.SoundFile(io.BytesIO(data))
    except (sf.SoundFileError, ValueError, TypeError):
        # E.g. a WAV holding a codec libsndfile lacks.
        return _decode_with_ffmpeg(data, max_seconds)
    with sound_file:
        collector = _MonoCollector(sound_file.samplerate, max_seconds)
        block_frames = max(1, _BLOCK_SAMPLES // max(1, sound_file.channels))
        try:
            # Read until the data ends rather than trusting the frame count in the
            # header, which may be absent (streamed files) or a lie.
            while (block := sound_file.read(block_frames, dtype="float32", always_2d=True)).size:
                collector.add(block, sound_file.samplerate)
        except ReferenceAudioError:
            raise
        except (sf.SoundFileError, ValueError) as exc:
            raise ReferenceAudioError(_UNDECODABLE) from exc
        return collector.finish()


def _decode_with_ffmpeg(data: bytes, max_seconds: float) -> NDArray[np.float32]:
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="replace")
    except (av.FFmpegError, ValueError) as exc:
        raise ReferenceAudioError(_UNDECODABLE) from exc
    with container:
        if not container.streams.audio:
            raise ReferenceAudioError("no audio found in the reference file")
        stream = container.streams.audio[0]
        collector: _MonoCollector | None = None
        for frame in _decoded_frames(container, stream):
            if collector is None:
                collector = _MonoCollector(frame.sample_rate, max_seconds)
            collector.add(_frame_to_block(frame), frame.sample_rate)
    if collector is None:
        raise ReferenceAudioError(_UNDECODABLE)
    return collector.finish()


def _decoded_frames(container: InputContainer, stream: AudioStream) -> Iterator[av.AudioFrame]:
    """The frames of ``stream``, decoded leniently like FFmpeg's command line does:
    a corrupt packet is skipped and a broken container ends the stream, so a
    truncated upload still yields its first part."""
    packets = container.demux(stream)
    while True:
        try:
            packet = next(packets)
        except (StopIteration, av.FFmpegError):
            return
        try:
            frames = stream.decode(packet)
        except av.FFmpegError:
            continue
        yield from frames


def _frame_to_block(frame: av.AudioFrame) -> NDArray[np.float32]:
    """A decoded frame as a (frames, channels) float32 array in [-1, 1]."""
    array = frame.to_ndarray()
    block = array.T if frame.format.is_planar else array.reshape(-1, frame.layout.nb_channels)
    if block.dtype.kind == "f":
        return block.astype(np.float32, copy=False)
    full_scale = float(2 ** (8 * block.dtype.itemsize - 1))
    if block.dtype.kind == "u":  # unsigned PCM is centred on half its range
        return ((block.astype(np.float64) - full_scale) / full_scale).astype(np.float32)
    return (block.astype(np.float64) / full_scale).astype(np.float32)


def _trim_silence(samples: NDArray[np.float32]) -> NDArray[np.float32]:
    """Cut leading and trailing silence; the loudest frame always survives."""
    frame = round(_TRIM_FRAME_SECONDS * REFERENCE_SAMPLE_RATE)
    n_frames = -(-samples.size // frame)
    padded = np.zeros(n_frames * frame, dtype=np.float64)
    padded[: samples.size] = samples
    energies = np.sqrt(np.mean(np.square(padded.reshape(n_frames, frame)), axis=1))
    loud = np.flatnonzero(energies >= energies.max() * _TRIM_RELATIVE_LEVEL)
    margin = round(_TRIM_MARGIN_SECONDS * REFERENCE_SAMPLE_RATE)
    start = max(0, int(loud[0]) * frame - margin)
    end = min(samples.size, (int(loud[-1]) + 1) * frame + margin)
    return samples[start:end]
