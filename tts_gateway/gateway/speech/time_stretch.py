"""Tempo change without pitch change, for models that cannot apply ``speed`` themselves.

WSOLA (waveform-similarity overlap-add, from ``audiotsm``) suits speech: it moves
whole waveform periods around instead of touching the spectrum, so voices keep
their timbre. It streams: each call returns the output that is ready so far.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from audiotsm import wsola
from audiotsm.base import TSM
from audiotsm.io.array import ArrayReader, ArrayWriter
from numpy.typing import NDArray

MIN_SPEED: Final = 0.25
MAX_SPEED: Final = 4.0

# Frames of about 40 ms hold a few pitch periods of any voice.
_FRAME_SECONDS: Final = 0.04


class TimeStretcher:
    """Changes the tempo of one mono stream by ``speed`` (> 1 is faster and shorter)."""

    def __init__(self, speed: float, sample_rate: int) -> None:
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {speed}")
        if sample_rate <= 0:
            raise ValueError(f"invalid sample rate: {sample_rate}")
        frame_length = 2 * round(sample_rate * _FRAME_SECONDS / 2)
        # Quarter-frame hops keep the analysis hop within one frame up to MAX_SPEED:
        # audiotsm 0.1.2 skips too much input when the analysis hop exceeds the frame,
        # which makes speeds above 2 too fast with its default half-frame hops.
        synthesis_hop = frame_length // 4
        analysis_hop = int(synthesis_hop * speed)
        # 1.0 is an exact passthrough rather than WSOLA resynthesising the same tempo.
        self._tsm: TSM | None = (
            None
            if speed == 1.0
            else wsola(1, frame_length=frame_length, analysis_hop=analysis_hop, synthesis_hop=synthesis_hop)
        )
        # Output length per input sample, from the hops WSOLA really uses.
        self._ratio = synthesis_hop / analysis_hop
        # audiotsm keeps up to a frame, its search tolerance and a hop of input
        # buffered; that many zeros at the end push every real sample through.
        self._flush_padding = 2 * frame_length + synthesis_hop + analysis_hop
        self._samples_in = 0
        self._samples_out = 0
        self._finished = False

    def process(self, samples: NDArray[np.float32]) -> NDArray[np.float32]:
        """Add mono samples; return the stretched samples ready so far (may be empty)."""
        self._check_open()
        samples = np.asarray(samples, dtype=np.float32)
        if samples.ndim != 1:
            raise ValueError(f"expected mono samples (1-D), got shape {samples.shape}")
        if self._tsm is None:
            return samples
        self._samples_in += samples.size
        out = self._run(self._tsm, samples, flush=False)
        self._samples_out += out.size
        return out

    def flush(self) -> NDArray[np.float32]:
        """Return the rest of the output; the stretcher cannot be used afterwards."""
        self._check_open()
        self._finished = True
        if self._tsm is None:
            return np.zeros(0, dtype=np.float32)
        tail = self._run(self._tsm, np.zeros(self._flush_padding, dtype=np.float32), flush=True)
        # Drop what the padding added beyond the stretched length of the real input.
        return tail[: max(0, round(self._samples_in * self._ratio) - self._samples_out)]

    @staticmethod
    def _run(tsm: TSM, samples: NDArray[np.float32], *, flush: bool) -> NDArray[np.float32]:
        writer = ArrayWriter(1)
        tsm.run(ArrayReader(samples[np.newaxis, :].astype(np.float64)), writer, flush=flush)
        return np.asarray(writer.data[0], dtype=np.float32)

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError("time stretcher already flushed")
