"""Speech tokens -> 24 kHz waveform: CosyVoice2's flow (tokens -> mel) followed by HiFT (mel -> audio).

Offline, all tokens are converted at once. Streaming, every chunk runs the flow over the voice
prompt and all target tokens so far (as upstream), keeps the mel of the tokens not converted yet,
and vocodes it with per-request HiFT state (:class:`HiftStreamState`) so that the chunks join
without clicks. With a voice prefix cache (``prefix_cache_mb``), what the flow computes for a
voice's prompt is recorded at the voice's first streaming chunk and later chunks solve only the
frames after it (:mod:`.flow_prefix`). With ``first_chunk_timesteps`` a stream's first chunk (unless it is
also its last) is solved in fewer Euler steps than the rest: its audio comes sooner. The next chunk solves
all frames again in full; the frames HiFT kept from the first chunk are replaced by their finer solve before
vocoding, so the change falls inside the cross-fade with the first chunk's withheld tail. A voice's prefix
is recorded at its first chunk solved in every step.

The per-request state lives in a dict keyed by a caller-chosen request id. Upstream mixed audio
between concurrent requests whose ids were empty or reused; here an id must be non-empty, a chunk
must continue exactly where the previous chunk of the same id stopped, and one id cannot run two
chunks at once, so a collision is an error instead of silently shared audio. State is dropped when
the final chunk is done, on :meth:`Token2Wav.release`, when a chunk fails, and after ``state_ttl_s``
seconds without a chunk (cancelled requests that never finalise).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, TypeAlias, cast

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import NDArray
from torch import Tensor
from torch._dynamo.exc import TorchDynamoException

from tts_gateway.models.cosyvoice2.engines.compiling import compile_failed
from tts_gateway.models.cosyvoice2.engines.cuda_memory import ReservedMemoryWatch, describe_step
from tts_gateway.models.cosyvoice2.engines.encoder_graphs import MAX_ROWS as ENCODER_GRAPH_ROWS
from tts_gateway.models.cosyvoice2.engines.encoder_graphs import EncoderGraphs
from tts_gateway.models.cosyvoice2.engines.flow_compile import ALIGNED_FRAMES, compile_flow_levels
from tts_gateway.models.cosyvoice2.engines.flow_graphs import FlowSolverGraphs
from tts_gateway.models.cosyvoice2.engines.hift_compile import compile_hift_activations
from tts_gateway.models.cosyvoice2.engines.hift_graphs import HiftGraphs
from tts_gateway.models.cosyvoice2.model.config import load_config
from tts_gateway.models.cosyvoice2.model.flow import CausalFlow, FlowItem, MelSolver
from tts_gateway.models.cosyvoice2.model.flow_decoder import NOISE_FRAMES
from tts_gateway.models.cosyvoice2.model.flow_prefix import (
    VoicePrefix,
    VoicePrefixCache,
    frames_within,
    prefix_nbytes,
    voice_key,
)
from tts_gateway.models.cosyvoice2.model.hift import HiFTGenerator
from tts_gateway.models.cosyvoice2.model.hift_stream import DEFAULT_MEL_CACHE_FRAMES, HiftStreamState

_log = logging.getLogger(__name__)

DEFAULT_STATE_TTL_S = 300.0
# Calls whose prompt + tokens lie within this many of each other share one flow pass (one padded batch).
_GROUP_SPAN_TOKENS = 128
# Rows x mel frames of one eager HiFT call at most, unless a single row is longer (more rows are
# vocoded in slices, each slice's noise drawn for it alone; rows never mix).
# Its CUDA memory grows with both (about 0.24 MiB a row and frame at CosyVoice2's size, float32), and
# torch's allocator keeps the largest call's for good: unbounded, the moment many streams' final chunks
# meet would set the memory a GPU needs, long after start. Its time is nearly flat up to this size (14 ms for
# one row of 50 frames, 40 ms for 32 rows of 100 on an H200), so slicing costs little.
EAGER_HIFT_ROW_FRAMES: Final = 3200
# The rows of the eager call made at load to reserve that memory from the start.
_RESERVED_HIFT_ROWS = 32
# Voices whose streams' chunks one flow solve converts after their prefixes; a group of chunks of more voices is
# solved in several. The recorded solves keep a slot per voice in static buffers of prefix_frames frames, about
# 1.1 MiB a frame in fp16 (half the solver's steps: 220 MiB a slot at 200 frames, 330 at 300); with a compiled
# estimator eager solves stack as many, so that it meets one shape of them.
PREFIX_VOICES: Final = 4

SpeechTokens: TypeAlias = Sequence[int] | NDArray[np.integer[Any]]


class SpeechPrompt(Protocol):
    """The voice a request speaks with (``frontend.VoicePrompt`` has this shape)."""

    @property
    def speech_tokens(self) -> NDArray[np.int64]:
        """(L,) speech tokens of the reference recording."""
        ...

    @property
    def feats(self) -> NDArray[np.float32]:
        """(2L, 80) 24 kHz log-mel frames of the reference recording."""
        ...

    @property
    def embedding(self) -> NDArray[np.float32]:
        """(192,) speaker embedding."""
        ...


@dataclass(frozen=True, eq=False)
class Conversion:
    """One call of a batch: offline when ``token_offset`` is None, else one chunk of stream ``session_id``."""

    session_id: str
    tokens: SpeechTokens
    prompt: SpeechPrompt
    token_offset: int | None = None
    finalize: bool = True
    speed: float = 1.0


def flow_tokens(call: Conversion) -> int:
    """The call's prompt and target tokens: a flow pass pads its rows to the longest of these."""
    return int(np.size(call.prompt.speech_tokens)) + int(np.size(call.tokens))


def near_in_length(leader: Conversion, call: Conversion) -> bool:
    """Whether ``call`` may share ``leader``'s flow pass: a group of such calls spans at most
    ``_GROUP_SPAN_TOKENS``, so it stays one pass without much padding.

    Measured from the leader, not in fixed steps of the span: steps split calls a few tokens apart,
    and two voices whose prompts have 99 and 103 tokens had their first chunks in two passes."""
    return abs(flow_tokens(call) - flow_tokens(leader)) <= _GROUP_SPAN_TOKENS // 2


class StreamStateError(ValueError):
    """A streaming call that does not continue its request's state (unknown id, wrong offset, overlap)."""


@dataclass
class _Stream:
    hift: HiftStreamState
    generator: torch.Generator
    last_used: float
    consumed_tokens: int = 0
    busy: bool = False
    # The frames its HiFT state keeps were solved in fewer steps (a first chunk's): the next chunk's solve
    # recomputes them in full, and those replace them before vocoding.
    coarse_cache: bool = False


Audio: TypeAlias = NDArray[np.float32]
# A call ready to convert: its index among the calls, the call, its flow input and its stream (None offline).
_Ready: TypeAlias = tuple[int, Conversion, FlowItem, _Stream | None]


class Token2Wav:
    """Flow + HiFT, offline and streaming, safe to call from several threads at once.

    HiFT's excitation noise comes from a generator seeded with ``vocoder_seed`` per request (one
    per stream, carried across its chunks), so equal tokens and prompt give equal audio.
    """

    def __init__(
        self,
        flow: CausalFlow,
        hift: HiFTGenerator,
        *,
        n_timesteps: int = 10,
        first_chunk_timesteps: int = 0,
        mel_cache_frames: int = DEFAULT_MEL_CACHE_FRAMES,
        state_ttl_s: float = DEFAULT_STATE_TTL_S,
        vocoder_seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        solver: MelSolver | None = None,
        prefix_cache: VoicePrefixCache | None = None,
        prefix_limit: int = NOISE_FRAMES,
        hift_graphs: HiftGraphs | None = None,
        encoder_graphs: EncoderGraphs | None = None,
    ) -> None:
        if state_ttl_s <= 0:
            raise ValueError("state_ttl_s must be positive")
        if n_timesteps <= 0 or first_chunk_timesteps < 0:
            raise ValueError("n_timesteps must be positive and first_chunk_timesteps not negative")
        self.flow = flow
        self.hift = hift
        self.n_timesteps = n_timesteps
        # 0: first chunks take the steps every other call does.
        self.first_chunk_timesteps = first_chunk_timesteps or n_timesteps
        self.mel_cache_frames = mel_cache_frames
        self.state_ttl_s = state_ttl_s
        self.vocoder_seed = vocoder_seed
        self._clock = clock
        self._token_mel_ratio = flow.cfg.token_mel_ratio
        self._pre_lookahead = flow.cfg.pre_lookahead_len
        self._device = hift.conv_post.bias.device
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self.solver = solver
        self.hift_graphs = hift_graphs
        self.encoder_graphs = encoder_graphs
        self.prefix_cache = prefix_cache
        self.prefix_limit = prefix_limit
        if prefix_cache is not None:
            self.prefix_limit = _frames_within(prefix_cache, flow, n_timesteps, prefix_limit)
        self.sync_timing = False
        self.last_timing: dict[str, float] = {}
        if self._device.type == "cuda":
            self._reserve_eager_vocoding()
        self.memory_watch = ReservedMemoryWatch.for_device(self._device)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        hift_dtype: torch.dtype = torch.float32,
        n_timesteps: int = 10,
        first_chunk_timesteps: int = 0,
        state_ttl_s: float = DEFAULT_STATE_TTL_S,
        vocoder_seed: int = 0,
        graph_rows: int = 0,
        graph_frames: int = 1536,
        graph_frame_step: int = 64,
        prefix_cache_mb: int = 0,
        prefix_frames: int = 300,
        hift_graph_rows: int = 0,
        hift_graph_hops: Sequence[int] = (),
        compile_backend: str = "",
        fuse_flow: bool = True,
    ) -> Token2Wav:
        """Load ``cosyvoice2.yaml``, ``flow.pt`` and ``hift.pt`` from ``model_dir``.

        ``first_chunk_timesteps`` > 0 solves streams' first chunks (but final ones) in that many Euler steps
        instead of ``n_timesteps`` (with CUDA graphs, a multiple of :func:`~.flow_graphs.segment_steps`).
        ``dtype`` applies to the flow; HiFT stays in ``hift_dtype`` (float32 by default, as upstream
        keeps it even when the flow runs in fp16: it is cheap and its exp/iSTFT head is sensitive).
        ``graph_rows`` > 0 on a CUDA device records the flow-matching solve, in segments of Euler
        steps, as CUDA graphs for batches of up to that many calls and ``graph_frames`` mel frames, in
        buckets of ``graph_frame_step`` frames (:class:`FlowSolverGraphs`), and the flow's token encoder
        for the same frames and up to :data:`~.encoder_graphs.MAX_ROWS` rows (:class:`EncoderGraphs`).
        ``prefix_cache_mb`` > 0 keeps recorded voice prefixes of up to ``prefix_frames`` mel frames
        (:class:`VoicePrefixCache`; about 2.2 MiB a frame in fp16, 4.4 MiB in fp32, per voice; where CUDA graphs
        are recorded every voice takes ``prefix_frames`` frames' worth, as the graphs' buffers hold them).
        ``hift_graph_rows`` > 0 on a CUDA device records HiFT as CUDA graphs for the streamed chunks of
        ``hift_graph_hops`` tokens, in batches of powers of two up to that many (:class:`HiftGraphs`).
        A ``compile_backend`` ("inductor" on GPUs) compiles the flow estimator's U-Net levels
        (:mod:`.flow_compile`): where graphs are recorded, while recording the largest one, else at a
        warm-up. It needs buckets of a multiple of 8 frames. It compiles HiFT's activations too
        (:mod:`.hift_compile`). Compiled, the estimator computes in fewer
        kernels unless ``fuse_flow`` is False (its GELU then stays the exact one on CUDA as well).
        """
        device = torch.device(device)
        started = time.monotonic()
        cfg = load_config(model_dir / "cosyvoice2.yaml")
        flow = CausalFlow.from_checkpoint(cfg.flow, model_dir / "flow.pt", device, dtype)
        hift = HiFTGenerator.from_checkpoint(cfg.hift, model_dir / "hift.pt", device, hift_dtype)
        _log.info("flow and HiFT weights loaded onto %s in %.1f s", device, time.monotonic() - started)
        solver = None
        records_graphs = graph_rows > 0 and device.type == "cuda"
        prefix_cache = VoicePrefixCache(prefix_cache_mb << 20) if prefix_cache_mb > 0 else None
        prefix_frames = 0 if prefix_cache is None else _frames_within(prefix_cache, flow, n_timesteps, prefix_frames)
        if compile_backend:
            flow.prefix_slots = (PREFIX_VOICES, prefix_frames)
            if graph_rows > 0 and graph_frame_step % ALIGNED_FRAMES:
                raise ValueError(
                    f"compiling the flow's U-Net levels needs graph_frame_step a multiple of {ALIGNED_FRAMES}, "
                    f"not {graph_frame_step}"
                )
            # Recording the graphs compiles the levels at its largest bucket (see compile_flow_levels).
            seconds = compile_flow_levels(
                flow, compile_backend, n_timesteps=n_timesteps, warm_up=not records_graphs, fuse=fuse_flow
            )
            if not records_graphs:
                _log.info("flow U-Net levels compiled (%s) in %.1f s", compile_backend, seconds)
        if records_graphs:
            try:
                solver = FlowSolverGraphs(
                    flow.decoder,
                    n_timesteps=n_timesteps,
                    mel_bins=cfg.flow.output_size,
                    max_rows=graph_rows,
                    max_frames=graph_frames,
                    frame_step=graph_frame_step,
                    device=device,
                    dtype=dtype,
                    prefix_frames=prefix_frames,
                    prefix_voices=PREFIX_VOICES,
                    other_timesteps=[first_chunk_timesteps] if first_chunk_timesteps else [],
                )
            except TorchDynamoException as exc:
                raise compile_failed("the flow", compile_backend, exc) from exc
            if compile_backend:
                _log.info("flow U-Net levels compiled (%s) while the first graph was recorded", compile_backend)
        encoder_graphs = None
        if records_graphs:
            ratio = cfg.flow.token_mel_ratio
            encoder_graphs = EncoderGraphs(
                flow,
                max_rows=min(graph_rows, ENCODER_GRAPH_ROWS),
                max_tokens=graph_frames // ratio,
                token_step=max(1, graph_frame_step // ratio),
            )
        if compile_backend:
            seconds = compile_hift_activations(hift, compile_backend)
            _log.info("HiFT activations compiled (%s) in %.1f s", compile_backend, seconds)
        hift_graphs = None
        if hift_graph_rows > 0 and hift_graph_hops and device.type == "cuda":
            hift_graphs = HiftGraphs(
                hift,
                max_rows=hift_graph_rows,
                hops=hift_graph_hops,
                token_mel_ratio=cfg.flow.token_mel_ratio,
                cache_frames=DEFAULT_MEL_CACHE_FRAMES,
            )
        return cls(
            flow,
            hift,
            n_timesteps=n_timesteps,
            first_chunk_timesteps=first_chunk_timesteps,
            state_ttl_s=state_ttl_s,
            vocoder_seed=vocoder_seed,
            solver=solver,
            prefix_cache=prefix_cache,
            prefix_limit=prefix_frames,
            hift_graphs=hift_graphs,
            encoder_graphs=encoder_graphs,
        )

    @property
    def sample_rate(self) -> int:
        return self.hift.m_source.sampling_rate

    @property
    def active_streams(self) -> int:
        """Requests whose streaming state is currently held."""
        with self._lock:
            return len(self._streams)

    def offline(self, tokens: SpeechTokens, prompt: SpeechPrompt, *, speed: float = 1.0) -> NDArray[np.float32]:
        """All of ``tokens`` as one waveform (mono float32 at :attr:`sample_rate`).

        ``speed`` changes the tempo by stretching the mel linearly along time before vocoding, as
        upstream does: ``frames / speed`` frames are vocoded, so duration scales by ``1 / speed``
        while HiFT's F0 prediction keeps the pitch. Only offline synthesis supports it (upstream
        too): in a stream, the cached frames and cross-fades assume an unstretched mel.
        """
        return _unwrap(self.convert([Conversion("offline", tokens, prompt, speed=speed)])[0])

    def stream_chunk(
        self,
        request_id: str,
        tokens: SpeechTokens,
        prompt: SpeechPrompt,
        token_offset: int,
        finalize: bool,
    ) -> NDArray[np.float32]:
        """Audio of the tokens from ``token_offset`` on, for one chunk of the stream ``request_id``.

        ``tokens`` are all target tokens so far. A non-final chunk converts all but the last
        ``pre_lookahead_len`` (3) tokens, which only serve as look-ahead; the next chunk must then
        start at that point (``token_offset`` = tokens converted so far). The final chunk converts
        everything left and flushes the withheld cross-fade tail; the request's state is dropped.
        As in upstream's streaming loop, non-final chunks run the flow with chunked (streaming)
        attention and the final chunk with full attention.
        """
        return _unwrap(self.convert([Conversion(request_id, tokens, prompt, token_offset, finalize)])[0])

    def convert(
        self,
        calls: Sequence[Conversion],
        on_result: Callable[[int, Audio | Exception], None] | None = None,
        *,
        between_segments: Callable[[], None] | None = None,
    ) -> list[Audio | Exception]:
        """Every call's audio, or the error that call gets, converting the calls in a few batches.

        Streams' first chunks are converted first (a stream's first audio waits on nothing else in
        the batch), then the other calls grouped by length, shortest first: each group is padded
        only to its own longest row. In a group the flow runs once for all calls (rows padded and
        masked); HiFT once per set of calls with equally long mel. ``on_result(index, result)``
        hears of each call as soon as its result exists, a group's calls before the next group
        starts. A call's own mistake (bad tokens, a stream out of step) fails that call alone; a
        failure of a group raises, and drops the streams of every call not answered yet.
        ``between_segments`` is called between the parts of a flow solve replayed from CUDA graphs,
        where other calls may be converted (:class:`~.flow_graphs.FlowSolverGraphs`); its time does
        not count as the group's flow time.
        """
        results: list[Audio | Exception] = [ValueError("not converted")] * len(calls)

        def answer(index: int, result: Audio | Exception) -> None:
            results[index] = result
            if on_result is not None:
                on_result(index, result)

        ready: list[_Ready] = []
        for index, call in enumerate(calls):
            try:
                item = self._flow_item(call, self._check(call))
                stream = None if call.token_offset is None else self._checkout(call.session_id, call.token_offset)
            except Exception as exc:
                answer(index, exc)
                continue
            try:
                self.flow.check_item(item)
            except Exception as exc:
                # As any failed chunk: the stream cannot go on, so its state goes.
                if stream is not None:
                    self._checkin(call.session_id, stream, drop=True)
                answer(index, exc)
                continue
            ready.append((index, call, item, stream))
        unanswered = {index for index, *_ in ready}
        # On CUDA, from whichever thread calls (the Triton model's queue worker): replays and
        # synchronisations go to the model's device, not to the thread's current one.
        on_device = torch.cuda.device(self._device) if self._device.type == "cuda" else nullcontext()
        try:
            with torch.inference_mode(), on_device:
                for group in self._answer_groups(ready):
                    converted = self._convert_group(group, between_segments)
                    for (index, call, item, stream), wav in zip(group, converted, strict=True):
                        if stream is not None:
                            tokens = item.token.shape[0]
                            stream.consumed_tokens = tokens if call.finalize else tokens - self._pre_lookahead
                            self._checkin(call.session_id, stream, drop=call.finalize)
                        unanswered.discard(index)
                        answer(index, wav)
        finally:
            for index, call, _, stream in ready:
                if stream is not None and index in unanswered:
                    self._checkin(call.session_id, stream, drop=True)
        return results

    def _check(self, call: Conversion) -> Tensor:
        """The call's tokens as a tensor, after checking what can be checked before converting."""
        target = self._token_tensor(call.tokens)[0]
        if call.token_offset is None:
            if not (math.isfinite(call.speed) and call.speed > 0):
                raise ValueError(f"speed must be a positive number, got {call.speed}")
            if target.shape[0] == 0:
                raise ValueError("no speech tokens to convert")
            return target
        if not call.session_id:
            raise ValueError("request_id must be a non-empty id unique to the request")
        converted = target.shape[0] if call.finalize else target.shape[0] - self._pre_lookahead
        if converted < call.token_offset:
            raise ValueError(
                f"{target.shape[0]} tokens do not reach past token_offset {call.token_offset}"
                + ("" if call.finalize else f" plus the {self._pre_lookahead}-token look-ahead")
            )
        return target

    def _convert_group(self, group: list[_Ready], between_segments: Callable[[], None] | None) -> list[Audio]:
        """The audio of a group of calls of about one length and one count of solver steps (see
        :meth:`_answer_groups`)."""
        started = time.monotonic()
        lent = 0.0
        lend_the_gpu: Callable[[], None] | None = None
        if between_segments is not None:
            lender = between_segments

            def lend_the_gpu() -> None:
                nonlocal lent
                began = time.monotonic()
                lender()
                lent += time.monotonic() - began

        items = [item for _, _, item, _ in group]
        # One count for the whole group (see _answer_groups). A voice prefix holds what the estimator computed
        # over n_timesteps steps: no use to a shorter solve.
        steps = self._steps(group[0][1])
        own_steps = steps == self.n_timesteps
        prefixes = [self._prefix(call, item) if own_steps else None for _, call, item, _ in group]
        mels: list[Tensor] = [torch.zeros(0)] * len(items)
        eager_flow: list[tuple[int, int]] = []
        for members in self._solves(prefixes):
            first = prefixes[members[0]]
            grouped = self.flow.inference_batch(
                [items[i] for i in members],
                n_timesteps=steps,
                solver=self.solver,
                prefixes=None if first is None else [cast(VoicePrefix, prefixes[i]) for i in members],
                between_segments=lend_the_gpu,
                encoder=self.encoder_graphs,
                eager_solves=eager_flow,
            )
            for index, mel in zip(members, grouped, strict=True):
                mels[index] = mel
        if self.sync_timing and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        flowed = time.monotonic()
        # Per call: the mel to vocode, the excitation to continue from, and its generator.
        vocode: list[tuple[Tensor, Tensor | None, torch.Generator]] = []
        for (_, call, _, stream), mel in zip(group, mels, strict=True):
            mel = mel.unsqueeze(0)
            if stream is None:
                if call.speed != 1.0:
                    mel = F.interpolate(mel, size=max(1, int(mel.shape[2] / call.speed)), mode="linear")
                generator = torch.Generator(device=self._device).manual_seed(self.vocoder_seed)
                vocode.append((mel, None, generator))
            else:
                start = call.token_offset * self._token_mel_ratio
                if stream.coarse_cache:
                    stream.hift.recompute_cached(mel[:, :, start - stream.hift.cached_frames : start])
                stream.coarse_cache = steps < self.n_timesteps
                full, cache_source = stream.hift.prepare(mel[:, :, start:])
                vocode.append((full, cache_source, stream.generator))
        waves, eager_hift = self._vocode(vocode)
        audio = []
        for (_, call, _, stream), (mel, _, _), (wav, source) in zip(group, vocode, waves, strict=True):
            if stream is None:
                audio.append(self._to_numpy(wav))
            else:
                audio.append(self._to_numpy(stream.hift.finish(mel, wav, source, final=call.finalize)))
        # Mel frames of the group's solve (its longest call, voice prompt included).
        frames = self._token_mel_ratio * max(i.prompt_token.numel() + i.token.numel() for i in items)
        self.last_timing = {
            "rows": float(len(group)),
            "frames": float(frames),
            "flow_s": flowed - started - lent,
            "hift_s": time.monotonic() - flowed,
        }
        if self.memory_watch is not None and (rise := self.memory_watch.rise()) is not None:
            _log.info(
                "%s while converting %d calls of up to %d mel frames"
                " (flow solved eagerly: %s; HiFT batches vocoded eagerly: %s)",
                describe_step(rise),
                len(group),
                frames,
                _shapes(eager_flow),
                _shapes(eager_hift),
            )
        return audio

    def _steps(self, call: Conversion) -> int:
        """The Euler steps of the call's flow solve: fewer for a stream's first chunk that is not its last."""
        return self.first_chunk_timesteps if call.token_offset == 0 and not call.finalize else self.n_timesteps

    def _solves(self, prefixes: list[VoicePrefix | None]) -> list[list[int]]:
        """The group's calls in the flow solves they are converted in: those without a prefix together, and
        those with one together, up to :data:`PREFIX_VOICES` voices a solve."""
        plain = [index for index, prefix in enumerate(prefixes) if prefix is None]
        solves = [plain] if plain else []
        voices: dict[int, list[int]] = {}
        for index, prefix in enumerate(prefixes):
            if prefix is not None:
                voices.setdefault(id(prefix), []).append(index)
        members = list(voices.values())
        for first in range(0, len(members), PREFIX_VOICES):
            solves.append(sorted(index for voice in members[first : first + PREFIX_VOICES] for index in voice))
        return solves

    def _prefix(self, call: Conversion, item: FlowItem) -> VoicePrefix | None:
        """The recorded prefix of a streaming chunk's voice, recorded now if it is not cached yet."""
        if self.prefix_cache is None or not item.streaming:
            return None
        frames = self.flow.prefix_frames(item.prompt_token.numel(), self.prefix_limit)
        if frames == 0:
            return None
        prompt = call.prompt
        key = voice_key(np.asarray(prompt.speech_tokens), np.asarray(prompt.feats), np.asarray(prompt.embedding))
        prefix = self.prefix_cache.get(key)
        if prefix is not None and prefix.frames == frames:
            return prefix
        # Recorded only when it can be kept: a prefix used for one chunk costs more than it saves. Its keys and
        # values are kept for as many frames as the CUDA graphs' buffers hold: one copy each fills a slot.
        capacity = max(frames, self.solver.prefix_frames if isinstance(self.solver, FlowSolverGraphs) else 0)
        if not self.prefix_cache.make_room(prefix_nbytes(self.flow.decoder.estimator, self.n_timesteps, capacity)):
            return None
        prefix = self.flow.record_prefix(
            item.prompt_token, item.prompt_feat, item.embedding, frames, n_timesteps=self.n_timesteps, capacity=capacity
        )
        self.prefix_cache.put(key, prefix)
        return prefix

    def _answer_groups(self, ready: list[_Ready]) -> list[list[_Ready]]:
        """The calls in the groups they are converted and answered in: streams' first chunks first (those
        solved in fewer steps before the rest, so that they wait for no longer solve), then by length (prompt
        and target tokens), shortest first, each group spanning at most ``_GROUP_SPAN_TOKENS`` and answered in
        the order its calls came."""

        def key(entry: _Ready) -> tuple[bool, int, int]:
            return entry[1].token_offset != 0, self._steps(entry[1]), flow_tokens(entry[1])

        groups: list[list[_Ready]] = []
        for entry in sorted(ready, key=key):
            later, steps, tokens = key(entry)
            if groups:
                lead_later, lead_steps, lead_tokens = key(groups[-1][0])
                if (lead_later, lead_steps) == (later, steps) and tokens - lead_tokens <= _GROUP_SPAN_TOKENS:
                    groups[-1].append(entry)
                    continue
            groups.append([entry])
        return [sorted(group, key=lambda entry: entry[0]) for group in groups]

    def _vocode(
        self, calls: list[tuple[Tensor, Tensor | None, torch.Generator]]
    ) -> tuple[list[tuple[Tensor, Tensor]], list[tuple[int, int]]]:
        """HiFT over the calls: those of equal mel and excitation lengths together, from a CUDA graph where
        one was recorded for them; the rest (mels of any length) padded into one call per excitation length.
        Returns each call's waveform and excitation, and the (rows, frames) of every padded eager batch
        (vocoded in slices of rows where it is larger than :data:`EAGER_HIFT_ROW_FRAMES`).

        Unpadded, vocoding costs about the same for 1 row as for 32 (launch-bound): a group of chunks of
        25 lengths took 25 such calls."""
        groups: dict[tuple[int, int], list[int]] = {}
        for index, (mel, cache_source, _) in enumerate(calls):
            cached = 0 if cache_source is None else cache_source.shape[2]
            groups.setdefault((mel.shape[2], cached), []).append(index)
        out: list[tuple[Tensor, Tensor]] = [(torch.zeros(0), torch.zeros(1, 1, 0))] * len(calls)
        dtype = self.hift.conv_pre.bias.dtype
        eager: dict[int, list[_SameLength]] = {}
        for (frames, cached), members in groups.items():
            if frames == 0:
                continue
            mel = torch.cat([calls[i][0] for i in members]).to(device=self._device, dtype=dtype)
            sources = [calls[i][1] for i in members]
            cache = None if cached == 0 else torch.cat([s for s in sources if s is not None])
            generators = [calls[i][2] for i in members]
            if self.hift_graphs is None or not self.hift_graphs.covers(len(members), frames, cached):
                eager.setdefault(cached, []).append((members, mel, generators, cache))
                continue
            # Each call's draws from its own generator, whether a graph or HiFT itself vocodes it.
            graphed = self.hift_graphs(mel, self.hift.draw_noise(len(members), frames, generators), cache)
            wav, source = cast(tuple[Tensor, Tensor], graphed)
            for row, index in enumerate(members):
                out[index] = (wav[row], source[row : row + 1])
        eager_shapes = []
        for parts in (batch for same_cache in eager.values() for batch in _padding_batches(same_cache)):
            eager_shapes.append((sum(len(part[0]) for part in parts), max(part[1].shape[2] for part in parts)))
            for index, wav, source in _vocode_in_slices(self.hift, parts):
                out[index] = (wav, source)
        return out, eager_shapes

    @torch.inference_mode()
    def _reserve_eager_vocoding(self) -> None:
        """One padded eager HiFT call of the largest size :meth:`_vocode` makes of several rows, so that the
        allocator holds its memory from the start rather than from the first time many final chunks meet."""
        rows, frames = _RESERVED_HIFT_ROWS, EAGER_HIFT_ROW_FRAMES // _RESERVED_HIFT_ROWS
        dtype = self.hift.conv_pre.bias.dtype
        mel = torch.zeros(rows, self.hift.conv_pre.in_channels, frames, device=self._device, dtype=dtype)
        cache = torch.zeros(
            rows, 1, self.mel_cache_frames * self.hift.samples_per_frame, device=self._device, dtype=dtype
        )
        # Its own generator: the global one stays as it was. Per-row frames: the padded path, with its masks.
        noise = self.hift.draw_noise(rows, frames, torch.Generator(device=self._device).manual_seed(0))
        self.hift.vocode(mel, noise, cache, torch.full((rows,), frames, device=self._device))

    def _flow_item(self, call: Conversion, target: Tensor) -> FlowItem:
        # Copies: prompts are shared, read-only arrays (a voice cache hands the same one to many requests).
        prompt = call.prompt
        streaming = call.token_offset is not None and not call.finalize
        return FlowItem(
            token=target,
            prompt_token=torch.from_numpy(np.array(prompt.speech_tokens, dtype=np.int64)),
            prompt_feat=torch.from_numpy(np.array(prompt.feats, dtype=np.float32)),
            embedding=torch.from_numpy(np.array(prompt.embedding, dtype=np.float32)),
            streaming=streaming,
            finalize=call.finalize or call.token_offset is None,
        )

    def release(self, request_id: str) -> None:
        """Forget the streaming state of ``request_id`` (a cancelled request); unknown ids are ignored."""
        with self._lock:
            self._streams.pop(request_id, None)

    def evict_stale(self) -> int:
        """Drop idle streaming states older than ``state_ttl_s``; returns how many were dropped."""
        with self._lock:
            return self._evict_stale_locked(self._clock())

    def _evict_stale_locked(self, now: float) -> int:
        stale = [
            key
            for key, stream in self._streams.items()
            if not stream.busy and now - stream.last_used > self.state_ttl_s
        ]
        for key in stale:
            del self._streams[key]
        return len(stale)

    def _checkout(self, request_id: str, token_offset: int) -> _Stream:
        with self._lock:
            now = self._clock()
            self._evict_stale_locked(now)
            stream = self._streams.get(request_id)
            if stream is None:
                if token_offset != 0:
                    raise StreamStateError(
                        f"no streaming state for request {request_id!r} at token_offset {token_offset}: "
                        "the id is unknown, already finalised, released or expired"
                    )
                stream = _Stream(
                    hift=HiftStreamState(
                        mel_cache_frames=self.mel_cache_frames, samples_per_frame=self.hift.samples_per_frame
                    ),
                    generator=torch.Generator(device=self._device).manual_seed(self.vocoder_seed),
                    last_used=now,
                )
                self._streams[request_id] = stream
            elif stream.busy:
                raise StreamStateError(f"request {request_id!r} already has a chunk in progress")
            elif token_offset != stream.consumed_tokens:
                raise StreamStateError(
                    f"request {request_id!r} converted {stream.consumed_tokens} tokens so far, "
                    f"but the chunk starts at token_offset {token_offset}"
                )
            stream.busy = True
            return stream

    def _checkin(self, request_id: str, stream: _Stream, *, drop: bool) -> None:
        with self._lock:
            stream.busy = False
            stream.last_used = self._clock()
            if drop and self._streams.get(request_id) is stream:
                del self._streams[request_id]

    @staticmethod
    def _token_tensor(tokens: SpeechTokens) -> Tensor:
        array = np.asarray(tokens)
        if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
            raise ValueError("tokens must be a 1-D sequence of integer speech tokens")
        return torch.as_tensor(array.astype(np.int64))[None]

    @staticmethod
    def _to_numpy(wav: Tensor) -> NDArray[np.float32]:
        return np.ascontiguousarray(wav.detach().float().cpu().numpy(), dtype=np.float32)


def _frames_within(cache: VoicePrefixCache, flow: CausalFlow, n_timesteps: int, frames: int) -> int:
    """``frames``, fewer if a prefix that long would not fit the cache at all."""
    return min(frames, frames_within(flow.decoder.estimator, n_timesteps, cache.max_bytes))


def _unwrap(result: NDArray[np.float32] | Exception) -> NDArray[np.float32]:
    if isinstance(result, Exception):
        raise result
    return result


# Calls of one mel length to vocode: their indices, mels, generators of their noise and excitation caches.
_SameLength: TypeAlias = tuple[list[int], Tensor, list[torch.Generator], Tensor | None]
# A padded HiFT batch computes at most this many times the frames its rows hold; beyond it, a longer
# mel starts a batch of its own (one launch-bound call, about 15-20 ms on an H100, costs less than
# padding a group of short chunks to one long final chunk).
MAX_PADDING_WASTE: Final = 2.0


def _shapes(batches: list[tuple[int, int]]) -> str:
    return ", ".join(f"{rows} x {frames} frames" for rows, frames in batches) or "none"


def _padding_batches(
    parts: list[_SameLength],
) -> list[list[_SameLength]]:
    """``parts`` (calls of one mel length each) shortest first, in runs whose padding to their longest mel
    stays within :data:`MAX_PADDING_WASTE`."""
    batches: list[list[_SameLength]] = []
    rows = held = 0
    for part in sorted(parts, key=lambda part: part[1].shape[2]):
        count, length = part[1].shape[0], part[1].shape[2]
        if batches and (rows + count) * length <= MAX_PADDING_WASTE * (held + count * length):
            batches[-1].append(part)
            rows, held = rows + count, held + count * length
        else:
            batches.append([part])
            rows, held = count, count * length
    return batches


def _vocode_in_slices(hift: HiFTGenerator, parts: list[_SameLength]) -> Iterator[tuple[int, Tensor, Tensor]]:
    """Each call's waveform and excitation from HiFT over ``parts`` (calls of one excitation cache length), in
    slices of at most :data:`EAGER_HIFT_ROW_FRAMES` rows x the longest mel's frames (at least a row each),
    each slice's mels padded to its own longest where the parts differ in length.

    A slice's noise is drawn just before it is vocoded, each call's from its own generator as it would be
    drawn alone, and let go before the next slice draws. The noise is the largest of HiFT's inputs (9
    overtones at 24 kHz in float32, 0.016 MiB a row and frame): drawn for the whole batch, padded part by
    part and joined, 32 rows of 400 frames held three copies of 211 MiB at once, far beyond the slice's
    memory reserved at load. The slices' audio is kept until the batch is delivered (47 MiB for 32 rows of
    400 frames), which the reservation does not cover."""
    rows = [
        (index, mel[row : row + 1], generators[row], None if cache is None else cache[row : row + 1])
        for members, mel, generators, cache in parts
        for row, index in enumerate(members)
    ]
    step = max(1, EAGER_HIFT_ROW_FRAMES // max(mel.shape[2] for _, mel, _, _ in rows))
    for start in range(0, len(rows), step):
        chunk = rows[start : start + step]
        wav, source = _vocode_slice(hift, chunk, padded=len(parts) > 1)
        for row, (index, row_mel, _, _) in enumerate(chunk):
            length = row_mel.shape[2] * hift.samples_per_frame
            yield index, wav[row, :length], source[row : row + 1, :, :length]


def _vocode_slice(
    hift: HiFTGenerator, rows: list[tuple[int, Tensor, torch.Generator, Tensor | None]], *, padded: bool
) -> tuple[Tensor, Tensor]:
    """HiFT over ``rows`` (index, mel, generator, cache), their noise drawn here: a function of its own so
    that nothing of a slice but its audio outlives it."""
    caches = [cache for _, _, _, cache in rows if cache is not None]
    cache = torch.cat(caches) if caches else None
    if not padded:
        mel = torch.cat([mel for _, mel, _, _ in rows])
        noise = hift.draw_noise(mel.shape[0], mel.shape[2], [generator for _, _, generator, _ in rows])
        return hift.vocode(mel, noise, cache)
    mel, noise, frames = hift.padded(
        [mel for _, mel, _, _ in rows], [hift.draw_noise(1, mel.shape[2], [generator]) for _, mel, generator, _ in rows]
    )
    return hift.vocode(mel, noise, cache, frames)
