"""Continuous batching of speech-token generation: every request in flight advances in one step.

One scheduler thread owns the model. Callers :meth:`BatchingEngine.submit` a request with a
:class:`TokenSink`; between two steps the thread admits waiting requests (one padded, batched
prefill), then runs one decode step for all live requests together and hands each its new token.
Requests join and leave between steps: a finished or cancelled one frees its cache slot at once,
and the last live slot moves into the hole so that live requests always fill slots ``0..n-1``.

On CUDA every decode step (forward pass, sampling and the bookkeeping that prepares the next
step) is replayed from a CUDA graph, one per batch-size bucket and attention span (the cache
positions the step reads, :class:`SlotDecoder`), all captured when the engine starts; with a
``compile_backend`` the decoder's regions and the sampler are compiled first. Steps are
pipelined: the next step is launched (its inputs are already on the device) before the host
reads and hands out the ids of the last one, so the GPU decodes while the host delivers. A
request that ended at step ``k`` therefore runs one step more, whose id is dropped; that step
stays within the request's positions. On the CPU the same loop runs eagerly at the
exact batch size.

A text stream (:meth:`BatchingEngine.open_stream`) is a request whose text arrives while it
generates, laid out as :mod:`.llm_bistream` says: its first input (the voice prompt) is a prefill.
When a round ends and its next text is already there, the stream keeps its row and the decode steps
feed that input, one id a step, their draws dropped until the last (:meth:`BatchingEngine._feed_in_place`):
a round then costs the engine's thread what a plain request's tokens cost. At 64 text streams on one
H200 a step came every 8.2-8.5 ms so, against 16.1-16.6 ms while every round's end took the stream
out of its row (its cache copied aside and back, its sampling row reloaded, an extend pass). When
the next text is not there yet, the stream leaves its slot: its cache positions are copied aside
and the slot serves other requests until the text (or its end) arrives; it then comes back through
an extend pass, recorded like the decode steps per batch-size bucket and span, shared by all
streams whose round starts between the same two steps.

A prefill or extend pass is launched like a decode step: its first ids are copied out and handed out
after the step in flight, so starting a request never waits for the GPU.
"""

from __future__ import annotations

import functools
import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

import torch
from torch import Tensor

from tts_gateway.models.cosyvoice2.engines.llm_bistream import FILL_ID, BistreamLayout, Stage
from tts_gateway.models.cosyvoice2.engines.llm_decoder import SlotDecoder
from tts_gateway.models.cosyvoice2.engines.llm_sampling import SamplingRows, sample, seed_keys
from tts_gateway.models.cosyvoice2.model import vocab

_log = logging.getLogger(__name__)

# The columns a request can draw: every speech token, then <|eos1|> <|eos2|> <|eos3|> <|sos|> <|task_id|>.
COLUMN_IDS: tuple[int, ...] = (
    *range(vocab.SPEECH_TOKEN_OFFSET, vocab.SPEECH_TOKEN_OFFSET + vocab.SPEECH_TOKEN_SIZE),
    *range(vocab.EOS1_ID, vocab.TOKENIZER_SIZE),
)
_COLUMN_OF = {token_id: column for column, token_id in enumerate(COLUMN_IDS)}
_SPEECH_COLUMNS = vocab.SPEECH_TOKEN_SIZE
_SEED_LIMIT = 1 << 64
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
# Prompt lengths whose prefill is recorded as CUDA graphs (for 1, 2, 4 ... ``max_prefill_rows`` prompts
# at once, each padded to the longest's bucket); longer prompts run eagerly.
PREFILL_BUCKETS: tuple[int, ...] = tuple(range(64, 1025, 64))
# Ids an extend pass takes per row. A round's input is the round's last speech id (owed to the cache)
# and 5 text ids; the final one feeds the last input again, the rest of the text and <|task_id|>, within 8
# unless the round before drew the fill at once (then its whole input is fed again: an eager pass).
EXTEND_WIDTH = 8
# A request's first tokens whose times its handle keeps (a first chunk's, look-ahead included, with room
# for a grown first hop), and a text stream's first waits for input: what the stage trace places in time.
TRACED_TOKENS = 64
TRACED_WAITS = 8


class StepGate(Protocol):
    """Decides whether the engine leaves the GPU to another process before its next step."""

    def busy(self, produced: Sequence[int]) -> bool:
        """Whether to wait before a step for live requests that made ``produced`` tokens each so far."""
        ...

    def wait(self, stop: Callable[[], bool]) -> float:
        """Block until the GPU is left to the engine again or ``stop()`` holds (bounded); returns the
        seconds waited."""
        ...


class TokenSink(Protocol):
    """Where a request's tokens go; both methods are called from the engine's thread."""

    def token(self, token_id: int) -> None:
        """One generated speech-token id (stop ids are never passed on); raising cancels the request."""
        ...

    def finished(self, error: BaseException | None) -> None:
        """The request ended: normally, by a stop id, its length limit or cancellation, or by ``error``."""
        ...


@dataclass(frozen=True)
class Generation:
    """One validated request. ``seed`` is an unsigned 64-bit value; None draws one."""

    input_ids: tuple[int, ...]
    max_new_tokens: int
    min_new_tokens: int
    stop_ids: frozenset[int]
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int | None = None


@dataclass(eq=False)
class GenerationHandle:
    """A submitted request; :meth:`cancel` stops it at the engine's next step."""

    request: Generation
    sink: TokenSink
    submitted: float = field(default_factory=time.monotonic)
    admitted: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    produced: int = 0
    # Decode steps launched with the request's row: its next step writes at prompt length + launched.
    launched: int = 0
    # Decode steps the request ran in, their device time and how long the host waited for them:
    # the trace tells a GPU-bound engine (waits as long as the steps) from a host-bound one.
    steps: int = 0
    step_s: float = 0.0
    wait_s: float = 0.0
    # Of those steps, the ones still in flight when the engine launched the next, and the time from each
    # launch to the next: the engine's pace for the request, its GPU time and its thread's work between
    # steps. Steps landed before the engine yields the GPU to token2wav (:class:`StepGate`) have none.
    periods: int = 0
    period_s: float = 0.0
    # When its first TRACED_TOKENS tokens were handed out: the trace places a first chunk's tokens in time.
    token_times: list[float] = field(default_factory=list)
    ended: bool = False
    # Where its first decode step writes (the prompt's length; for a text stream, after each round's input).
    origin: int = field(init=False)
    # Bumped whenever the request leaves its row: ids of steps launched before are not its own any more.
    segment: int = 0
    _cancelled: bool = False

    def __post_init__(self) -> None:
        self.origin = len(self.request.input_ids)

    def cancel(self) -> None:
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled


@dataclass(eq=False)
class TextStreamHandle(GenerationHandle):
    """A generation whose text arrives in pieces; ``request.input_ids`` are its prompt speech ids.

    :meth:`add_text` and :meth:`end_text` may be called from any thread; :meth:`cancel` ends the
    stream at the engine's next step, also while it waits for text.
    """

    layout: BistreamLayout = field(kw_only=True)
    engine: BatchingEngine = field(kw_only=True, repr=False)
    key: Tensor = field(kw_only=True, repr=False)
    # Cache positions that hold the stream's input so far, ids drawn (fills included) and columns drawn.
    cached: int = 0
    drawn: int = 0
    since_input: int = 0
    seen: set[int] = field(default_factory=set)
    saved: Tensor | None = None
    feed: list[int] = field(default_factory=list)
    # A round's input fed in place, by decode steps: the ids still to feed, and how many of the draws
    # to land next are dropped (each forced step's but the last one's, and that of a step that was in
    # flight when the round ended).
    forcing: list[int] = field(default_factory=list)
    dropping: int = 0
    # Out of its row waiting for its next input: since when (0 while in a row), and the first
    # TRACED_WAITS such waits as (left, back) pairs for the trace.
    parked_at: float = 0.0
    waits: list[tuple[float, float]] = field(default_factory=list)

    def add_text(self, ids: Sequence[int]) -> None:
        """Append text token ids; ValueError after :meth:`end_text`."""
        self.engine._update_stream(lambda: self.layout.add_text(ids))

    def end_text(self) -> None:
        """Mark the text complete: the stream generates to its end."""
        self.engine._update_stream(self.layout.end_text)

    def cancel(self) -> None:
        super().cancel()
        self.engine._update_stream(lambda: None)


class _Rows:
    """The per-slot tensors of the sampler and the decode inputs, each ``[slots]`` or ``[slots, columns]``."""

    def __init__(self, slots: int, columns: int, device: torch.device) -> None:
        def vector(dtype: torch.dtype) -> Tensor:
            return torch.zeros(slots, device=device, dtype=dtype)

        def matrix() -> Tensor:
            return torch.zeros(slots, columns, device=device, dtype=torch.bool)

        self.tokens = vector(torch.int64)
        self.positions = vector(torch.int64)
        self.drawn = vector(torch.int64)
        # Rows whose step feeds a forced id: their draw is dropped, so it neither counts nor is seen.
        self.forced = vector(torch.bool)
        self.sampling = SamplingRows(
            temperature=vector(torch.float32),
            top_k=vector(torch.int64),
            top_p=vector(torch.float32),
            penalty=vector(torch.float32),
            keys=vector(torch.int64),
            steps=vector(torch.int64),
            min_new=vector(torch.int64),
            allowed=matrix(),
            stops=matrix(),
            seen=matrix(),
        )

    def all(self) -> list[Tensor]:
        s = self.sampling
        return [
            self.tokens,
            self.positions,
            self.drawn,
            self.forced,
            s.temperature,
            s.top_k,
            s.top_p,
            s.penalty,
            s.keys,
            s.steps,
            s.min_new,
            s.allowed,
            s.stops,
            s.seen,
        ]

    def window(self, start: int, stop: int) -> SamplingRows:
        s = self.sampling
        return SamplingRows(*(getattr(s, column.name)[start:stop] for column in fields(SamplingRows)))


@dataclass
class _Launched:
    """A pass on its way: the requests of its rows (in row order) and where their ids land."""

    handles: list[GenerationHandle]
    segments: list[int]
    drawn: Tensor
    # On CUDA the events around a decode step (start, end; the same untimed event twice after a pass that
    # starts rows); on the CPU the pass already ran, a decode step in ``eager_s``.
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None
    eager_s: float
    # When the engine's thread began launching it (``time.perf_counter``).
    launched_at: float
    # A decode step (counted in its requests' traces), or the prefill or extend pass that starts rows.
    decode: bool = True


class BatchingEngine:
    """Continuous-batching speech-token generation over a :class:`SlotDecoder`."""

    def __init__(
        self,
        decoder: SlotDecoder,
        *,
        cuda_graphs: bool,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        max_prefill_rows: int = 8,
        gate: StepGate | None = None,
        compile_backend: str = "",
        max_streams: int = 64,
    ) -> None:
        """``max_streams`` bounds the text streams open at once (a waiting one keeps its cache positions
        aside). ``compile_backend`` (for example "inductor") compiles the decoder's regions and the sampler
        before the graphs are recorded; a compile that fails raises RuntimeError."""
        self._decoder = decoder
        self._device = decoder.device
        self.slots = decoder.slots
        self._buckets = sorted({b for b in buckets if b <= self.slots} | {self.slots})
        self._max_prefill_rows = max_prefill_rows
        self._gate = gate
        self._columns = torch.tensor(COLUMN_IDS, device=self._device)
        self._rows = _Rows(self.slots, len(COLUMN_IDS), self._device)
        self._live: list[GenerationHandle] = []
        self._waiting: deque[GenerationHandle] = deque()
        # Text streams without a slot: waiting for text, or ready to take the next free slot.
        self._streams: list[TextStreamHandle] = []
        self._streams_open = 0
        self._max_streams = max_streams
        self._streams_changed = False
        self._wake = threading.Condition()
        self._stopping = False
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # Prefills are extend passes from position 0, one row per prompt, laid out as the extend pass's
        # rows but ``prefill_width`` ids wide; recorded per (rows, width) bucket.
        self._prefill_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        most = min(max_prefill_rows, self.slots)
        self._prefill_rows_buckets = sorted({b for b in self._buckets if b < most} | {most})
        self._prefill_widths = [b for b in PREFILL_BUCKETS if b <= decoder.max_len]
        prefill_width = max(self._prefill_widths, default=0)
        self._prefill_inputs = torch.zeros(most, prefill_width + 3, dtype=torch.int64, device=self._device)
        self._prefill_inputs[:] = self._extend_row([], 0, decoder.staging_slot, prefill_width).to(self._device)
        self._prefill_logits = torch.zeros(most, len(COLUMN_IDS), device=self._device)
        # An extend pass's inputs, one row each: ids, start, length, slot (a free row names the staging slot).
        self._extend_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._extend_inputs = torch.zeros(self.slots, EXTEND_WIDTH + 3, dtype=torch.int64, device=self._device)
        self._extend_inputs[:] = self._extend_row([], 0, decoder.staging_slot, EXTEND_WIDTH).to(self._device)
        self._extend_logits = torch.zeros(self.slots, len(COLUMN_IDS), device=self._device)
        # Two host buffers for the drawn ids: step k+1 is copied out while step k's ids are read.
        self._cuda = self._device.type == "cuda"
        self._host_ids = [torch.zeros(self.slots, dtype=torch.int64, pin_memory=self._cuda) for _ in range(2)]
        self._next_host = 0
        self._sample = sample
        if compile_backend:
            self._compile(compile_backend)
        if cuda_graphs:
            started = time.monotonic()
            self._capture()
            _log.info(
                "LLM decode steps, extend passes and prefills recorded as %d CUDA graphs in %.1f s",
                len(self._graphs) + len(self._extend_graphs) + len(self._prefill_graphs),
                time.monotonic() - started,
            )
        self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Generation, sink: TokenSink) -> GenerationHandle:
        """Queue ``request``; raises ValueError (before anything runs) when it cannot be served."""
        if len(request.input_ids) + request.max_new_tokens > self._decoder.max_len:
            raise ValueError(
                f"{len(request.input_ids)} prompt ids + {request.max_new_tokens} new tokens exceed the "
                f"engine's {self._decoder.max_len} positions (max_seq_len)"
            )
        handle = GenerationHandle(request, sink)
        with self._wake:
            if self._stopping:
                raise RuntimeError("the engine is stopped")
            self._waiting.append(handle)
            self._wake.notify()
        return handle

    def open_stream(self, request: Generation, prompt_text_ids: Sequence[int], sink: TokenSink) -> TextStreamHandle:
        """Open a text stream: ``request.input_ids`` are the prompt's speech ids, its stop ids end the
        final stage; text follows through the handle. RuntimeError when ``max_streams`` are open."""
        handle = TextStreamHandle(
            request,
            sink,
            layout=BistreamLayout(prompt_text_ids, request.input_ids),
            engine=self,
            key=_stream_key(request.seed),
        )
        with self._wake:
            if self._stopping:
                raise RuntimeError("the engine is stopped")
            if self._streams_open >= self._max_streams:
                raise RuntimeError(f"{self._max_streams} text streams are open already")
            self._streams_open += 1
            self._streams.append(handle)
            self._streams_changed = True
            self._wake.notify()
        return handle

    def _update_stream(self, change: Callable[[], None]) -> None:
        with self._wake:
            change()
            self._streams_changed = True
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    @torch.inference_mode()
    def _run(self) -> None:
        # Everything the engine runs is in inference mode, as its compiled regions and sampler were traced:
        # a tensor made outside it (a recorded prefill's logits copied out) would make dynamo compile again.
        if self._cuda:
            # Events, copies and replays of this thread must all go to the model's device.
            torch.cuda.set_device(self._device)
        launched: _Launched | None = None
        while True:
            with self._wake:
                while (
                    not self._stopping
                    and not self._waiting
                    and not self._live
                    and launched is None
                    and not self._streams_changed
                ):
                    self._wake.wait()
                if self._stopping:
                    pending = [*self._waiting, *self._live, *self._streams]
                    self._waiting.clear()
                    self._live.clear()
                    self._streams.clear()
                    break
                dropped, resumed = self._ready_streams()
                starting = sum(1 for stream in resumed if stream.cached == 0)
                admitted = [
                    self._waiting.popleft()
                    for _ in range(
                        min(
                            len(self._waiting),
                            self._max_prefill_rows - starting,
                            self.slots - len(self._live) - len(resumed),
                        )
                    )
                ]
            try:
                for stream in dropped:
                    self._close_stream(stream, None)
                # Passes that start rows; their first ids are handed out after the step in flight.
                first_draws = self._extend(resumed) if resumed else []
                if admitted:
                    first_draws.append(self._prefill(admitted))
                if self._live and self._gate is not None and self._gate.busy([h.produced for h in self._live]):
                    # Hand out the steps in flight before leaving the GPU to the other process.
                    for step in [launched, *first_draws] if launched is not None else first_draws:
                        self._land(step, in_flight=False)
                    launched, first_draws = None, []
                    if self._live:
                        # A request that arrives meanwhile ends the wait: its prefill goes first.
                        self._gate.wait(lambda: bool(self._waiting))
                previous, launched = launched, self._launch() if self._live else None
                in_flight = launched is not None
                if previous is not None:
                    period = None if launched is None else launched.launched_at - previous.launched_at
                    self._land(previous, period, in_flight=in_flight)
                for step in first_draws:
                    self._land(step, in_flight=in_flight)
            except Exception as exc:
                _log.exception("LLM engine step failed; failing the requests in flight")
                launched = None
                failed = [*admitted, *resumed, *self._live]
                self._live.clear()
                for handle in dict.fromkeys(failed):
                    if handle.ended:  # one that ended in this round was told so already
                        continue
                    if isinstance(handle, TextStreamHandle):
                        self._close_stream(handle, exc)
                    else:
                        handle.ended = True
                        _finish(handle, exc)
        for handle in pending:
            _finish(handle, RuntimeError("the engine stopped"))

    def _ready_streams(self) -> tuple[list[TextStreamHandle], list[TextStreamHandle]]:
        """Under the lock: the waiting streams that were cancelled, and those whose next input is there,
        as many as free slots take (they go before new requests). Streams starting (their first input,
        the voice prompt, is prefilled) count against ``max_prefill_rows`` per step, as new requests do:
        taken all at once, 50 sockets opened together held every row's next step for half a second."""
        dropped: list[TextStreamHandle] = []
        resumed: list[TextStreamHandle] = []
        if not self._streams_changed:
            return dropped, resumed
        self._streams_changed = False
        starting = 0
        for stream in list(self._streams):
            if stream.cancelled:
                dropped.append(stream)
            elif len(self._live) + len(resumed) < self.slots:
                # A stream whose feed could not go in place took it from its layout already.
                feed = stream.feed or stream.layout.next_feed()
                if feed is None:
                    continue
                stream.feed = feed
                if stream.cached == 0:
                    if starting == self._max_prefill_rows:
                        # Its prefill waits for the next step.
                        self._streams_changed = True
                        continue
                    starting += 1
                resumed.append(stream)
            else:
                # No slot for it now: look again when a slot is freed.
                self._streams_changed = True
                continue
            self._streams.remove(stream)
        return dropped, resumed

    def _extend(self, handles: list[TextStreamHandle]) -> list[_Launched]:
        """Give each stream the next row and feed it its round's input; their first ids are drawn at once.

        Streams starting (their input is the voice prompt) are prefilled; the others, whose rounds start
        between the same two steps, share one extend pass (one pass each would serialise them).
        """
        fitting: list[TextStreamHandle] = []
        for handle in handles:
            if handle.cached + len(handle.feed) >= self._decoder.max_len:
                self._close_stream(
                    handle, ValueError(f"the text stream outgrew the engine's {self._decoder.max_len} positions")
                )
            else:
                fitting.append(handle)
        starting = [h for h in fitting if h.cached == 0]
        rounds = [h for h in fitting if h.cached > 0]
        launched: list[_Launched] = []
        for group, pass_logits in ((starting, self._prompt_logits), (rounds, self._round_logits)):
            if not group:
                continue
            first = len(self._live)
            now = time.monotonic()
            for row, handle in enumerate(group, start=first):
                if handle.admitted == 0.0:
                    handle.admitted = now
                if handle.parked_at:
                    if len(handle.waits) < TRACED_WAITS:
                        handle.waits.append((handle.parked_at, now))
                    handle.parked_at = 0.0
                if handle.saved is not None:
                    self._decoder.restore_slot(row, handle.saved)
                    handle.saved = None
                self._load_stream_row(row, handle)
            logits = pass_logits(first, group)
            for handle in group:
                self._took_input(handle, handle.feed, cached=handle.cached + len(handle.feed), launched=0)
                handle.feed = []
            launched.append(self._start_rows(group, first, logits))
        return launched

    def _prompt_logits(self, first: int, handles: Sequence[TextStreamHandle]) -> Tensor:
        return self._prefill_rows(first, [h.feed for h in handles])

    def _round_logits(self, first: int, handles: Sequence[TextStreamHandle]) -> Tensor:
        """Extend rows ``first..`` by their streams' feeds, from a recorded pass where one fits."""
        rows = len(handles)
        width = max(EXTEND_WIDTH, *(len(h.feed) for h in handles))
        span = self._decoder.span_for(max(h.cached + len(h.feed) for h in handles))
        inputs = [self._extend_row(h.feed, h.cached, row, width) for row, h in enumerate(handles, start=first)]
        if width > EXTEND_WIDTH:
            return self._extend_batch(self._to_device(torch.stack(inputs)), span)
        bucket = next(b for b in self._buckets if b >= rows)
        graph = self._extend_graphs.get((bucket, span))
        if graph is None:
            bucket = rows
        padding = self._extend_row([], 0, self._decoder.staging_slot, width)
        self._extend_inputs[:bucket].copy_(self._to_device(torch.stack(inputs + [padding] * (bucket - rows))))
        if graph is not None:
            graph.replay()
        else:
            self._extend_pass(rows, span)
        # A copy made on this thread, in inference mode, as the sampler was traced: a view of the
        # recorded buffer would make dynamo compile it again while serving.
        return self._extend_logits[:rows].clone()

    @staticmethod
    def _extend_row(ids: Sequence[int], start: int, slot: int, width: int) -> Tensor:
        """One row of an extend pass's inputs: ``width`` ids (zero-padded), start, length, slot."""
        row = torch.zeros(width + 3, dtype=torch.int64)
        row[: len(ids)] = torch.tensor(ids, dtype=torch.int64)
        row[width:] = torch.tensor([start, max(len(ids), 1), slot])
        return row

    def _extend_pass(self, rows: int, span: int) -> None:
        """The extend pass over the first ``rows`` rows of the recorded inputs, into the recorded logits."""
        self._extend_logits[:rows].copy_(self._extend_batch(self._extend_inputs[:rows], span))

    def _extend_batch(self, batch: Tensor, span: int) -> Tensor:
        """An extend pass over rows laid out by :meth:`_extend_row` (ids, then start, length, slot)."""
        width = batch.shape[1] - 3
        return self._decoder.extend(batch[:, :width], batch[:, width], batch[:, width + 1], batch[:, width + 2], span)

    def _to_device(self, host: Tensor) -> Tensor:
        """``host`` on the model's device without waiting for the GPU (a pageable copy would)."""
        return host.pin_memory().to(self._device, non_blocking=True) if self._cuda else host

    def _start_rows(self, handles: Sequence[GenerationHandle], first: int, logits: Tensor) -> _Launched:
        """Draw the first ids of rows ``first..`` (their cache filled, ``logits`` after their inputs), make
        them live and queue the ids' copy to the host."""
        stop = first + len(handles)
        started = time.perf_counter()
        positions = torch.tensor([h.origin for h in handles], dtype=torch.int64)
        self._rows.positions[first:stop].copy_(self._to_device(positions), non_blocking=True)
        self._advance(logits, first, stop)
        self._live.extend(handles)
        if self._cuda:
            drawn = torch.empty(len(handles), dtype=torch.int64, pin_memory=True)
            drawn.copy_(self._rows.drawn[first:stop], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            events: tuple[torch.cuda.Event, torch.cuda.Event] | None = (done, done)
        else:
            drawn, events = self._rows.drawn[first:stop].clone(), None
        return _Launched(
            handles=list(handles),
            segments=[h.segment for h in handles],
            drawn=drawn,
            events=events,
            eager_s=time.perf_counter() - started,
            launched_at=started,
            decode=False,
        )

    def _load_stream_row(self, row: int, handle: TextStreamHandle) -> None:
        """A stream's sampling row: a round may draw speech or the fill token, the final stage speech or a stop."""
        request = handle.request
        final = handle.layout.stage is Stage.FINAL
        # The fill token is <|eos3|>: a stop elsewhere, never one in a text stream.
        stops = sorted(request.stop_ids - {FILL_ID}) if final else []
        self._write_row(
            row,
            request,
            key=handle.key,
            steps=handle.drawn,
            drawable=stops if final else [FILL_ID],
            stop_ids=stops,
            seen=handle.seen,
        )

    def _close_stream(self, handle: TextStreamHandle, error: BaseException | None) -> None:
        handle.ended = True
        handle.saved = None
        with self._wake:
            self._streams_open -= 1
            # A stream that failed with its pass may have parked again already: it must not come back.
            if handle in self._streams:
                self._streams.remove(handle)
        _finish(handle, error)

    def _prefill(self, handles: list[GenerationHandle]) -> _Launched:
        first = len(self._live)
        now = time.monotonic()
        for row, handle in enumerate(handles):
            handle.admitted = now
            self._load_row(first + row, handle.request)
        logits = self._prefill_rows(first, [h.request.input_ids for h in handles])
        return self._start_rows(handles, first, logits)

    def _prefill_rows(self, first: int, prompts: Sequence[Sequence[int]]) -> Tensor:
        """Run prompts into rows ``first..`` (as one recorded pass where they fit); logits after each.

        The new requests admitted between two steps share one pass, as do the text streams starting
        there: a replay each would run them one after another while every live row waits for its next
        step."""
        rows = len(prompts)
        lengths = [len(ids) for ids in prompts]
        width = next((w for w in self._prefill_widths if w >= max(lengths)), None)
        bucket = next((b for b in self._prefill_rows_buckets if b >= rows), None)
        graph = None if width is None or bucket is None else self._prefill_graphs.get((bucket, width))
        if graph is None or bucket is None:
            ids = torch.zeros(rows, max(lengths), dtype=torch.int64)
            for row, prompt in enumerate(prompts):
                ids[row, : lengths[row]] = torch.tensor(prompt, dtype=torch.int64)
            lengths_of = self._to_device(torch.tensor(lengths))
            return self._decoder.prefill(self._to_device(ids), lengths_of, first_slot=first)
        full = self._prefill_inputs.shape[1] - 3
        inputs = [self._extend_row(ids, 0, first + row, full) for row, ids in enumerate(prompts)]
        padding = self._extend_row([], 0, self._decoder.staging_slot, full)
        self._prefill_inputs[:bucket].copy_(self._to_device(torch.stack(inputs + [padding] * (bucket - rows))))
        graph.replay()
        return self._prefill_logits[:rows].clone()

    def _prefill_pass(self, rows: int, width: int) -> None:
        """Prefill the first ``rows`` rows of the recorded inputs, ``width`` ids each, into the recorded logits."""
        inputs = self._prefill_inputs[:rows]
        starts, lengths, slots = inputs[:, -3:].unbind(1)
        logits = self._decoder.extend(inputs[:, :width], starts, lengths, slots, self._decoder.span_for(width))
        self._prefill_logits[:rows].copy_(logits)

    def _load_row(self, row: int, request: Generation) -> None:
        self._write_row(
            row,
            request,
            key=_stream_key(request.seed),
            steps=0,
            drawable=request.stop_ids,
            stop_ids=request.stop_ids,
            seen=[_COLUMN_OF[i] for i in request.input_ids if i in _COLUMN_OF],
            min_new=request.min_new_tokens,
        )

    def _write_row(
        self,
        row: int,
        request: Generation,
        *,
        key: Tensor,
        steps: int,
        drawable: Iterable[int],
        stop_ids: Iterable[int],
        seen: Iterable[int],
        min_new: int = 0,
    ) -> None:
        """Load a sampling row: speech tokens and ``drawable`` ids may be drawn, ``stop_ids`` only after
        ``min_new`` steps; ``seen`` are the columns the repetition penalty applies to.

        Values go to the device in one pinned copy per dtype: a Python number written into a CUDA
        tensor is a pageable copy, which waits for the whole stream (the step in flight) each time.
        """
        s = self._rows.sampling
        floats = self._to_device(torch.tensor([request.temperature, request.top_p, request.repetition_penalty]))
        s.temperature[row], s.top_p[row], s.penalty[row] = floats
        counts = self._to_device(torch.tensor([request.top_k, int(key), steps, min_new]))
        s.top_k[row], s.keys[row], s.steps[row], s.min_new[row] = counts
        masks = torch.zeros(3, len(COLUMN_IDS), dtype=torch.bool)
        allowed, stops, seen_row = masks
        allowed[:_SPEECH_COLUMNS] = True
        allowed[[_COLUMN_OF[i] for i in drawable]] = True
        stops[[_COLUMN_OF[i] for i in stop_ids]] = True
        seen_row[list(seen)] = True
        allowed, stops, seen_row = self._to_device(masks)
        s.allowed[row] = allowed
        s.stops[row] = stops
        s.seen[row] = seen_row
        self._rows.forced[row : row + 1].fill_(False)

    def _advance(self, logits: Tensor, start: int, stop: int) -> None:
        """Sample rows ``start..stop-1`` and prepare their next step; device work only."""
        r = self._rows
        window = r.window(start, stop)
        chosen = self._sample(logits, window)
        drawn = self._columns[chosen]
        r.drawn[start:stop] = drawn
        r.tokens[start:stop] = drawn
        kept = ~r.forced[start:stop]
        index = chosen.unsqueeze(1)
        window.seen.scatter_(1, index, window.seen.gather(1, index) | kept.unsqueeze(1))
        window.steps.add_(kept.long())

    def _decode(self, rows: int, span: int) -> None:
        r = self._rows
        logits = self._decoder.decode(r.tokens[:rows], r.positions[:rows], span)
        r.positions[:rows].add_(1)
        self._advance(logits, 0, rows)

    def _launch(self) -> _Launched:
        """Queue one decode step for every live row and the copy of its ids to the host; no waiting."""
        live = len(self._live)
        started = time.perf_counter()
        bucket = next((b for b in self._buckets if b >= live), self.slots)
        end = 0
        for handle in self._live:
            end = max(end, handle.origin + handle.launched + 1)
            handle.launched += 1
        span = self._decoder.span_for(end)
        self._force_inputs()
        graph = self._graphs.get((bucket, span))
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self._cuda else None
        if events is not None:
            events[0].record()
        if graph is not None:
            graph.replay()
        else:
            self._decode(live, span)
        host = self._host_ids[self._next_host][:live]
        self._next_host ^= 1
        host.copy_(self._rows.drawn[:live], non_blocking=True)
        if events is not None:
            events[1].record()
        return _Launched(
            handles=list(self._live),
            segments=[h.segment for h in self._live],
            drawn=host,
            events=events,
            eager_s=time.perf_counter() - started,
            launched_at=started,
        )

    def _force_inputs(self) -> None:
        """Before a decode step: rows feeding a round's input in place get their next id, and every row
        is marked whether its draw is dropped (all but the input's last id). Queued after the step in
        flight, which writes its own draws into the rows' inputs.

        A row is marked only while it has ids left to feed, so with none left anywhere every live row's
        mark is clear already (a freed row's mark is cleared when a request is loaded into it)."""
        forcing = [
            (row, handle)
            for row, handle in enumerate(self._live)
            if isinstance(handle, TextStreamHandle) and handle.forcing
        ]
        if not forcing:
            return
        rows = [row for row, _ in forcing]
        ids = [handle.forcing.pop(0) for _, handle in forcing]
        marks = [False] * len(self._live)
        for row, handle in forcing:
            marks[row] = bool(handle.forcing)
        rows_ids = self._to_device(torch.tensor([rows, ids], dtype=torch.int64))
        self._rows.tokens.index_copy_(0, rows_ids[0], rows_ids[1])
        self._rows.forced[: len(self._live)] = self._to_device(torch.tensor(marks))

    def _land(self, step: _Launched, period: float | None = None, *, in_flight: bool) -> None:
        """Wait for a launched step's ids and hand them out; rows whose request ended meanwhile are skipped.
        ``period``: the time from the step's launch to the next step's; ``in_flight``: whether a decode step
        of every live row was launched after it (it feeds the ids handed out now)."""
        waited = time.perf_counter()
        if step.events is not None:
            started, done = step.events
            done.synchronize()
        waited = time.perf_counter() - waited
        if step.decode:
            seconds = started.elapsed_time(done) / 1000.0 if step.events is not None else step.eager_s
        for handle, segment in zip(step.handles, step.segments, strict=True):
            if step.decode and not handle.ended and handle.segment == segment:
                handle.steps += 1
                handle.step_s += seconds
                handle.wait_s += waited
                if period is not None:
                    handle.periods += 1
                    handle.period_s += period
        self._deliver(step.handles, step.drawn.tolist(), step.segments, in_flight=in_flight)

    def _deliver(
        self, handles: Sequence[GenerationHandle], drawn: list[int], segments: Sequence[int], *, in_flight: bool
    ) -> None:
        """Hand each request its id, then release the requests that ended and the streams that wait."""
        ended: list[GenerationHandle] = []
        parked: list[TextStreamHandle] = []
        now = time.monotonic()
        for handle, token_id, segment in zip(handles, drawn, segments, strict=True):
            if handle.ended or handle.segment != segment:
                continue
            request = handle.request
            if handle.cancelled:
                ended.append(handle)
                continue
            if isinstance(handle, TextStreamHandle):
                if handle.dropping:
                    handle.dropping -= 1
                    continue
                handle.drawn += 1
                handle.since_input += 1
                handle.seen.add(_COLUMN_OF[token_id])
                if not handle.layout.on_token(token_id):
                    # A drawn fill at the last position ends the stream as a speech id there does (below).
                    if handle.layout.stage is Stage.DONE or self._out_of_positions(handle):
                        ended.append(handle)
                    elif not self._feed_in_place(handle, token_id, in_flight=in_flight):
                        parked.append(handle)
                    continue
            elif token_id in request.stop_ids:
                ended.append(handle)
                continue
            handle.produced += 1
            if handle.produced == 1:
                handle.first_token = now
            handle.last_token = now
            if handle.produced <= TRACED_TOKENS:
                handle.token_times.append(now)
            try:
                handle.sink.token(token_id)
            except Exception:
                # Its request ends at the next step (or as a waiting stream); the step's other requests go on.
                _log.exception("a token sink failed; cancelling its request")
                handle.cancel()
            if handle.produced >= request.max_new_tokens or self._out_of_positions(handle):
                ended.append(handle)
            elif (
                isinstance(handle, TextStreamHandle)
                and handle.layout.stage is Stage.WAITING
                and not self._feed_in_place(handle, token_id, in_flight=in_flight)
            ):
                parked.append(handle)
        for handle in ended:
            self._release(handle)
        for stream in parked:
            self._park(stream)

    def _feed_in_place(self, handle: TextStreamHandle, token_id: int, *, in_flight: bool) -> bool:
        """Start a stream's next round in its row if its input is there: the next decode steps feed it.

        ``token_id`` ended the round; its position is the stream's next. With a step ``in_flight`` that
        fed it there, a speech id (owed to the cache anyway: the input starts with it) is kept and the
        rest of the input follows it, while a drawn fill (never input) is overwritten; the step's draw
        is dropped. Without one, the whole input goes from that position. Either way the row's sampling
        state is loaded as an extend pass would load it, and the draws before the input's last id are
        dropped. Returns False where the stream must leave its row: no input yet, or one longer than an
        extend pass takes (its feed then waits on the handle for the pass).
        """
        with self._wake:
            feed = None if handle.cancelled else handle.layout.next_feed()
        if feed is None:
            return False
        position = handle.origin + handle.since_input - 1
        forced = feed
        if in_flight and token_id != FILL_ID:
            position += 1
            forced = feed[1:]
        if not 0 < len(forced) <= EXTEND_WIDTH or position + len(forced) >= self._decoder.max_len:
            handle.feed = feed
            return False
        row = self._live.index(handle)
        self._load_stream_row(row, handle)
        self._rows.positions[row : row + 1].fill_(position)
        self._took_input(handle, feed, cached=position + len(forced), launched=-len(forced))
        handle.forcing = forced
        handle.dropping = len(forced) - (0 if in_flight else 1)
        return True

    @staticmethod
    def _took_input(handle: TextStreamHandle, feed: Sequence[int], *, cached: int, launched: int) -> None:
        """A round's input ``feed`` fills the stream's cache up to ``cached``: its speech ids count as seen,
        and its next draw is the round's first, fed at ``cached``. ``launched``: the decode steps launched
        for the row since, negative while steps still to launch feed the input (in place)."""
        handle.seen.update(_COLUMN_OF[i] for i in feed if i in _COLUMN_OF)
        handle.cached = handle.origin = cached
        handle.launched = launched
        handle.since_input = 0

    def _out_of_positions(self, handle: GenerationHandle) -> bool:
        """Whether a text stream's next step would write past the cache (a plain request's length is
        checked when it is submitted)."""
        return isinstance(handle, TextStreamHandle) and handle.origin + handle.since_input >= self._decoder.max_len

    def _remove_row(self, handle: GenerationHandle) -> None:
        """Free the request's row: the last live row moves into it (queued after any launched step)."""
        row = self._live.index(handle)
        last = len(self._live) - 1
        if row != last:
            self._decoder.move_slot(last, row)
            for tensor in self._rows.all():
                tensor[row] = tensor[last]
            self._live[row] = self._live[last]
        self._live.pop()
        handle.segment += 1

    def _release(self, handle: GenerationHandle) -> None:
        self._remove_row(handle)
        if isinstance(handle, TextStreamHandle):
            self._close_stream(handle, None)
        else:
            handle.ended = True
            _finish(handle, None)

    def _park(self, handle: TextStreamHandle) -> None:
        """Take a stream whose round ended out of its row until its next input is there.

        Of the ids drawn since its last input, all but the last were fed by decode steps.
        """
        handle.cached = handle.origin + handle.since_input - 1
        handle.saved = self._decoder.save_slot(self._live.index(handle), handle.cached)
        self._remove_row(handle)
        handle.parked_at = time.monotonic()
        with self._wake:
            self._streams.append(handle)
            self._streams_changed = True

    @torch.inference_mode()
    def _compile(self, backend: str) -> None:
        """Compile the decoder's regions and the sampler, and run them once: a request never waits for a compile."""
        started = time.monotonic()
        saved = [tensor.clone() for tensor in self._rows.all()]
        try:
            self._decoder.compile(backend)
            self._sample = torch.compile(sample, backend=backend, dynamic=True)
            for rows in (1, 2):
                # One row and several are separate compiles (dynamo specialises sizes of one). The
                # slots written (0 and 1; there is always a staging slot after the first) are free.
                self._decode(rows, self._decoder.spans[0])
                ids = torch.zeros(rows, 2, dtype=torch.int64, device=self._device)
                self._decoder.prefill(ids, torch.full((rows,), 2, device=self._device), first_slot=0)
                self._extend_pass(rows, self._decoder.spans[0])
        except Exception as exc:
            raise RuntimeError(
                f"compiling the LLM with {backend!r} failed ({type(exc).__name__}: {exc}); "
                "an empty compile_backend runs it uncompiled"
            ) from exc
        finally:
            for tensor, value in zip(self._rows.all(), saved, strict=True):
                tensor.copy_(value)
        _log.info("LLM regions and sampler compiled (%s) in %.1f s", backend, time.monotonic() - started)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Record one decode step and one extend pass per bucket and span and one prefill per bucket of rows
        and prompt length, sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self._device)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        saved = [tensor.clone() for tensor in self._rows.all()]

        def record(run: Callable[[], None]) -> torch.cuda.CUDAGraph:
            for _ in range(2):
                run()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                run()
            return graph

        with torch.cuda.stream(stream):
            for bucket in sorted(self._buckets, reverse=True):
                for span in sorted(self._decoder.spans, reverse=True):
                    self._graphs[bucket, span] = record(functools.partial(self._decode, bucket, span))
                    self._extend_graphs[bucket, span] = record(functools.partial(self._extend_pass, bucket, span))
            for rows in reversed(self._prefill_rows_buckets):
                for width in reversed(self._prefill_widths):
                    self._prefill_graphs[rows, width] = record(functools.partial(self._prefill_pass, rows, width))
        torch.cuda.current_stream(self._device).wait_stream(stream)
        for tensor, value in zip(self._rows.all(), saved, strict=True):
            tensor.copy_(value)
        torch.cuda.synchronize(self._device)


def _stream_key(seed: int | None) -> Tensor:
    """The sampler's key of a request's random stream; None draws a seed."""
    value = secrets.randbits(63) if seed is None else seed % _SEED_LIMIT
    signed = value - _SEED_LIMIT if value >= _SEED_LIMIT // 2 else value
    return seed_keys(torch.tensor(signed, dtype=torch.int64))


def _finish(handle: GenerationHandle, error: BaseException | None) -> None:
    """Tell a sink its request ended; a sink that fails must not take the engine's thread down."""
    try:
        handle.sink.finished(error)
    except Exception:
        _log.exception("a token sink failed at the end of its request")


class _QueueSink:
    """A sink that a consuming thread reads as an iterator (the blocking :func:`generate` API)."""

    _END = object()

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()

    def token(self, token_id: int) -> None:
        self._queue.put(token_id)

    def finished(self, error: BaseException | None) -> None:
        self._queue.put(error if error is not None else self._END)

    def __iter__(self) -> Iterator[int]:
        while True:
            item = self._queue.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, int)
            yield item


def generate(engine: BatchingEngine, request: Generation) -> Iterator[int]:
    """Submit ``request`` and yield its tokens as they come; closing the iterator cancels it."""
    sink = _QueueSink()
    handle = engine.submit(request, sink)

    def tokens() -> Iterator[int]:
        try:
            yield from sink
        finally:
            handle.cancel()

    return tokens()
