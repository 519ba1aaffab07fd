"""Audio features of the CosyVoice2 frontend, in numpy (no torchaudio, no librosa).

Each function reproduces what upstream feeds the corresponding model with:

- :func:`whisper_log_mel`: the S3Tokenizer v2 input, Whisper's ``log_mel_spectrogram`` with 128
  bins (16 kHz, n_fft 400, hop 160, centred periodic-Hann STFT, last frame dropped, power
  spectrum, log10 clamped at 1e-10, floored at max - 8, then ``(x + 4) / 4``).
- :func:`kaldi_fbank` / :func:`speaker_fbank`: the CAM++ input, Kaldi's ``fbank`` as
  ``torchaudio.compliance.kaldi.fbank(num_mel_bins=80, dither=0)`` computes it on float samples
  (25 ms povey window, 10 ms shift, edges snipped, DC removed, pre-emphasis 0.97, 512-point FFT,
  power spectrum, HTK-mel triangles from 20 Hz to Nyquist, natural log floored at float32
  epsilon), then mean-normalised over time.
- :func:`flow_log_mel`: the flow's prompt features, Matcha-TTS ``mel_spectrogram`` at 24 kHz
  (reflect padding of (n_fft - hop) / 2, uncentred periodic-Hann STFT, magnitude
  ``sqrt(re^2 + im^2 + 1e-9)``, 80 Slaney mel bins from 0 to 8000 Hz, natural log clamped at 1e-5).

Whisper and Matcha both use librosa's default filterbank (Slaney mel scale, Slaney area
normalisation): :func:`slaney_mel_filterbank`. Kaldi uses the HTK mel scale
``1127 ln(1 + f / 700)`` with unnormalised triangles: :func:`kaldi_mel_banks`.
Everything is computed in float64 and returned as float32.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Final

import numpy as np
import soxr
from numpy.lib.stride_tricks import sliding_window_view
from numpy.typing import NDArray

Float32Array = NDArray[np.float32]
Float64Array = NDArray[np.float64]

WHISPER_SAMPLE_RATE: Final = 16_000
WHISPER_N_FFT: Final = 400
WHISPER_HOP: Final = 160

KALDI_SAMPLE_RATE: Final = 16_000
KALDI_FRAME_LENGTH: Final = 400  # 25 ms
KALDI_FRAME_SHIFT: Final = 160  # 10 ms
KALDI_PADDED_FRAME: Final = 512  # frame length rounded up to a power of two
KALDI_PREEMPHASIS: Final = 0.97
KALDI_LOW_FREQ: Final = 20.0
KALDI_POVEY_POWER: Final = 0.85
KALDI_LOG_FLOOR: Final = float(np.finfo(np.float32).eps)

FLOW_SAMPLE_RATE: Final = 24_000
FLOW_N_FFT: Final = 1920
FLOW_HOP: Final = 480
FLOW_WIN: Final = 1920
FLOW_N_MELS: Final = 80
FLOW_FMIN: Final = 0.0
FLOW_FMAX: Final = 8000.0

_SLANEY_HZ_PER_MEL: Final = 200.0 / 3.0
_SLANEY_BREAK_HZ: Final = 1000.0
_SLANEY_BREAK_MEL: Final = _SLANEY_BREAK_HZ / _SLANEY_HZ_PER_MEL
_SLANEY_LOG_STEP: Final = float(np.log(6.4) / 27.0)


def whisper_log_mel(wav16k: NDArray[np.floating[Any]], n_mels: int = 128) -> Float32Array:
    """Whisper-style log-mel of 16 kHz audio, shape (n_mels, samples // 160)."""
    signal = _mono(wav16k)
    pad = WHISPER_N_FFT // 2
    if signal.size <= pad:
        raise ValueError(f"need more than {pad} samples for a Whisper log-mel, got {signal.size}")
    padded = np.pad(signal, pad, mode="reflect")
    frames = sliding_window_view(padded, WHISPER_N_FFT)[::WHISPER_HOP][:-1]
    spectrum = np.fft.rfft(frames * _periodic_hann(WHISPER_N_FFT), axis=-1)
    power = spectrum.real**2 + spectrum.imag**2
    filters = slaney_mel_filterbank(WHISPER_SAMPLE_RATE, WHISPER_N_FFT, n_mels)
    log_spec = np.log10(np.maximum(power @ filters.T, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).T.astype(np.float32)


def kaldi_fbank(wav16k: NDArray[np.floating[Any]], num_mel_bins: int = 80) -> Float32Array:
    """Kaldi log-mel filterbank of 16 kHz float audio, shape (frames, num_mel_bins).

    Samples are used as given (upstream passes [-1, 1] floats, not int16-scaled ones).
    """
    signal = _mono(wav16k)
    if signal.size < KALDI_FRAME_LENGTH:
        raise ValueError(f"need at least {KALDI_FRAME_LENGTH} samples for fbank, got {signal.size}")
    frames = sliding_window_view(signal, KALDI_FRAME_LENGTH)[::KALDI_FRAME_SHIFT]
    frames = frames - frames.mean(axis=1, keepdims=True)
    previous = np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)
    frames = (frames - KALDI_PREEMPHASIS * previous) * _povey_window(KALDI_FRAME_LENGTH)
    spectrum = np.fft.rfft(frames, n=KALDI_PADDED_FRAME, axis=-1)
    power = spectrum.real**2 + spectrum.imag**2
    banks = kaldi_mel_banks(num_mel_bins, KALDI_PADDED_FRAME, KALDI_SAMPLE_RATE, KALDI_LOW_FREQ)
    return np.log(np.maximum(power @ banks.T, KALDI_LOG_FLOOR)).astype(np.float32)


def speaker_fbank(wav16k: NDArray[np.floating[Any]]) -> Float32Array:
    """CAM++ input: 80-bin Kaldi fbank minus its mean over time, shape (frames, 80)."""
    feats = kaldi_fbank(wav16k, num_mel_bins=80)
    return feats - feats.mean(axis=0, keepdims=True)


def flow_log_mel(
    wav: NDArray[np.floating[Any]],
    *,
    sample_rate: int = FLOW_SAMPLE_RATE,
    n_fft: int = FLOW_N_FFT,
    hop: int = FLOW_HOP,
    win: int = FLOW_WIN,
    n_mels: int = FLOW_N_MELS,
    fmin: float = FLOW_FMIN,
    fmax: float = FLOW_FMAX,
) -> Float32Array:
    """Matcha-TTS log-mel (the flow's feature), shape (n_mels, frames)."""
    if not 0 < win <= n_fft:
        raise ValueError("need 0 < win <= n_fft")
    signal = _mono(wav)
    pad = (n_fft - hop) // 2
    if signal.size <= pad or signal.size + 2 * pad < n_fft:
        raise ValueError(f"audio of {signal.size} samples is too short for n_fft {n_fft}, hop {hop}")
    padded = np.pad(signal, pad, mode="reflect")
    window = np.zeros(n_fft)
    start = (n_fft - win) // 2
    window[start : start + win] = _periodic_hann(win)
    frames = sliding_window_view(padded, n_fft)[::hop]
    spectrum = np.fft.rfft(frames * window, axis=-1)
    magnitude = np.sqrt(spectrum.real**2 + spectrum.imag**2 + 1e-9)
    filters = slaney_mel_filterbank(sample_rate, n_fft, n_mels, fmin, fmax)
    return np.log(np.maximum(magnitude @ filters.T, 1e-5)).T.astype(np.float32)


def resample(wav: NDArray[np.floating[Any]], orig_rate: int, target_rate: int) -> Float32Array:
    """Band-limited resampling (soxr, very high quality)."""
    signal = _mono(wav)
    if orig_rate == target_rate:
        return signal.astype(np.float32)
    return np.asarray(soxr.resample(signal, orig_rate, target_rate, quality="VHQ"), dtype=np.float32)


def hz_to_mel_slaney(freq: NDArray[np.floating[Any]] | float) -> Float64Array:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    hz = np.asarray(freq, dtype=np.float64)
    linear = hz / _SLANEY_HZ_PER_MEL
    logarithmic = _SLANEY_BREAK_MEL + np.log(np.maximum(hz, _SLANEY_BREAK_HZ) / _SLANEY_BREAK_HZ) / _SLANEY_LOG_STEP
    return np.where(hz >= _SLANEY_BREAK_HZ, logarithmic, linear)


def mel_to_hz_slaney(mels: NDArray[np.floating[Any]] | float) -> Float64Array:
    """Inverse of :func:`hz_to_mel_slaney`."""
    mel = np.asarray(mels, dtype=np.float64)
    linear = mel * _SLANEY_HZ_PER_MEL
    logarithmic = _SLANEY_BREAK_HZ * np.exp(_SLANEY_LOG_STEP * (np.maximum(mel, _SLANEY_BREAK_MEL) - _SLANEY_BREAK_MEL))
    return np.where(mel >= _SLANEY_BREAK_MEL, logarithmic, linear)


@lru_cache(maxsize=16)
def slaney_mel_filterbank(
    sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> Float64Array:
    """librosa's default mel filterbank (Slaney scale and area normalisation), (n_mels, n_fft // 2 + 1)."""
    top = sample_rate / 2.0 if fmax is None else fmax
    fft_freqs = np.fft.rfftfreq(n_fft, d=1.0 / sample_rate)
    edges = mel_to_hz_slaney(np.linspace(hz_to_mel_slaney(fmin), hz_to_mel_slaney(top), n_mels + 2))
    widths = np.diff(edges)
    offsets = edges[:, None] - fft_freqs[None, :]
    rising = -offsets[:-2] / widths[:-1, None]
    falling = offsets[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    weights.setflags(write=False)
    return weights


def hz_to_mel_htk(freq: NDArray[np.floating[Any]] | float) -> Float64Array:
    """Kaldi's (HTK) mel scale."""
    return 1127.0 * np.log1p(np.asarray(freq, dtype=np.float64) / 700.0)


@lru_cache(maxsize=16)
def kaldi_mel_banks(
    num_bins: int, padded_frame: int, sample_rate: int, low_freq: float = 20.0, high_freq: float = 0.0
) -> Float64Array:
    """Kaldi's triangular mel banks, (num_bins, padded_frame // 2 + 1); the Nyquist bin gets weight 0.

    A ``high_freq`` <= 0 is an offset from Nyquist, as in Kaldi.
    """
    nyquist = sample_rate / 2.0
    top = high_freq if high_freq > 0 else nyquist + high_freq
    if not 0.0 <= low_freq < top <= nyquist:
        raise ValueError(f"bad mel band [{low_freq}, {top}] for Nyquist {nyquist}")
    mel_low = hz_to_mel_htk(low_freq)
    delta = (hz_to_mel_htk(top) - mel_low) / (num_bins + 1)
    left = mel_low + delta * np.arange(num_bins, dtype=np.float64)[:, None]
    center = left + delta
    right = center + delta
    num_fft_bins = padded_frame // 2
    bin_mels = hz_to_mel_htk(np.arange(num_fft_bins) * (sample_rate / padded_frame))[None, :]
    rising = (bin_mels - left) / (center - left)
    falling = (right - bin_mels) / (right - center)
    banks = np.zeros((num_bins, num_fft_bins + 1))
    banks[:, :num_fft_bins] = np.maximum(0.0, np.minimum(rising, falling))
    banks.setflags(write=False)
    return banks


def _mono(wav: NDArray[np.floating[Any]]) -> Float64Array:
    signal = np.asarray(wav, dtype=np.float64)
    if signal.ndim != 1:
        raise ValueError(f"expected mono audio as a 1-D array, got shape {signal.shape}")
    return signal


@lru_cache(maxsize=8)
def _periodic_hann(length: int) -> Float64Array:
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(length) / length)
    window.setflags(write=False)
    return window


@lru_cache(maxsize=4)
def _povey_window(length: int) -> Float64Array:
    window = (0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(length) / (length - 1))) ** KALDI_POVEY_POWER
    window.setflags(write=False)
    return window
