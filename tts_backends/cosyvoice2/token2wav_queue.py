"""token2wav's own queue: calls converted a group at a time, streams' first chunks before everything else.

Triton calls a model instance's ``execute`` with one batch at a time, and with the next batch only
after the previous ``execute`` returned. Converting inside ``execute`` made a stream's first chunk
that arrived while a batch ran wait for all of it, the later chunks of long streams included (on
the H100, 16 streams' first audio waited 563 ms there at p90). So the token2wav model only queues
its calls and returns; their responses leave later through each request's response sender, which
Triton allows for a model that is not decoupled (one final response per request). One worker
thread converts the queue a group at a time and picks the next group after each: the first chunks
waiting, else the calls of about the length of the one waiting longest (a group pads its rows to
its longest, so like lengths go together). A group is one flow pass; a first chunk waits for the
group being converted and, only when more first chunks wait than a group takes, for those before it.
A group of later chunks lends the GPU to the first chunks waiting between the two halves of its
flow solve, where it is replayed from CUDA graphs (``flow_graphs.py``): the first chunks that
arrive during the first half wait for the rest of it, not for the whole pass and HiFT (one that
arrives during the second half still does); the later chunks have audio in hand and can wait.

Triton's own mechanisms do not give this: its priority levels order the queue but do not shorten
the running batch, and a second instance cannot share a stream's state (it lives in one process).
"""

from __future__ import annotations

import logging
import threading
import time
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


def take_group(pending: list[Queued], max_rows: int) -> list[Queued]:
    """Remove the next group from ``pending`` (oldest first) and return it: up to ``max_rows`` calls of
    one length class, the class of the oldest first chunk if streams' first chunks wait, else of the
    oldest call."""
    firsts = [queued for queued in pending if queued.call.token_offset == 0]
    candidates = firsts or pending
    oldest = length_class(candidates[0].call)
    group = [queued for queued in candidates if length_class(queued.call) == oldest][:max_rows]
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
        first_chunks_hold: Callable[[], AbstractContextManager[object]] | None = None,
        log_error: Callable[[str], None] = logger.error,
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self._token2wav = token2wav
        self._max_rows = max_rows
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
            self._pending.append(Queued(call, answer))
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
                group = take_group(self._pending, self._max_rows)
            self._convert(group)

    def _first_chunks_meanwhile(self) -> None:
        """Between two parts of a later group's flow solve: convert the streams' first chunks waiting,
        a group at a time (those that arrive meanwhile too)."""
        while True:
            with self._ready:
                if self._closed or not any(queued.call.token_offset == 0 for queued in self._pending):
                    return
                group = take_group(self._pending, self._max_rows)
            self._convert(group)

    def _convert(self, group: list[Queued]) -> None:
        converted = Converted(time.monotonic(), len(group))
        answered: set[int] = set()

        def on_result(index: int, result: Audio | Exception) -> None:
            answered.add(index)
            self._deliver(group[index], result, converted)

        try:
            first_chunks = group[0].call.token_offset == 0
            # Only later chunks lend the GPU: groups converted meanwhile are first chunks, so none nests deeper.
            meanwhile = None if first_chunks else self._first_chunks_meanwhile
            with self._hold() if first_chunks and self._hold is not None else nullcontext():
                self._token2wav.convert([queued.call for queued in group], on_result, between_segments=meanwhile)
        except Exception as exc:
            self._log_error(f"token2wav: converting a group of {len(group)} calls failed: {exc!r}")
            failed = GroupFailed(f"converting its group of {len(group)} calls failed: {exc}")
            for index, queued in enumerate(group):
                if index not in answered:
                    self._deliver(queued, failed, converted)

    def _deliver(self, queued: Queued, result: Audio | Exception, converted: Converted) -> None:
        try:
            queued.answer(result, converted)
        except Exception as exc:
            self._log_error(f"token2wav: answering a call failed: {exc!r}")


class QueueClosed(RuntimeError):
    """The queue stopped (the model is unloading) before it converted the call."""


class GroupFailed(RuntimeError):
    """Converting the call's group failed as a whole (not because of the call itself)."""
