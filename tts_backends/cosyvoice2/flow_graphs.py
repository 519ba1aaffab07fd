"""The flow-matching solve (10 Euler steps of the estimator, CFG pair included) as CUDA graphs.

Eager, one estimator call costs about the same at 2 rows as at 32 (launch-bound, ~22 ms on an
H100); replayed from a graph it costs 4-11 ms. Graphs need fixed shapes, so one is recorded per
(requests, frames) bucket when token2wav starts: requests in powers of two up to ``max_rows``,
frames in steps of ``frame_step`` up to ``max_frames``. A batch is copied into the smallest
bucket that holds it (padding rows and frames are masked, so they change nothing) and the graph
is replayed; a batch larger than every bucket returns None and runs eagerly.

With ``prefix_frames`` > 0 a second family of graphs solves streaming chunks after a recorded
voice prefix (:mod:`.flow_prefix`): the prefix is copied into static buffers of ``prefix_frames``
frames (only when the voice differs from the last one replayed), its unused frames masked.

The graphs share one memory pool and static input/output buffers: a lock keeps replays (with
their copies in and out) from overlapping. On a device without CUDA graphs (the CPU) every bucket
is solved eagerly over the same static buffers instead, which is how the tests check this
module's bookkeeping without a GPU.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from tts_backends.cosyvoice2.flow_decoder import CausalConditionalCFM
from tts_backends.cosyvoice2.flow_prefix import PrefixRecorder, PrefixReplay, VoicePrefix

_log = logging.getLogger(__name__)


class EagerReplay:
    """Stands in for a CUDA graph where there is none: replaying runs the recorded call again."""

    def __init__(self, solve: Callable[[], None]) -> None:
        self.replay = solve


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
        prefix_frames: int = 0,
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
        self._noise = torch.zeros(1, mel_bins, frames, device=device, dtype=dtype)
        self._decoder_noise = decoder.noise
        self.prefix_frames = prefix_frames
        self._prefix = self._prefix_buffers(decoder, n_timesteps, mel_bins, device, dtype)
        self._prefix_visible = torch.zeros(prefix_frames, device=device, dtype=torch.bool)
        self._loaded: VoicePrefix | None = None
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph | EagerReplay] = {}
        # The static buffers serve one replay at a time.
        self._lock = threading.Lock()
        started = time.monotonic()
        self._capture(decoder, n_timesteps, device)
        self.capture_s = time.monotonic() - started
        _log.info("flow solve captured for %d buckets in %.1f s", len(self._graphs), self.capture_s)

    @property
    def buckets(self) -> list[tuple[int, int, bool]]:
        """(calls, frames, after a prefix) of every recorded graph."""
        return sorted(self._graphs)

    def __call__(
        self,
        mu: Tensor,
        mask: Tensor,
        speaker: Tensor,
        cond: Tensor,
        streaming: Tensor,
        prefix: VoicePrefix | None = None,
    ) -> Tensor | None:
        count, _, length = mu.shape
        rows = next((r for r in self._rows if r >= count), None)
        frames = next((f for f in self._frames if f >= length), None)
        if rows is None or frames is None or (prefix is not None and prefix.frames > self.prefix_frames):
            return None
        with self._lock:
            if prefix is not None:
                self._load(prefix)
                self._noise[:, :, :length] = self._decoder_noise(prefix.frames, length)
            return self._replay(rows, frames, prefix is not None, mu, mask, speaker, cond, streaming)

    def _load(self, prefix: VoicePrefix) -> None:
        """Copy ``prefix`` into the static prefix buffers unless it is there already."""
        if self._loaded is prefix:
            return
        targets = [buffer[:, :, : prefix.frames] if buffer.dim() == 4 else buffer for buffer in self._prefix]
        torch._foreach_copy_(targets, list(prefix.tensors))
        self._prefix_visible.zero_()
        self._prefix_visible[: prefix.frames] = True
        self._loaded = prefix

    def _replay(
        self,
        rows: int,
        frames: int,
        after_prefix: bool,
        mu: Tensor,
        mask: Tensor,
        speaker: Tensor,
        cond: Tensor,
        streaming: Tensor,
    ) -> Tensor:
        count, _, length = mu.shape
        self._mask[:rows, :, :frames].zero_()
        self._mu[:count, :, :length] = mu
        self._mask[:count, :, :length] = mask
        self._speaker[:count] = speaker
        self._cond[:count, :, :length] = cond
        self._streaming[:count] = streaming
        self._graphs[rows, frames, after_prefix].replay()
        return self._out[:count, :, :length].clone()

    def _solve(
        self, decoder: CausalConditionalCFM, n_timesteps: int, rows: int, frames: int, after_prefix: bool
    ) -> None:
        tape = PrefixReplay(self._prefix, self._prefix_visible) if after_prefix else None
        self._out[:rows, :, :frames] = decoder(
            self._mu[:rows, :, :frames],
            self._mask[:rows, :, :frames],
            self._speaker[:rows],
            self._cond[:rows, :, :frames],
            n_timesteps,
            self._streaming[:rows],
            noise=self._noise[:, :, :frames] if after_prefix else None,
            tape=tape,
        )

    def _prefix_buffers(
        self, decoder: CausalConditionalCFM, n_timesteps: int, mel_bins: int, device: torch.device, dtype: torch.dtype
    ) -> list[Tensor]:
        """Static buffers shaped as a prefix of ``prefix_frames`` frames (found by recording one of zeros)."""
        if self.prefix_frames <= 0:
            return []
        zeros = torch.zeros(1, mel_bins, self.prefix_frames, device=device, dtype=dtype)
        recorder = PrefixRecorder()
        with torch.inference_mode():
            decoder(
                zeros,
                torch.ones(1, 1, self.prefix_frames, device=device, dtype=dtype),
                torch.zeros(1, mel_bins, device=device, dtype=dtype),
                zeros,
                n_timesteps,
                torch.ones(1, device=device, dtype=torch.bool),
                tape=recorder,
            )
        return [torch.zeros_like(tensor) for tensor in recorder.tensors]

    @torch.inference_mode()
    def _capture(self, decoder: CausalConditionalCFM, n_timesteps: int, device: torch.device) -> None:
        families = [False, True] if self.prefix_frames > 0 else [False]
        if device.type != "cuda":
            for key in itertools.product(self._rows, self._frames, families):
                self._graphs[key] = EagerReplay(functools.partial(self._solve, decoder, n_timesteps, *key))
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for after_prefix in families:
                # One eager solve at the largest shape initialises the kernels' libraries off the graph.
                self._solve(decoder, n_timesteps, self._rows[-1], self._frames[-1], after_prefix)
                for rows in reversed(self._rows):
                    for frames in reversed(self._frames):
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool, stream=stream):
                            self._solve(decoder, n_timesteps, rows, frames, after_prefix)
                        self._graphs[rows, frames, after_prefix] = graph
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
