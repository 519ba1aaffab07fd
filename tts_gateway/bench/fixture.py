"""Benchmark fixture: a speech-contract model that answers with a tone at almost no cost.

Not a voice. ``benchmarks/bench.py`` sends the same requests to the gateway and to
Triton directly; with this model behind both, the difference is the gateway's own
overhead rather than synthesis. Every request (every sentence the gateway sends)
gets ``audio_seconds`` of a 440 Hz tone, cut into chunks of ``chunk_seconds``, the
first after an optional ``first_chunk_delay_ms`` that stands in for a backend's time
to first audio. Only ``triton_repo/profiles/bench.toml`` deploys it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

from tts_gateway.models import contract
from tts_gateway.models.request_parsing import ContractError, SynthesisRequest

VOICE: Final = "tone"
TONE_HZ: Final = 440.0
TONE_AMPLITUDE: Final = 0.25
# How often a first-chunk delay checks for cancellation.
_DELAY_SLICE: Final = 0.01


@dataclass(frozen=True)
class FixtureConfig:
    sample_rate: int
    audio_seconds: float
    chunk_seconds: float
    first_chunk_delay: float
    """Seconds before the first chunk."""

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> FixtureConfig:
        """Read the config's string parameters; every value must be positive (the delay may be 0)."""
        config = cls(
            sample_rate=int(params[contract.PARAM_SAMPLE_RATE]),
            audio_seconds=float(params["audio_seconds"]),
            chunk_seconds=float(params["chunk_seconds"]),
            first_chunk_delay=float(params["first_chunk_delay_ms"]) / 1000.0,
        )
        if config.sample_rate <= 0 or config.audio_seconds <= 0 or config.chunk_seconds <= 0:
            raise ValueError(f"sample_rate, audio_seconds and chunk_seconds must be positive: {config}")
        if not math.isfinite(config.first_chunk_delay) or config.first_chunk_delay < 0:
            raise ValueError(f"first_chunk_delay_ms must be 0 or more: {config}")
        return config

    @property
    def samples(self) -> int:
        return round(self.audio_seconds * self.sample_rate)

    @property
    def chunk_samples(self) -> int:
        return max(1, round(self.chunk_seconds * self.sample_rate))


def tone(samples: int, sample_rate: int) -> NDArray[np.float32]:
    """``samples`` of a sine at TONE_HZ, read-only (chunks are views of it)."""
    t = np.arange(samples, dtype=np.float64) / sample_rate
    wave: NDArray[np.float32] = (TONE_AMPLITUDE * np.sin(2 * np.pi * TONE_HZ * t)).astype(np.float32)
    wave.flags.writeable = False
    return wave


class ToneSource:
    """The fixture's synthesis: one precomputed waveform, served in chunks."""

    def __init__(self, config: FixtureConfig) -> None:
        self.config = config
        self._waveform = tone(config.samples, config.sample_rate)

    def synthesize(self, speech: SynthesisRequest, cancelled: Callable[[], bool]) -> Iterator[NDArray[np.float32]]:
        if speech.voice not in (None, VOICE):
            raise ContractError(f"unknown voice {speech.voice!r}; this model has only {VOICE!r}")
        if not self._wait(self.config.first_chunk_delay, cancelled):
            return
        step = self.config.chunk_samples
        for start in range(0, self._waveform.size, step):
            yield self._waveform[start : start + step]

    def _wait(self, seconds: float, cancelled: Callable[[], bool]) -> bool:
        """Sleep ``seconds`` in short slices; False if the request was cancelled meanwhile."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if cancelled():
                return False
            time.sleep(min(left, _DELAY_SLICE))
        return not cancelled()
