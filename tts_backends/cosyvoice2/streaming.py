"""Streaming bookkeeping for CosyVoice2 token2wav: when to emit a chunk, and how to join chunks.

Two independent pieces, both free of model code so they can be tested on plain signals:

* :class:`HopSchedule` decides how many new speech tokens each chunk converts. The first hop is
  small (first-chunk latency is the headline number); later hops grow so that the flow model,
  which re-runs over the whole prefix for every chunk, is called fewer times.
* :class:`HiftStreamState` carries the vocoder context of one request from chunk to chunk: the
  last mel frames (re-vocoded at the start of the next chunk), the harmonic source under them
  (so the sine phase continues instead of restarting) and the withheld audio tail that the next
  chunk cross-fades into.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch
from torch import Tensor

DEFAULT_FIRST_HOP = 15
DEFAULT_BASE_HOP = 25
DEFAULT_PRE_LOOKAHEAD = 3
DEFAULT_TOKEN_RATE = 25.0
DEFAULT_MEL_CACHE_FRAMES = 8
DEFAULT_SAMPLES_PER_FRAME = 480


class HopPolicy(StrEnum):
    """How the hop (new tokens per chunk) evolves after the first chunk."""

    FIXED = "fixed"
    """Every chunk after the first converts ``base_hop`` tokens."""
    EXPONENTIAL = "exponential"
    """Chunk ``i >= 1`` converts ``base_hop * 2**(i - 1)`` tokens, optionally capped."""
    TIME_BASED = "time_based"
    """Hops grow in steps of ``first_hop`` only while synthesis runs well ahead of real time."""


@dataclass(frozen=True)
class HopSchedule:
    """Token hop sizes of a streamed request.

    ``pre_lookahead`` tokens beyond the hop must already exist before a chunk is emitted: the
    flow encoder looks that far ahead, so the mel of the hop's last token is final only then.
    """

    first_hop: int = DEFAULT_FIRST_HOP
    base_hop: int = DEFAULT_BASE_HOP
    policy: HopPolicy = HopPolicy.EXPONENTIAL
    max_hop: int | None = None
    pre_lookahead: int = DEFAULT_PRE_LOOKAHEAD
    token_rate: float = DEFAULT_TOKEN_RATE

    def __post_init__(self) -> None:
        if self.first_hop < 1 or self.base_hop < 1:
            raise ValueError("hops must be at least one token")
        if self.max_hop is not None and self.max_hop < max(self.first_hop, self.base_hop):
            raise ValueError("max_hop must not be smaller than first_hop or base_hop")
        if self.pre_lookahead < 0:
            raise ValueError("pre_lookahead must not be negative")
        if self.token_rate <= 0:
            raise ValueError("token_rate must be positive")
        object.__setattr__(self, "policy", HopPolicy(self.policy))

    def next_hop(
        self,
        chunk_index: int,
        *,
        emitted_tokens: int = 0,
        pending_tokens: int = 0,
        elapsed_s: float = 0.0,
    ) -> int:
        """Hop of chunk ``chunk_index`` (0-based).

        The keyword arguments only matter for :attr:`HopPolicy.TIME_BASED`: ``emitted_tokens``
        tokens (``chunk_index`` chunks) were converted in ``elapsed_s`` seconds of wall time and
        ``pending_tokens`` unconverted tokens are waiting now.
        """
        if chunk_index < 0:
            raise ValueError("chunk_index must not be negative")
        if chunk_index == 0:
            return self.first_hop
        if self.policy is HopPolicy.FIXED:
            hop = self.base_hop
        elif self.policy is HopPolicy.EXPONENTIAL:
            # Past the cap the exact power no longer matters; bounding it keeps the integer small.
            hop = self.base_hop * 2 ** min(chunk_index - 1, 32)
        else:
            hop = self._time_based_hop(chunk_index, emitted_tokens, pending_tokens, elapsed_s)
        return hop if self.max_hop is None else min(hop, self.max_hop)

    def _time_based_hop(self, chunks_done: int, emitted_tokens: int, pending_tokens: int, elapsed_s: float) -> int:
        if elapsed_s <= 0:
            return self.first_hop
        seconds_per_chunk = elapsed_s / chunks_done
        lead_s = emitted_tokens / self.token_rate - elapsed_s
        # How many more chunks could be synthesised before playback catches up with us.
        spare_chunks = lead_s / seconds_per_chunk
        whole_hops = pending_tokens // self.first_hop
        if spare_chunks > 4:
            hop = (whole_hops + 1) * self.first_hop
        elif spare_chunks > 2:
            hop = whole_hops * self.first_hop
        else:
            hop = self.first_hop
        return max(self.first_hop, hop)

    def can_emit(self, available_tokens: int, token_offset: int, hop: int) -> bool:
        """Whether ``hop`` unconverted tokens plus the look-ahead exist beyond ``token_offset``."""
        return available_tokens - token_offset >= hop + self.pre_lookahead


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
        if self.finished:
            raise RuntimeError("this stream was already finalised")
        if self._mel is not None:
            mel = torch.cat([self._mel.to(mel.dtype), mel], dim=2)
        if mel.shape[2] == 0:
            self.finished = final
            return torch.zeros(0)
        speech, source = vocoder(mel, self._source)
        speech = speech[0].float()
        if self._tail is not None:
            speech = self._crossfade(speech, self._tail)
        if final:
            self._mel = self._source = self._tail = None
            self.finished = True
            return speech
        kept_frames = min(self.mel_cache_frames, mel.shape[2])
        kept_samples = kept_frames * self.samples_per_frame
        self._mel = mel[:, :, -kept_frames:]
        self._source = source[:, :, -kept_samples:]
        self._tail = speech[-kept_samples:]
        return speech[:-kept_samples]

    def _crossfade(self, speech: Tensor, tail: Tensor) -> Tensor:
        overlap = tail.shape[0]
        fade_in, fade_out = hamming_crossfade(overlap, normalized=self.normalized_crossfade)
        joined = speech.clone()
        joined[:overlap] = speech[:overlap] * fade_in.to(speech.device) + tail * fade_out.to(speech.device)
        return joined
