"""HiFT's vocoding of streamed chunks as CUDA graphs.

Eager, HiFT took 24 ms of a stream's first chunk (30 mel frames) on an H100, in a few hundred
small kernels; replayed from a graph they launch at once, as the flow's do.
A graph is recorded per exact chunk shape (HiFT vocodes padded rows exactly only when told each
row's frames, which these graphs do not record). Streaming makes few shapes, since every
non-final chunk converts one of the hop schedule's hops (``hops``, in tokens): its mel is
``token_mel_ratio`` frames a token, after the ``cache_frames`` mel frames carried from the
previous chunk (none for a stream's first chunk). Graphs are recorded for batches of a power of
two up to ``max_rows`` rows, a batch padded up to the next (rows never mix, so padding changes
nothing). A batch of another shape (most final chunks, offline requests) or larger than every
bucket runs eagerly (token2wav pads a group's such calls into one).

The excitation's random draws are made before the replay (:meth:`HiFTGenerator.draw_noise`, with
each request's own generator) and copied in, so graph and eager give the same audio up to
floating-point rounding. HiFT's Fourier transforms are matrix products (no cuFFT plan the graphs
would depend on, no host sync in ``torch.istft``). The graphs share one memory pool and static
buffers: a lock keeps replays (with their copies) from overlapping, which assumes every caller
queues its work on one CUDA stream (token2wav's calls all run on the device's current stream).
On the CPU every shape is vocoded eagerly over the same static buffers, which is how the tests
check this module's bookkeeping without a GPU.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from tts_gateway.models.cosyvoice2.engines.flow_graphs import EagerReplay
from tts_gateway.models.cosyvoice2.model.hift import ExcitationNoise, HiFTGenerator

_log = logging.getLogger(__name__)


class HiftGraphs:
    """Replays HiFT for batches of streamed chunks whose shape was recorded."""

    def __init__(
        self,
        hift: HiFTGenerator,
        *,
        max_rows: int,
        hops: Sequence[int],
        token_mel_ratio: int,
        cache_frames: int,
    ) -> None:
        if max_rows < 1 or not hops or min(hops) < 1:
            raise ValueError("HiFT graphs need max_rows >= 1 and at least one hop of a token or more")
        self._hift = hift
        self._rows = [1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows]
        # (mel frames, cached mel frames): a first chunk, and a later one after the cached frames.
        self._shapes = sorted(
            {(hop * token_mel_ratio + cached, cached) for hop in hops for cached in (0, cache_frames)}
        )
        self._per_frame = hift.samples_per_frame
        reference = hift.conv_pre.bias
        device, dtype = reference.device, reference.dtype
        rows, frames = self._rows[-1], max(frames for frames, _ in self._shapes)
        samples = frames * self._per_frame
        harmonics = hift.m_source.nb_harmonics + 1
        self._mel = torch.zeros(rows, hift.conv_pre.in_channels, frames, device=device, dtype=dtype)
        self._phase = torch.zeros(rows, harmonics, device=device)
        self._gaussian = torch.zeros(rows, harmonics, samples, device=device)
        # The excitation is in HiFT's dtype, the waveform in float32 (as HiFTGenerator.vocode returns them).
        self._cache = torch.zeros(rows, 1, cache_frames * self._per_frame, device=device, dtype=dtype)
        self._wav = torch.zeros(rows, samples, device=device)
        self._source = torch.zeros(rows, 1, samples, device=device, dtype=dtype)
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph | EagerReplay] = {}
        self._lock = threading.Lock()
        started = time.monotonic()
        self._capture(device)
        self.capture_s = time.monotonic() - started
        _log.info("HiFT captured for %d shapes in %.1f s", len(self._graphs), self.capture_s)

    @property
    def buckets(self) -> list[tuple[int, int, int]]:
        """(rows, mel frames, cached frames) of every recorded graph."""
        return sorted(self._graphs)

    def covers(self, count: int, frames: int, cached: int) -> bool:
        """Whether a graph vocodes ``count`` mels of ``frames`` frames after ``cached`` excitation samples."""
        return self._rows_for(count, frames, cached) is not None

    def _rows_for(self, count: int, frames: int, cached: int) -> int | None:
        rows = next((r for r in self._rows if r >= count), None)
        if rows is None or cached % self._per_frame or (frames, cached // self._per_frame) not in self._shapes:
            return None
        return rows

    @torch.inference_mode()
    def __call__(
        self, mel: Tensor, noise: ExcitationNoise, cache_source: Tensor | None
    ) -> tuple[Tensor, Tensor] | None:
        """:meth:`HiFTGenerator.vocode` of ``mel`` [B, 80, frames], or None for a shape not recorded."""
        count, _, frames = mel.shape
        cached = 0 if cache_source is None else cache_source.shape[2]
        rows = self._rows_for(count, frames, cached)
        if rows is None:
            return None
        samples = frames * self._per_frame
        with self._lock:
            self._mel[:count, :, :frames] = mel
            self._phase[:count] = noise.phase
            self._gaussian[:count, :, :samples] = noise.gaussian
            if cache_source is not None:
                self._cache[:count, :, :cached] = cache_source
            self._graphs[rows, frames, cached // self._per_frame].replay()
            return self._wav[:count, :samples].clone(), self._source[:count, :, :samples].clone()

    @torch.inference_mode()
    def _vocode(self, rows: int, frames: int, cached: int) -> None:
        samples = frames * self._per_frame
        noise = ExcitationNoise(self._phase[:rows], self._gaussian[:rows, :, :samples])
        cache = self._cache[:rows, :, : cached * self._per_frame] if cached else None
        wav, source = self._hift.vocode(self._mel[:rows, :, :frames], noise, cache)
        self._wav[:rows, :samples] = wav
        self._source[:rows, :, :samples] = source

    @torch.inference_mode()
    def _capture(self, device: torch.device) -> None:
        if device.type != "cuda":
            for rows, (frames, cached) in itertools.product(self._rows, self._shapes):
                self._graphs[rows, frames, cached] = EagerReplay(functools.partial(self._vocode, rows, frames, cached))
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for frames, cached in reversed(self._shapes):
                for rows in reversed(self._rows):
                    # Eagerly first: the FFT plans and convolution algorithms of this shape are made off the graph.
                    self._vocode(rows, frames, cached)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._vocode(rows, frames, cached)
                    self._graphs[rows, frames, cached] = graph
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
