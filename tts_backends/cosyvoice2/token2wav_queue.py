"""token2wav's own queue: calls converted a group at a time, the one whose audio is due first next.

Triton calls a model instance's ``execute`` with one batch at a time, and with the next batch only
after the previous ``execute`` returned. Converting inside ``execute`` made a stream's first chunk
that arrived while a batch ran wait for all of it, the later chunks of long streams included (on
the H100, 16 streams' first audio waited 563 ms there at p90). So the token2wav model only queues
its calls and returns; their responses leave later through each request's response sender, which
Triton allows for a model that is not decoupled (one final response per request). One worker
thread converts the queue a group at a time and picks the next group after each.

The next group is the call due first (:class:`Deadlines`) with the others of its kind (first chunks,
or the rest) and length class (a group pads its rows to its longest, so like lengths go together). A
stream's first chunk is due shortly after it was queued. A later chunk is due when the stream's
playback, which began when its first chunk was answered, reaches the audio it will add: it has audio
in hand and can wait, but only that long. Strict first-chunk priority starved later chunks while new
streams kept arriving (64 streams on the H100: a stream's last chunk waited until the arrivals
stopped, seconds behind its playback).

A group of later chunks lends the GPU to first chunks due before it, between the two halves of its
flow solve, where it is replayed from CUDA graphs (``flow_graphs.py``): the first chunks that arrive
during the first half wait for the rest of it, not for the whole pass and HiFT (one that arrives
during the second half still does).

Triton's own mechanisms do not give this: its priority levels order the queue but do not shorten
the running batch, and a second instance cannot share a stream's state (it lives in one process).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

from tts_backends.cosyvoice2.token2wav import Audio, Conversion, length_class

logger = logging.getLogger(__name__)


class Converter(Protocol):
    """What the queue needs of :class:`~tts_backends.cosyvoice2.token2wav.Token2Wav`."""

    def convert(
        self,
        calls: Sequence[Conversion],
        on_result: Callable[[int, Audio | Exception], None] | None = None,
        *,
        between_segments: Callable[[], None] | None = None,
    ) -> list[Audio | Exception]: ...


@dataclass(frozen=True)
class Converted:
    """The group a call was converted in: when it started (``time.monotonic()``) and how many calls it held."""

    started: float
    rows: int


Answer = Callable[[Audio | Exception, Converted], None]


@dataclass(frozen=True)
class Queued:
    call: Conversion
    answer: Answer
    submitted: float = 0.0
    """When the call was queued (the queue's clock)."""


def is_first_chunk(call: Conversion) -> bool:
    return call.token_offset == 0


class Deadlines:
    """When each queued call's audio is due; groups are taken earliest due first.

    - a stream's first chunk: ``first_chunk_s`` after it was queued;
    - an offline call (its client waits for the whole audio): ``offline_s`` after it was queued;
    - a later chunk: when its stream's playback reaches the audio it adds, i.e. ``token_offset``
      tokens of ``seconds_per_token`` after the stream's first chunk was answered (playback is
      taken to start then). A stream whose first chunk this queue did not answer counts from the
      call's own arrival.

    Streams are remembered from their first chunk's answer to their final chunk (or a failure, or
    :meth:`forget`); at most ``max_streams``, the oldest forgotten first.
    """

    def __init__(
        self,
        *,
        first_chunk_s: float,
        seconds_per_token: float,
        offline_s: float = 1.0,
        max_streams: int = 4096,
    ) -> None:
        if first_chunk_s < 0 or offline_s < 0 or seconds_per_token <= 0 or max_streams < 1:
            raise ValueError("deadlines need first_chunk_s, offline_s >= 0, seconds_per_token > 0, max_streams >= 1")
        self.first_chunk_s = first_chunk_s
        self.seconds_per_token = seconds_per_token
        self.offline_s = offline_s
        self._max_streams = max_streams
        self._playing: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def due(self, queued: Queued) -> float:
        offset = queued.call.token_offset
        if offset is None:
            return queued.submitted + self.offline_s
        if offset == 0:
            return queued.submitted + self.first_chunk_s
        with self._lock:
            started = self._playing.get(queued.call.session_id, queued.submitted)
        return started + offset * self.seconds_per_token

    def answered(self, call: Conversion, ok: bool, at: float) -> None:
        """Note an answer: a stream's first chunk starts its playback, its last chunk or a failure ends it."""
        if call.token_offset is None:
            return
        if ok and is_first_chunk(call) and not call.finalize:
            with self._lock:
                self._playing[call.session_id] = at
                while len(self._playing) > self._max_streams:
                    self._playing.popitem(last=False)
        elif call.finalize or not ok:
            self.forget(call.session_id)

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._playing.pop(session_id, None)


def take_group(pending: list[Queued], max_rows: int, due: Callable[[Queued], float]) -> list[Queued]:
    """Remove the next group from ``pending`` and return it: the call due first, and up to ``max_rows``
    calls of its kind (first chunks, or the rest) and length class in order of ``due``."""
    urgent = min(pending, key=due)
    first, length = is_first_chunk(urgent.call), length_class(urgent.call)
    alike = [
        queued for queued in pending if is_first_chunk(queued.call) == first and length_class(queued.call) == length
    ]
    group = sorted(alike, key=due)[:max_rows]
    taken = {id(queued) for queued in group}
    pending[:] = [queued for queued in pending if id(queued) not in taken]
    return group


class ConversionQueue:
    """Calls of every batch Triton hands over, converted by one worker thread (see the module's doc).

    ``first_chunks_hold``, where given, is entered around every group of first chunks (the GPU
    turn that asks the LLM's process to wait, ``gpu_turns.py``). Every submitted call is answered
    exactly once: with its audio, its own error, a :class:`GroupFailed` when its group failed, or,
    when the queue closes before converting it, a :class:`QueueClosed`. An answer that raises is
    logged and does not keep the others from theirs.
    """

    def __init__(
        self,
        token2wav: Converter,
        *,
        max_rows: int,
        deadlines: Deadlines,
        first_chunks_hold: Callable[[], AbstractContextManager[object]] | None = None,
        log_error: Callable[[str], None] = logger.error,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self._token2wav = token2wav
        self._max_rows = max_rows
        self.deadlines = deadlines
        self._clock = clock
        self._hold = first_chunks_hold
        self._log_error = log_error
        self._pending: list[Queued] = []
        self._ready = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="token2wav-queue", daemon=True)
        self._worker.start()

    def submit(self, call: Conversion, answer: Answer) -> None:
        with self._ready:
            if self._closed:
                raise QueueClosed("token2wav is stopping")
            self._pending.append(Queued(call, answer, self._clock()))
            self._ready.notify()

    def close(self) -> None:
        """Stop after the group being converted; the calls still waiting are answered with :class:`QueueClosed`."""
        with self._ready:
            self._closed = True
            left, self._pending = self._pending, []
            self._ready.notify_all()
        self._worker.join()
        closed = Converted(time.monotonic(), 0)
        for queued in left:
            self._deliver(queued, QueueClosed("token2wav stopped before converting this call"), closed)

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._pending and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                group = take_group(self._pending, self._max_rows, self.deadlines.due)
            self._convert(group)

    def _first_chunks_meanwhile(self, lender_due: float) -> None:
        """Between two parts of a later group's flow solve: convert the first chunks due before the
        group's own calls (``lender_due``) and before every other call waiting, a group at a time
        (those that arrive meanwhile too)."""
        while True:
            with self._ready:
                if self._closed or not self._pending:
                    return
                urgent = min(self._pending, key=self.deadlines.due)
                if not is_first_chunk(urgent.call) or self.deadlines.due(urgent) >= lender_due:
                    return
                group = take_group(self._pending, self._max_rows, self.deadlines.due)
            self._convert(group)

    def _convert(self, group: list[Queued]) -> None:
        converted = Converted(time.monotonic(), len(group))
        answered: set[int] = set()

        def on_result(index: int, result: Audio | Exception) -> None:
            answered.add(index)
            self._deliver(group[index], result, converted)

        try:
            first_chunks = is_first_chunk(group[0].call)
            # Only later chunks lend the GPU: groups converted meanwhile are first chunks, so none nests deeper.
            meanwhile = None
            if not first_chunks:
                lender_due = min(self.deadlines.due(queued) for queued in group)
                meanwhile = functools.partial(self._first_chunks_meanwhile, lender_due)
            with self._hold() if first_chunks and self._hold is not None else nullcontext():
                self._token2wav.convert([queued.call for queued in group], on_result, between_segments=meanwhile)
        except Exception as exc:
            self._log_error(f"token2wav: converting a group of {len(group)} calls failed: {exc!r}")
            failed = GroupFailed(f"converting its group of {len(group)} calls failed: {exc}")
            for index, queued in enumerate(group):
                if index not in answered:
                    self._deliver(queued, failed, converted)

    def _deliver(self, queued: Queued, result: Audio | Exception, converted: Converted) -> None:
        self.deadlines.answered(queued.call, not isinstance(result, Exception), self._clock())
        try:
            queued.answer(result, converted)
        except Exception as exc:
            self._log_error(f"token2wav: answering a call failed: {exc!r}")


class QueueClosed(RuntimeError):
    """The queue stopped (the model is unloading) before it converted the call."""


class GroupFailed(RuntimeError):
    """Converting the call's group failed as a whole (not because of the call itself)."""
