"""token2wav's own queue: calls converted a group at a time, streams' first chunks before everything else.

Triton calls a model instance's ``execute`` with one batch at a time, and with the next batch only
after the previous ``execute`` returned. Converting inside ``execute`` made a stream's first chunk
that arrived while a batch ran wait for all of it, the later chunks of long streams included (on
the H100, 16 streams' first audio waited 563 ms there at p90). So the token2wav model only queues
its calls and returns; their responses leave later through each request's response sender, which
Triton allows for a model that is not decoupled (one final response per request). One worker
thread converts the queue a group at a time and picks the next group after each: the first chunks
waiting, else the calls of about the length of the most urgent one (a group pads its rows to its
longest, so like lengths go together). The queue follows how much audio each stream has been given
and since when, and takes streams' later chunks in the order their streams run out of it. (In order
of arrival instead, a short stream's last chunk queued behind the later chunks of long streams with
seconds of audio in hand, and at 64 streams on the H100 it was the short streams that fell behind
real time.) Offline calls go in the order they came, and against later chunks as in order of
arrival. A group is one flow pass; a first chunk waits for the group being converted and, only when
more first chunks wait than a group takes, for those before it. A group of later chunks lends the
GPU to the first chunks waiting between the two halves of its flow solve, where it is replayed from
CUDA graphs (``flow_graphs.py``): the first chunks that arrive during the first half wait for the
rest of it, not for the whole pass and HiFT (one that arrives during the second half still does);
the later chunks have audio in hand and can wait.

Up to a point, where the operator asks for it: a stream whose audio is playing need not run dry
because new streams keep arriving. With a playback guard (``playback_guard.py``), a later chunk
whose stream would run out of audio within the guard's horizon goes before the first chunks
waiting, and a later group stops lending the GPU between the halves of its solve while such a
stream is among its own or waits. Under a load the GPU barely keeps up with, new streams then
wait longer for their first audio instead of streams already playing stalling. The queue tells
the guard how long each group took, for its adaptive horizon.

Streams started together reach their first chunk within a few milliseconds of each other, and a
queue that takes a group as soon as it has a call converts the first of them alone: at 16 streams
on the H100 one first chunk took 61 ms on its own before the other 15 could start. With ``gather_s``
a call that finds the queue idle waits for those arriving with it, until none has come for a
quarter of ``gather_s``, and never longer than ``gather_s`` in all. (Triton's dynamic batcher has a
queue delay, but a fixed one: to take in the 11 ms over which 32 streams' first chunks came, it
would hold every call of a lone stream 11 ms; here a lone call waits a quarter of that.)

Once the queue has stood empty for ``idle_release_s`` after converting, ``idle_release`` runs once on the
worker (the Triton model passes glibc's ``malloc_trim``). The model process keeps freed memory in its heap for
the next groups (``allocator.keep_tensors_in_heap``); at rest it serves nobody, and how much of it there is
follows the largest recent groups: on the CPU profile a minute and a half of load left token2wav's memory at
rest a quarter larger, against 1.2 % with the release.

Triton's own mechanisms do not give this: its priority levels order the queue but do not shorten
the running batch, and a second instance cannot share a stream's state (it lives in one process).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Final, Protocol

from tts_gateway.models.cosyvoice2.engines.playback_guard import PlaybackGuard
from tts_gateway.models.cosyvoice2.engines.token2wav import Audio, Conversion, near_in_length

logger = logging.getLogger(__name__)

# Long enough that a stream's next chunk, or a burst's next call, arrives first; short enough that a
# process at rest has given its free heap back by the time anyone looks.
IDLE_RELEASE_S: Final = 2.0
# Streams whose playback the queue follows at most (a cancelled one is never finalised through it).
_MAX_PLAYING: Final = 4096


class Converter(Protocol):
    """What the queue needs of :class:`~tts_gateway.models.cosyvoice2.engines.token2wav.Token2Wav`."""

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
    queued_at: float = field(default_factory=time.monotonic)


def take_group(
    pending: list[Queued],
    max_rows: int,
    *,
    runs_out: Mapping[str, float] | None = None,
    guard_until: float | None = None,
) -> list[Queued]:
    """Remove the next group from ``pending`` and return it: up to ``max_rows`` calls of about one
    length, led by the first of these that exists:

    * a stream's later chunk whose audio runs out (``runs_out``: when, by session) before
      ``guard_until``, where that is given;
    * the oldest first chunk of a stream;
    * the later chunk whose stream runs out first, or the oldest offline call. Between those two
      kinds the one whose oldest call has waited longer leads, as in order of arrival, so that a
      backlog of offline calls does not hold streams back until they run dry.

    The rest of the group are calls near the leader's length (``near_in_length``): first chunks with a first chunk, else
    later chunks in the order their streams run out (a stream not followed in ``runs_out``, when
    its chunk was queued) and offline calls in the order they came, the leader's kind first.
    """
    runs_out = runs_out or {}

    def runs_dry(queued: Queued) -> float:
        return runs_out.get(queued.call.session_id, queued.queued_at)

    firsts = [queued for queued in pending if queued.call.token_offset == 0]
    later = sorted((queued for queued in pending if queued.call.token_offset), key=runs_dry)
    offline = [queued for queued in pending if queued.call.token_offset is None]
    if guard_until is not None:
        until = guard_until
        dry = next((q for q in later if runs_out.get(q.call.session_id, until) < until), None)
        if dry is not None:
            return _remove(pending, _of_class([dry, *(q for q in later if q is not dry), *offline], max_rows))
    if firsts:
        return _remove(pending, _of_class(firsts, max_rows))
    if later and offline and offline[0].queued_at < min(queued.queued_at for queued in later):
        return _remove(pending, _of_class([*offline, *later], max_rows))
    return _remove(pending, _of_class([*later, *offline], max_rows))


def _of_class(candidates: list[Queued], max_rows: int) -> list[Queued]:
    """The first of ``candidates`` and those after it near its length, up to ``max_rows``."""
    leader = candidates[0].call
    return [queued for queued in candidates if near_in_length(leader, queued.call)][:max_rows]


def _remove(pending: list[Queued], group: list[Queued]) -> list[Queued]:
    taken = {id(queued) for queued in group}
    pending[:] = [queued for queued in pending if id(queued) not in taken]
    return group


class ConversionQueue:
    """Calls of every batch Triton hands over, converted by one worker thread (see the module's doc).

    ``first_chunks_hold``, where given, is entered around every group of first chunks (the GPU
    turn that asks the LLM's process to wait, ``gpu_turns.py``). A ``playback_guard`` (one per
    queue: the queue records its groups' times in it) lets a later chunk whose stream would run out of
    audio (at ``sample_rate``) within its horizon go before first chunks. Every submitted call is answered
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
        playback_guard: PlaybackGuard | None = None,
        sample_rate: int = 24000,
        gather_s: float = 0.0,
        idle_release: Callable[[], object] | None = None,
        idle_release_s: float = IDLE_RELEASE_S,
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        if not (math.isfinite(gather_s) and gather_s >= 0):
            raise ValueError(f"gather_s must be a finite number of seconds, not negative, got {gather_s}")
        if not (math.isfinite(idle_release_s) and idle_release_s > 0):
            raise ValueError(f"idle_release_s must be a finite number of seconds above 0, got {idle_release_s}")
        self._gather_s = gather_s
        self._idle_release = idle_release
        self._idle_release_s = idle_release_s
        self._token2wav = token2wav
        self._max_rows = max_rows
        self._hold = first_chunks_hold
        self._log_error = log_error
        # Used by the worker thread alone; the queue tells it how long its groups take, so it is not shared.
        self._guard = playback_guard or PlaybackGuard()
        self._sample_rate = sample_rate
        # When each playing stream's audio runs out, by session, the most recently supplied last: kept by
        # the worker thread alone (and by close() once the worker has ended).
        self._runs_out: dict[str, float] = {}
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
        released = True  # nothing converted since the idle release last ran (or ever)
        while True:
            with self._ready:
                idle = not self._pending
                if not self._wait_for_calls(released):
                    group = None
                else:
                    if idle:
                        self._gather()
                    if self._closed:
                        return
                    horizon = self._guard.horizon_s()
                    group = take_group(
                        self._pending,
                        self._max_rows,
                        runs_out=self._runs_out,
                        guard_until=time.monotonic() + horizon if horizon > 0 else None,
                    )
            if group is None:
                self._release_idle()
                released = True
                continue
            self._convert(group)
            released = False

    def _wait_for_calls(self, released: bool) -> bool:
        """Wait for a call or the close (``True``); ``False`` once the queue has stood empty for
        ``idle_release_s`` since converting, and the idle release is due. Called with the condition held."""
        while not self._pending and not self._closed:
            if released or self._idle_release is None:
                self._ready.wait()
            elif not self._ready.wait(self._idle_release_s):
                return bool(self._pending) or self._closed
        return True

    def _release_idle(self) -> None:
        assert self._idle_release is not None
        try:
            self._idle_release()
        except Exception as exc:
            self._log_error(f"token2wav: giving memory back at rest failed: {exc!r}")

    def _gather(self) -> None:
        """Wait while calls that came with the oldest one waiting (the first: calls are kept in the
        order they came) are still arriving (see the module's doc); called with the condition held."""
        if self._gather_s <= 0 or self._closed:
            return
        until = self._pending[0].queued_at + self._gather_s
        while not self._closed and len(self._pending) < self._max_rows:
            now = time.monotonic()
            wait = min(until, self._pending[-1].queued_at + self._gather_s / 4) - now
            if wait <= 0:
                return
            self._ready.wait(wait)

    def _first_chunks_meanwhile(self, lender: list[Queued]) -> None:
        """Between two parts of a later group's flow solve: convert the streams' first chunks waiting,
        a group at a time (those that arrive meanwhile too), until a stream of the ``lender`` group, or
        one whose later chunk waits, would run out of audio within the playback guard."""
        while True:
            with self._ready:
                if self._closed or not any(queued.call.token_offset == 0 for queued in self._pending):
                    return
                horizon = self._guard.horizon_s()
                if horizon > 0:
                    # The lender's streams, and those whose next chunk waits, must not run dry meanwhile.
                    before = time.monotonic() + horizon
                    later = (queued for queued in self._pending if queued.call.token_offset)
                    if any(self._runs_out.get(q.call.session_id, before) < before for q in (*lender, *later)):
                        return
                group = take_group(self._pending, self._max_rows)
            self._convert(group)

    def _convert(self, group: list[Queued]) -> None:
        converted = Converted(time.monotonic(), len(group))
        answered: set[int] = set()

        def on_result(index: int, result: Audio | Exception) -> None:
            answered.add(index)
            self._deliver(group[index], result, converted)

        offset = group[0].call.token_offset
        first_chunks = offset == 0
        lent_s = 0.0

        def meanwhile() -> None:
            nonlocal lent_s
            started = time.monotonic()
            self._first_chunks_meanwhile(group)
            lent_s += time.monotonic() - started

        try:
            # Only later chunks and offline calls lend the GPU: groups converted meanwhile are first chunks,
            # so none nests deeper.
            with self._hold() if first_chunks and self._hold is not None else nullcontext():
                self._token2wav.convert(
                    [queued.call for queued in group], on_result, between_segments=None if first_chunks else meanwhile
                )
            if offset is not None:
                self._guard.record(time.monotonic() - converted.started - lent_s, later_chunks=offset > 0)
        except Exception as exc:
            self._log_error(f"token2wav: converting a group of {len(group)} calls failed: {exc!r}")
            failed = GroupFailed(f"converting its group of {len(group)} calls failed: {exc}")
            for index, queued in enumerate(group):
                if index not in answered:
                    self._deliver(queued, failed, converted)

    def _deliver(self, queued: Queued, result: Audio | Exception, converted: Converted) -> None:
        if queued.call.token_offset is not None:
            self._played(queued.call, result)
        try:
            queued.answer(result, converted)
        except Exception as exc:
            self._log_error(f"token2wav: answering a call failed: {exc!r}")

    def _played(self, call: Conversion, result: Audio | Exception) -> None:
        """Follow the stream's playback: its audio, played from its first chunk on, runs out later by
        this chunk's length (from now if it ran out already); a final chunk or a failure ends it."""
        session = call.session_id
        if call.finalize or isinstance(result, Exception):
            self._runs_out.pop(session, None)
            return
        now = time.monotonic()
        start = now if call.token_offset == 0 else max(now, self._runs_out.pop(session, now))
        self._runs_out[session] = start + result.size / self._sample_rate
        # Streams cancelled mid-way never send a final chunk through the queue: forget the least recently supplied.
        while len(self._runs_out) > _MAX_PLAYING:
            del self._runs_out[next(iter(self._runs_out))]


class QueueClosed(RuntimeError):
    """The queue stopped (the model is unloading) before it converted the call."""


class GroupFailed(RuntimeError):
    """Converting the call's group failed as a whole (not because of the call itself)."""
