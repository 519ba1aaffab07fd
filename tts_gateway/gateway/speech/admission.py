"""Admission control for speech requests: a fixed number of synthesis slots and a bounded queue.

A request synthesises only while it holds a :class:`Slot`. When all slots are taken it
waits in a first-come, first-served queue of bounded length for at most ``queue_timeout``
seconds; a full queue or a wait that runs out is a 429 with ``Retry-After``, so load
beyond what the Triton servers can serve is shed at once instead of piling up. A freed slot
passes straight to the longest-waiting request.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

from tts_gateway.gateway.errors import RateLimitError
from tts_gateway.gateway.metrics import GatewayMetrics

# How much each finished request moves the average time a slot is held (for Retry-After).
_HOLD_SMOOTHING = 0.2
# The assumed hold time until a request has finished.
_INITIAL_HOLD_SECONDS = 1.0


class Slot:
    """One request's claim on a synthesis slot; :meth:`release` frees it, and only the first call counts."""

    def __init__(self, admission: AdmissionControl, acquired_at: float) -> None:
        self._admission = admission
        self._acquired_at = acquired_at
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._admission._release(self._acquired_at)


class AdmissionControl:
    def __init__(self, *, slots: int, max_queued: int, queue_timeout: float, metrics: GatewayMetrics) -> None:
        if slots < 1 or max_queued < 0 or queue_timeout <= 0:
            raise ValueError("need at least one slot, a queue length >= 0 and a positive queue timeout")
        self._slots = slots
        self._max_queued = max_queued
        self._queue_timeout = queue_timeout
        self._metrics = metrics
        self._in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._average_hold = _INITIAL_HOLD_SECONDS
        metrics.speech_slots.set(slots)
        self._report()

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> Slot:
        """A slot, at once or after waiting in the queue; :class:`RateLimitError` when there is none."""
        if self._in_use < self._slots and not self._waiters:
            self._in_use += 1
            self._report()
            return Slot(self, time.monotonic())
        if len(self._waiters) >= self._max_queued:
            raise self._reject("queue_full", "the server is at capacity and its queue is full")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._report()
        try:
            async with asyncio.timeout(self._queue_timeout):
                await waiter
        except TimeoutError:
            # A slot handed over just as the wait ran out is taken, not lost.
            if not _granted(waiter):
                raise self._reject(
                    "queue_timeout", f"no synthesis slot became free within {self._queue_timeout:g} s"
                ) from None
        except BaseException:
            if _granted(waiter):
                self._release_slot()  # cancelled just after being handed a slot: pass it on
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            self._report()
        return Slot(self, time.monotonic())

    def _release(self, acquired_at: float) -> None:
        held = time.monotonic() - acquired_at
        self._average_hold += _HOLD_SMOOTHING * (held - self._average_hold)
        self._release_slot()

    def _release_slot(self) -> None:
        """Hand the slot to the longest-waiting request, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._report()
                return
        self._in_use -= 1
        self._report()

    def _reject(self, reason: str, message: str) -> RateLimitError:
        self._metrics.speech_rejected.labels(reason).inc()
        # When the work already admitted would be done, at the recent pace.
        backlog = (self._in_use + len(self._waiters)) * self._average_hold / self._slots
        return RateLimitError(f"{message}; retry later", retry_after=max(1, math.ceil(backlog)))

    def _report(self) -> None:
        self._metrics.speech_slots_in_use.set(self._in_use)
        self._metrics.speech_queued.set(len(self._waiters))


def _granted(waiter: asyncio.Future[None]) -> bool:
    return waiter.done() and not waiter.cancelled()
