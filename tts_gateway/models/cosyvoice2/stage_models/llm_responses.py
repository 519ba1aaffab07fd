"""What the LLM's Triton model needs around the engine: sending responses and noticing cancellations.

The engine's thread must not wait on Triton: every response a Python-backend model sends and every
``is_cancelled()`` it asks is a round trip to the server process. :class:`Outbox` sends from
threads of its own, each request's in order; :class:`TokenStream` puts the tokens that queued
while a request's lane was busy into one response; :class:`CancellationWatch` asks each request in flight
in turn and cancels its engine handle when Triton says so, so that the engine drops the request at
its next step without asking anything itself. All three take plain callables, so they
run (and are tested) without Triton.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable

from tts_gateway.models.cosyvoice2.engines.llm_engine import GenerationHandle

_log = logging.getLogger(__name__)


class Outbox:
    """Runs queued send calls on ``lanes`` threads; the calls queued on one lane run in order.

    A send is a round trip to the server that releases the GIL while it waits, so several lanes
    send at once: with one lane, 64 streams' tokens of one decode step were sent one after another
    and fell behind the engine. Each request takes one lane (:meth:`next_lane`, in turn) for all
    its responses, which keeps them in order.
    """

    def __init__(self, name: str, lanes: int = 4) -> None:
        self._queues: list[queue.SimpleQueue[Callable[[], None] | None]] = [queue.SimpleQueue() for _ in range(lanes)]
        self._threads = [
            threading.Thread(target=self._run, args=(q,), name=f"{name}-outbox-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for thread in self._threads:
            thread.start()
        self._turns = itertools.count()

    def next_lane(self) -> int:
        """The lane of a new request: each in turn (a lane per request, not per hash of anything)."""
        return next(self._turns) % len(self._queues)

    def put(self, lane: int, send: Callable[[], None]) -> None:
        """Queue ``send`` on ``lane``, behind the sends queued there before it."""
        self._queues[lane % len(self._queues)].put(send)

    def close(self) -> None:
        """Send what is queued, then stop."""
        for lane in self._queues:
            lane.put(None)
        for thread in self._threads:
            thread.join()

    @staticmethod
    def _run(lane: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while (send := lane.get()) is not None:
            try:
                send()
            except Exception:
                _log.exception("sending a response failed")


class TokenStream:
    """One streamed request's tokens on its outbox lane: a response per token while the lane keeps up.

    When the lane falls behind (many streams' tokens of one step wait for their round trips), the
    tokens a request made meanwhile leave together in the one response already queued for it,
    instead of a response each: the backlog then shrinks instead of growing, and the consumer
    has fewer responses to take. A response carrying several new tokens is what the
    ``tensorrt_llm`` backend's streaming sends too; the orchestrator reads every token of each.
    :meth:`push` is called from one thread (the engine's), which also queues the request's final
    response on the lane after its last push: the final response then follows every token.
    """

    def __init__(self, outbox: Outbox, lane: int, send: Callable[[list[int]], None]) -> None:
        self._outbox = outbox
        self._lane = lane
        self._send = send
        self._pending: list[int] = []
        self._lock = threading.Lock()

    def push(self, token_id: int) -> None:
        with self._lock:
            self._pending.append(token_id)
            if len(self._pending) > 1:
                return  # the send queued for the first of them takes this one too
        self._outbox.put(self._lane, self._flush)

    def _flush(self) -> None:
        with self._lock:
            tokens, self._pending = self._pending, []
        self._send(tokens)


class CancellationWatch:
    """Cancels engine handles whose Triton request was cancelled, asking about each in turn.

    Each ask is a round trip to the server that gives the interpreter lock up and takes it back, and the
    engine's thread, which gives the lock up at every torch call, pays for each time another thread takes
    it. So the watch asks at most ``checks_per_s`` times a second over all requests, and each request
    every ``min_interval_s`` while that allows: a cancellation is noticed within 20 ms up to 6 requests,
    within 200 ms at 64. On one H200 at 64 text streams, asking every 20 ms (3,200 asks a second) left
    0.79-1.05 pauses per utterance and a decode step every 16.3-17.2 ms, asking every 200 ms 0.62-0.68
    and 15.0-16.8 ms.

    Asking about a request whose final response was sent reaches freed memory in the server
    (the response factory is gone), so :meth:`forget` returns only once no check of that request
    runs, and none runs after it: forget a request before its final response is sent.
    """

    def __init__(self, name: str, min_interval_s: float = 0.02, checks_per_s: float = 320.0) -> None:
        self._min_interval_s = min_interval_s
        self._checks_per_s = checks_per_s
        self._watched: dict[GenerationHandle, Callable[[], bool]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-cancel", daemon=True)
        self._thread.start()

    def interval_s(self, watched: int) -> float:
        """Seconds between two asks about one request while ``watched`` requests are in flight."""
        return max(self._min_interval_s, watched / self._checks_per_s)

    def watch(self, handle: GenerationHandle, is_cancelled: Callable[[], bool]) -> None:
        with self._lock:
            self._watched[handle] = is_cancelled

    def forget(self, handle: GenerationHandle) -> None:
        """Stop checking ``handle``; waits for a check of it that is under way."""
        with self._lock:
            self._watched.pop(handle, None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        handles: list[GenerationHandle] = []
        while not self._stop.wait(self.interval_s(len(handles))):
            with self._lock:
                handles = list(self._watched)
            for handle in handles:
                # Held across the check, so that forget() cannot return while it runs.
                with self._lock:
                    is_cancelled = self._watched.get(handle)
                    if is_cancelled is None:
                        continue
                    try:
                        cancelled = is_cancelled()
                    except Exception:
                        _log.exception("asking whether a request was cancelled failed")
                        continue
                    if cancelled:
                        handle.cancel()
                        del self._watched[handle]
