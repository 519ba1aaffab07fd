"""The flow-matching solve (10 Euler steps of the estimator, CFG pair included) replayed from CUDA graphs.

Eager, one estimator call costs about the same at 2 rows as at 32 (launch-bound, ~22 ms on an
H100); replayed from a graph it costs 4-11 ms. Graphs need fixed shapes, so one is recorded per
(requests, frames) bucket when token2wav starts: requests in :func:`row_buckets` up to
``max_rows``, frames in steps of ``frame_step`` up to ``max_frames``. A batch is copied into the
smallest bucket that holds it (padding rows and frames are masked, so they change nothing); a
batch larger than every bucket returns None and runs eagerly.

A graph holds a segment of the solve's Euler steps (5 of 10), recorded once per bucket and replayed once
per segment with the segment's times copied in before. A solve of fewer steps (a first chunk's, with
``other_timesteps``) replays the same graphs with its own schedule's times, as long as its steps are
whole segments. Recording a segment instead of the whole solve halves the Python work of recording each
bucket, which pays for finer buckets: large batches cost in proportion to their padded size (on the
H100, measured with a graph per step, 16 rows of first chunks 129 ms, 9 and 12 rows in a 12-row bucket
104 and 108 ms). A graph per step cost 6-28 ms more per solve there (ten launches instead of one).

With ``prefix_frames`` > 0 a second family of graphs solves streaming chunks after recorded voice
prefixes (:mod:`.flow_prefix`), rows of up to ``prefix_voices`` voices in one solve: before each
segment each voice's tensors of its steps are copied into its slot of static buffers of
``prefix_frames`` frames (one copy per voice, not per row), their unused frames masked, and each row
gathers its voice's from there.

Between two segments a solve can hand the GPU to other batches (``between_segments``; the token2wav
queue converts streams' first chunks there, so that one that arrives during the first segment of a
group of later chunks waits for the rest of that segment, not of the pass): once the segment has
run, the solve's state is set aside, the others solve, and the state and inputs are restored. The
wait for the segment leaves the GPU idle for as long as the host takes to go on, and the state is
set aside and restored even when nothing waited; both are small against a segment.

The graphs share one memory pool and static buffers: a lock keeps solves of different threads (with
their copies in and out) from overlapping. On a device without CUDA graphs (the CPU) every bucket's
segment runs eagerly over the same static buffers instead, which is how the tests check this
module's bookkeeping without a GPU.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from tts_gateway.models.cosyvoice2.model.flow_decoder import CausalConditionalCFM
from tts_gateway.models.cosyvoice2.model.flow_prefix import (
    PrefixRecorder,
    PrefixReplay,
    VoicePrefix,
    replay_rows,
    voice_slots,
)

_log = logging.getLogger(__name__)


def segment_steps(n_timesteps: int) -> int:
    """Solver steps per recorded graph: the largest proper divisor of ``n_timesteps`` (5 of 10)."""
    return max((steps for steps in range(1, n_timesteps // 2 + 1) if n_timesteps % steps == 0), default=1)


def row_buckets(max_rows: int) -> list[int]:
    """Batch sizes that get a graph: powers of two, from 8 rows on also the sizes halfway between
    (12, 24, 48, ...), and ``max_rows`` itself; none above ``max_rows``.

    Small batches cost about the same at any size (launch-bound), large ones grow with their rows,
    so only large batches are worth buckets closer together."""
    sizes = {1 << i for i in range(max_rows.bit_length())}
    sizes |= {3 << (i - 1) for i in range(3, max_rows.bit_length() + 1)}
    return sorted(size for size in sizes | {max_rows} if 1 <= size <= max_rows)


class EagerReplay:
    """Stands in for a CUDA graph where there is none: replaying runs the recorded call again."""

    def __init__(self, solve: Callable[[], None]) -> None:
        self.replay = solve


class FlowSolverGraphs:
    """Solves batches that fit one of its buckets by replaying recorded segments of Euler steps."""

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
        prefix_voices: int = 4,
        other_timesteps: Sequence[int] = (),
    ) -> None:
        """``other_timesteps``: step counts besides ``n_timesteps`` the graphs also solve in, each a multiple of
        :func:`segment_steps` of ``n_timesteps`` (their segments are the same graphs with other times)."""
        self._rows = row_buckets(max_rows)
        self._frames = list(range(frame_step, max_frames + 1, frame_step))
        rows, frames = self._rows[-1], self._frames[-1]
        self._decoder = decoder
        self._mu = torch.zeros(rows, mel_bins, frames, device=device, dtype=dtype)
        self._mask = torch.zeros(rows, 1, frames, device=device, dtype=dtype)
        self._speaker = torch.zeros(rows, mel_bins, device=device, dtype=dtype)
        self._cond = torch.zeros(rows, mel_bins, frames, device=device, dtype=dtype)
        self._streaming = torch.zeros(rows, device=device, dtype=torch.bool)
        # The solve's state, advanced in place by every step, and the times of the segment being replayed.
        self._x = torch.zeros(rows, mel_bins, frames, device=device, dtype=dtype)
        self.n_timesteps = n_timesteps
        self.segment_steps = segment_steps(n_timesteps)
        self._t = torch.zeros(self.segment_steps, 1, device=device, dtype=dtype)
        self._dt = torch.zeros(self.segment_steps, 1, device=device, dtype=dtype)
        self._schedules: dict[int, list[tuple[Tensor, Tensor]]] = {}
        for count in (n_timesteps, *other_timesteps):
            if count <= 0 or count % self.segment_steps:
                raise ValueError(
                    f"a solve of {count} steps is no whole number of the graphs' segments of {self.segment_steps}"
                )
            steps = decoder.solver_steps(count, device, dtype)
            self._schedules[count] = [
                (
                    torch.stack([t for t, _ in steps[i : i + self.segment_steps]]),
                    torch.stack([dt for _, dt in steps[i : i + self.segment_steps]]),
                )
                for i in range(0, count, self.segment_steps)
            ]
        self.prefix_frames = prefix_frames
        self.prefix_voices = prefix_voices if prefix_frames > 0 else 0
        self._prefix = self._prefix_segment_buffers(decoder, mel_bins, device, dtype)
        # Each estimator row's entry in the buffers, and which of its prefix frames are real (in inference
        # mode, as the eager solves' are: a compiled level takes the first).
        with torch.inference_mode():
            self._prefix_rows = torch.zeros(2 * rows, device=device, dtype=torch.long)
            self._prefix_visible = torch.zeros(2 * rows, prefix_frames, device=device, dtype=torch.bool)
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph | EagerReplay] = {}
        # The static buffers serve one solve at a time; one called between the segments of another
        # (same thread) keeps and restores that one's state.
        self._lock = threading.RLock()
        # How long recording the first graph took (with a compiled estimator, that one compiles it).
        self.first_capture_s = 0.0
        started = time.monotonic()
        self._capture(device)
        self.capture_s = time.monotonic() - started
        _log.info(
            "flow solve captured in segments of %d steps for %d buckets in %.1f s (the first %.1f s)",
            self.segment_steps,
            len(self._graphs),
            self.capture_s,
            self.first_capture_s,
        )

    @property
    def buckets(self) -> list[tuple[int, int, bool]]:
        """(calls, frames, after a prefix) of every recorded graph."""
        return sorted(self._graphs)

    @torch.inference_mode()
    def __call__(
        self,
        mu: Tensor,
        mask: Tensor,
        speaker: Tensor,
        cond: Tensor,
        streaming: Tensor,
        prefixes: Sequence[VoicePrefix] | None = None,
        between_segments: Callable[[], None] | None = None,
        n_timesteps: int | None = None,
    ) -> Tensor | None:
        """The mel of the batch in ``n_timesteps`` steps (default: the graphs' own), or None when no bucket holds
        it, the graphs were not made for that many steps, or its rows' prefixes are of more voices than a solve
        holds, longer than the buffers or recorded over other steps. ``between_segments`` is called once each
        segment but the last has run on the GPU: it may solve other batches here."""
        steps = self.n_timesteps if n_timesteps is None else n_timesteps
        segments = self._schedules.get(steps)
        # A prefix's recorded steps are the graphs' own (_holds): it serves no other count.
        if segments is None or (prefixes is not None and steps != self.n_timesteps):
            return None
        count, _, length = mu.shape
        rows = next((r for r in self._rows if r >= count), None)
        frames = next((f for f in self._frames if f >= length), None)
        if rows is None or frames is None:
            return None
        placed = None if prefixes is None else voice_slots(prefixes)
        if placed is not None and not self._holds(placed[0]):
            return None
        with self._lock:
            inputs = (mu, mask, speaker, cond, streaming)
            return self._solve(rows, frames, segments, prefixes, placed, inputs, between_segments)

    def _holds(self, voices: list[VoicePrefix]) -> bool:
        return len(voices) <= self.prefix_voices and all(
            max(voice.frames, voice.capacity) <= self.prefix_frames and voice.steps == self.n_timesteps
            for voice in voices
        )

    def _solve(
        self,
        rows: int,
        frames: int,
        segments: list[tuple[Tensor, Tensor]],
        prefixes: Sequence[VoicePrefix] | None,
        placed: tuple[list[VoicePrefix], list[int]] | None,
        inputs: tuple[Tensor, Tensor, Tensor, Tensor, Tensor],
        between_segments: Callable[[], None] | None,
    ) -> Tensor:
        """``placed``: the prefixes' distinct voices and each row's slot among them (:func:`voice_slots`)."""
        count, _, length = inputs[0].shape
        self._load_inputs(rows, frames, *inputs)
        # The pre-drawn noise of the frames solved (each row's after its prefix's when it has one).
        if prefixes is None:
            self._x[:rows, :, :frames] = self._decoder.noise(0, frames)
        else:
            self._x[:count, :, :frames] = torch.cat([self._decoder.noise(p.frames, frames) for p in prefixes])
            self._x[count:rows, :, :frames] = 0.0  # padding rows: masked, and never mixed with the others
        voices, slots = placed or ([], [])
        if prefixes is not None:
            self._show(slots, prefixes, rows)
        graph = self._graphs[rows, frames, prefixes is not None]
        for index, (t, dt) in enumerate(segments):
            if index > 0 and between_segments is not None:
                # Replays only queue the work: the batches that arrived while the last segment ran are
                # seen once it is done (a wait that lets go of the GIL, so they can arrive).
                self._finished()
                # Other solves use the static buffers meanwhile: keep this one's state, then put it back.
                state = self._x[:rows, :, :frames].clone()
                between_segments()
                self._load_inputs(rows, frames, *inputs)
                self._x[:rows, :, :frames] = state
                if prefixes is not None:
                    self._show(slots, prefixes, rows)
            self._t.copy_(t)
            self._dt.copy_(dt)
            for slot, voice in enumerate(voices):
                self._load_segment(slot, voice, index)
            graph.replay()
        return self._x[:count, :, :length].to(torch.float32, copy=True)

    def _show(self, slots: list[int], prefixes: Sequence[VoicePrefix], rows: int) -> None:
        """Point each of the bucket's estimator rows at its voice's slot of the static prefix buffers and mark
        which of its frames are real."""
        entries, visible = replay_rows(
            slots, [p.frames for p in prefixes], rows, self.prefix_frames, self._prefix_rows.device
        )
        self._prefix_rows[: 2 * rows] = entries
        self._prefix_visible[: 2 * rows] = visible

    def _finished(self) -> None:
        """Wait until the GPU has run what was queued so far (nothing to wait for on the CPU)."""
        if self._x.is_cuda:
            torch.cuda.current_stream(self._x.device).synchronize()

    def _load_inputs(
        self, rows: int, frames: int, mu: Tensor, mask: Tensor, speaker: Tensor, cond: Tensor, streaming: Tensor
    ) -> None:
        """Copy a batch into the static inputs of its bucket; the padding rows and frames are masked."""
        count, _, length = mu.shape
        self._mask[:rows, :, :frames].zero_()
        self._mu[:count, :, :length] = mu
        self._mask[:count, :, :length] = mask
        self._speaker[:count] = speaker
        self._cond[:count, :, :length] = cond
        self._streaming[:count] = streaming

    def _load_segment(self, slot: int, voice: VoicePrefix, segment: int) -> None:
        """Copy the voice's tensors of the segment's solver steps into its slot of the static buffers. A voice
        recorded for the buffers' frames fills whole slots, which are contiguous: the copies then run as a few
        kernels, where copies into slices of their frames launch one each (about 1,400 a solve)."""
        per_segment = len(self._prefix)
        recorded = voice.tensors[segment * per_segment : (segment + 1) * per_segment]
        pair = slice(2 * slot, 2 * slot + 2)
        frames = voice.capacity
        targets = [buffer[pair, :, :frames] if buffer.dim() == 4 else buffer[pair] for buffer in self._prefix]
        torch._foreach_copy_(targets, list(recorded))

    def _segment(self, rows: int, frames: int, after_prefix: bool) -> None:
        """The segment's Euler steps over the bucket's rows and frames, in place on the static state."""
        tape = None
        if after_prefix:
            tape = PrefixReplay(self._prefix, self._prefix_rows[: 2 * rows], self._prefix_visible[: 2 * rows])
        guide = self._decoder.guidance(
            self._mu[:rows, :, :frames],
            self._mask[:rows, :, :frames],
            self._speaker[:rows],
            self._cond[:rows, :, :frames],
            self._streaming[:rows],
        )
        x = self._x[:rows, :, :frames]
        for step in range(self.segment_steps):
            x = self._decoder.step(x, guide, self._t[step], self._dt[step], tape)
        self._x[:rows, :, :frames] = x

    def _prefix_segment_buffers(
        self, decoder: CausalConditionalCFM, mel_bins: int, device: torch.device, dtype: torch.dtype
    ) -> list[Tensor]:
        """Static buffers shaped as a segment's solver steps of prefixes of ``prefix_frames`` frames for
        ``prefix_voices`` voices (found by recording a solve of that many steps over zeros). Made in inference
        mode, as the solves' own tensors are, and with their sizes marked static: a compiled level then
        compiles once for them, and never ties one of their sizes to the rows' when the two happen to be
        equal (which would compile it again, while a CUDA graph records, at the next row count)."""
        if self.prefix_frames <= 0:
            return []
        zeros = torch.zeros(1, mel_bins, self.prefix_frames, device=device, dtype=dtype)
        recorder = PrefixRecorder()
        with torch.inference_mode(), torch.compiler.set_stance("force_eager"):
            decoder(
                zeros,
                torch.ones(1, 1, self.prefix_frames, device=device, dtype=dtype),
                torch.zeros(1, mel_bins, device=device, dtype=dtype),
                zeros,
                self.segment_steps,
                torch.ones(1, device=device, dtype=torch.bool),
                tape=recorder,
            )
        with torch.inference_mode():
            buffers = [
                tensor.new_zeros(self.prefix_voices * tensor.size(0), *tensor.shape[1:]) for tensor in recorder.tensors
            ]
        for buffer in buffers:
            torch._dynamo.mark_static(buffer)
        return buffers

    @torch.inference_mode()
    def _capture(self, device: torch.device) -> None:
        families = [False, True] if self.prefix_frames > 0 else [False]
        if device.type != "cuda":
            for key in itertools.product(self._rows, self._frames, families):
                self._graphs[key] = EagerReplay(functools.partial(self._segment, *key))
            return
        started = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for after_prefix in families:
                # One eager segment at the largest shape initialises the kernels' libraries off the graph.
                self._segment(self._rows[-1], self._frames[-1], after_prefix)
                for rows in reversed(self._rows):
                    for frames in reversed(self._frames):
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool, stream=stream):
                            self._segment(rows, frames, after_prefix)
                        self._graphs[rows, frames, after_prefix] = graph
                        if len(self._graphs) == 1:
                            self.first_capture_s = time.monotonic() - started
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
