"""Joining CosyVoice2's streamed chunks: the vocoder state one request carries between chunks.

:class:`HiftStreamState` keeps the last mel frames (re-vocoded at the start of the next chunk),
the harmonic source under them (so the sine phase continues instead of restarting) and the
withheld audio tail that the next chunk cross-fades into. Free of model code, so it is tested
on plain signals; when to emit a chunk is :mod:`tts_gateway.models.cosyvoice2.orchestrator.streaming`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

DEFAULT_MEL_CACHE_FRAMES = 8
DEFAULT_SAMPLES_PER_FRAME = 480


def hamming_crossfade(overlap: int, *, normalized: bool = True) -> tuple[Tensor, Tensor]:
    """Fade-in and fade-out ramps of length ``overlap``: the halves of a ``2 * overlap`` Hamming window.

    Upstream CosyVoice uses the raw halves, whose sum is about 1.08 across the whole overlap, so
    every join gets a small gain step (an audible click on loud, steady sounds). ``normalized``
    divides both ramps by their sum, which keeps the Hamming shape but makes the gains add up to
    exactly one; ``normalized=False`` reproduces upstream's output sample for sample.
    """
    window = torch.from_numpy(np.hamming(2 * overlap)).to(torch.float64)
    fade_in, fade_out = window[:overlap], window[overlap:]
    if normalized:
        total = fade_in + fade_out
        fade_in, fade_out = fade_in / total, fade_out / total
    return fade_in.to(torch.float32), fade_out.to(torch.float32)


Vocoder = Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor]]
"""``(mel [1, 80, frames], cache_source [1, 1, n] | None) -> (wav [1, N], source [1, 1, N])``."""


class HiftStreamState:
    """Vocoder continuity of one streamed request.

    Chunk ``k`` is vocoded from the last ``mel_cache_frames`` mel frames of chunk ``k - 1``
    followed by its own new frames. The audio of those re-vocoded frames overlaps the tail that
    chunk ``k - 1`` withheld, and the two are cross-faded; the harmonic source of the cached
    frames is reused so that the excitation is phase-continuous. Non-final chunks withhold their
    last ``mel_cache_frames * samples_per_frame`` samples; the final chunk flushes everything, so
    the samples emitted over a whole request equal ``samples_per_frame`` times its mel frames.
    ``normalized_crossfade=False`` uses upstream's raw Hamming halves (see :func:`hamming_crossfade`).
    """

    def __init__(
        self,
        *,
        mel_cache_frames: int = DEFAULT_MEL_CACHE_FRAMES,
        samples_per_frame: int = DEFAULT_SAMPLES_PER_FRAME,
        normalized_crossfade: bool = True,
    ) -> None:
        if mel_cache_frames < 1 or samples_per_frame < 1:
            raise ValueError("mel_cache_frames and samples_per_frame must be positive")
        self.mel_cache_frames = mel_cache_frames
        self.samples_per_frame = samples_per_frame
        self.normalized_crossfade = normalized_crossfade
        self._mel: Tensor | None = None
        self._source: Tensor | None = None
        self._tail: Tensor | None = None
        self.finished = False

    @property
    def overlap_samples(self) -> int:
        """Samples withheld by a non-final chunk and cross-faded by the next (3840 by default)."""
        return self.mel_cache_frames * self.samples_per_frame

    def step(self, mel: Tensor, vocoder: Vocoder, *, final: bool) -> Tensor:
        """Vocode the new frames ``mel`` [1, 80, frames] of one chunk; returns the audio to emit [N]."""
        full, cache_source = self.prepare(mel)
        if full.shape[2] == 0:
            return self.finish(full, torch.zeros(0), torch.zeros(1, 1, 0), final=final)
        speech, source = vocoder(full, cache_source)
        return self.finish(full, speech[0], source, final=final)

    @property
    def cached_frames(self) -> int:
        """Mel frames kept from the last chunk to re-vocode at the start of the next (fewer after a short chunk)."""
        return 0 if self._mel is None else self._mel.shape[2]

    def recompute_cached(self, mel: Tensor) -> None:
        """Replace the cached frames by ``mel`` ``[1, 80, cached frames]``: the same frames solved again,
        finer than the chunk that kept them. The audio of the re-vocoded frames then carries the change,
        and the cross-fade with the withheld tail spans it."""
        if self._mel is None or mel.shape != self._mel.shape:
            raise ValueError(f"expected cached frames of shape {None if self._mel is None else list(self._mel.shape)}")
        self._mel = mel.clone()

    def prepare(self, mel: Tensor) -> tuple[Tensor, Tensor | None]:
        """The mel to vocode for new frames ``mel`` [1, 80, frames] (the cached frames first) and the
        excitation to continue from; vocode them, then pass the result to :meth:`finish`."""
        if self.finished:
            raise RuntimeError("this stream was already finalised")
        if self._mel is not None:
            mel = torch.cat([self._mel.to(mel.dtype), mel], dim=2)
        return mel, self._source

    def finish(self, mel: Tensor, speech: Tensor, source: Tensor, *, final: bool) -> Tensor:
        """Audio to emit [N] from the vocoded ``speech`` [N] and ``source`` [1, 1, N] of :meth:`prepare`'s ``mel``."""
        if mel.shape[2] == 0:
            self.finished = final
            return torch.zeros(0)
        speech = speech.float()
        if self._tail is not None:
            speech = self._crossfade(speech, self._tail)
        if final:
            self._mel = self._source = self._tail = None
            self.finished = True
            return speech
        kept_frames = min(self.mel_cache_frames, mel.shape[2])
        kept_samples = kept_frames * self.samples_per_frame
        # Copies: the inputs may be views of a whole batch's output, which the state must not keep alive.
        self._mel = mel[:, :, -kept_frames:].clone()
        self._source = source[:, :, -kept_samples:].clone()
        self._tail = speech[-kept_samples:].clone()
        return speech[:-kept_samples]

    def _crossfade(self, speech: Tensor, tail: Tensor) -> Tensor:
        overlap = tail.shape[0]
        fade_in, fade_out = _ramps(overlap, self.normalized_crossfade, speech.device)
        joined = speech.clone()
        joined[:overlap] = speech[:overlap] * fade_in + tail * fade_out
        return joined


@functools.cache
def _ramps(overlap: int, normalized: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """:func:`hamming_crossfade` on ``device``, made once per length: a copy from the host at every join
    is a pageable copy, which waits for the device's stream (two per chunk of every stream)."""
    fade_in, fade_out = hamming_crossfade(overlap, normalized=normalized)
    return fade_in.to(device), fade_out.to(device)
