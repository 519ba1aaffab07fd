"""The flow-matching solve (10 Euler steps of the estimator, CFG pair included) as CUDA graphs.

Eager, one estimator call costs about the same at 2 rows as at 32 (launch-bound, ~22 ms on an
H100); replayed from a graph it costs 4-11 ms. Graphs need fixed shapes, so one is recorded per
(requests, frames) bucket when token2wav starts: requests in powers of two up to ``max_rows``,
frames in steps of ``frame_step`` up to ``max_frames``. A batch is copied into the smallest
bucket that holds it (padding rows and frames are masked, so they change nothing) and the graph
is replayed; a batch larger than every bucket returns None and runs eagerly.

The graphs share one memory pool and static input/output buffers: a lock keeps replays (with
their copies in and out) from overlapping.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from torch import Tensor

from tts_backends.cosyvoice2.flow_decoder import CausalConditionalCFM

_log = logging.getLogger(__name__)


class FlowSolverGraphs:
    """Replays a recorded flow-matching solve for batches that fit one of its buckets."""

    def __init__(
        self,
        decoder: CausalConditionalCFM,
        *,
        n_timesteps: int,
        mel_bins: int,
        max_rows: int,
        max_frames: int,
        frame_step: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self._rows = [1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows]
        self._frames = list(range(frame_step, max_frames + 1, frame_step))
        rows, frames = self._rows[-1], self._frames[-1]
        self._mu = torch.zeros(rows, mel_bins, frames, device=device, dtype=dtype)
        self._mask = torch.zeros(rows, 1, frames, device=device, dtype=dtype)
        self._speaker = torch.zeros(rows, mel_bins, device=device, dtype=dtype)
        self._cond = torch.zeros(rows, mel_bins, frames, device=device, dtype=dtype)
        self._streaming = torch.zeros(rows, device=device, dtype=torch.bool)
        self._out = torch.zeros(rows, mel_bins, frames, device=device, dtype=torch.float32)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # The static buffers serve one replay at a time.
        self._lock = threading.Lock()
        started = time.monotonic()
        self._capture(decoder, n_timesteps, device)
        self.capture_s = time.monotonic() - started
        _log.info("flow solve captured for %d buckets in %.1f s", len(self._graphs), self.capture_s)

    @property
    def buckets(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)

    def __call__(self, mu: Tensor, mask: Tensor, speaker: Tensor, cond: Tensor, streaming: Tensor) -> Tensor | None:
        count, _, length = mu.shape
        rows = next((r for r in self._rows if r >= count), None)
        frames = next((f for f in self._frames if f >= length), None)
        if rows is None or frames is None:
            return None
        with self._lock:
            return self._replay(rows, frames, mu, mask, speaker, cond, streaming)

    def _replay(
        self, rows: int, frames: int, mu: Tensor, mask: Tensor, speaker: Tensor, cond: Tensor, streaming: Tensor
    ) -> Tensor:
        count, _, length = mu.shape
        self._mask[:rows, :, :frames].zero_()
        self._mu[:count, :, :length] = mu
        self._mask[:count, :, :length] = mask
        self._speaker[:count] = speaker
        self._cond[:count, :, :length] = cond
        self._streaming[:count] = streaming
        self._graphs[rows, frames].replay()
        return self._out[:count, :, :length].clone()

    def _solve(self, decoder: CausalConditionalCFM, n_timesteps: int, rows: int, frames: int) -> None:
        self._out[:rows, :, :frames] = decoder(
            self._mu[:rows, :, :frames],
            self._mask[:rows, :, :frames],
            self._speaker[:rows],
            self._cond[:rows, :, :frames],
            n_timesteps,
            self._streaming[:rows],
        )

    @torch.inference_mode()
    def _capture(self, decoder: CausalConditionalCFM, n_timesteps: int, device: torch.device) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            # One eager solve at the largest shape initialises the kernels' libraries off the graph.
            self._solve(decoder, n_timesteps, self._rows[-1], self._frames[-1])
            for rows in reversed(self._rows):
                for frames in reversed(self._frames):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._solve(decoder, n_timesteps, rows, frames)
                    self._graphs[rows, frames] = graph
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
