"""A stream's speech tokens, read ahead of the orchestrator on a thread of their own.

While the orchestrator waits for token2wav to convert a chunk, the LLM goes on generating. Read
straight from the LLM's stream, those tokens sat unseen in its response queue, and each chunk was
cut at the schedule's hop although far more had arrived. :class:`TokenFeed` collects them as they
come, so the orchestrator can see without blocking how many have arrived and whether the LLM has
finished (:meth:`HopSchedule.catch_up_hop` sizes the next chunk from that). Plain Python, free of
torch and Triton.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Generator


class LLMStalled(TimeoutError):
    """Nothing (no token, nor the end) came from the source for longer than the feed's ``stall_s``."""


class StopSignal:
    """Set once, by the consumer; checks made on the reader's thread go through :meth:`unless_set`.

    A check that asks Triton whether the request was cancelled must not run once the request has
    had its final response (the server frees what the question goes through). The consumer sends
    that response only after :meth:`set` returned, and :meth:`set` waits for a check under way.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False

    def set(self) -> None:
        with self._lock:
            self._set = True

    def is_set(self) -> bool:
        with self._lock:
            return self._set

    def unless_set(self, check: Callable[[], bool]) -> bool:
        """True once set; else what ``check()`` answers (never called after :meth:`set` returned)."""
        with self._lock:
            return self._set or check()


class TokenFeed:
    """Reads ``source`` on a daemon thread until it ends or the feed is closed.

    ``stop`` is set by :meth:`close`; the source should stop when it sees it (the reader also stops
    at the source's next token). The source is closed on the reader's thread, since a generator
    cannot be closed from another thread while it runs. An exception from the source is raised to
    the consumer once it asks for tokens beyond those that arrived before it. With ``stall_s`` the
    consumer waits at most that long after the last token for the next one, then gets
    :class:`LLMStalled`: a generating LLM sends a token every few milliseconds, and one that stopped
    sending must fail the request, not hold it (and its worker) for good.
    """

    def __init__(
        self, source: Generator[int, None, None], stop: StopSignal, *, name: str, stall_s: float | None = None
    ) -> None:
        if stall_s is not None and not (math.isfinite(stall_s) and stall_s > 0):
            raise ValueError(f"stall_s must be a finite positive number of seconds, got {stall_s}")
        self.stop = stop
        self._stall_s = stall_s
        self._tokens: list[int] = []
        self._finished = False
        self._error: BaseException | None = None
        self._last_change = time.monotonic()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(source,), name=name, daemon=True)
        self._thread.start()

    @property
    def arrived(self) -> int:
        """How many tokens have arrived so far."""
        with self._changed:
            return len(self._tokens)

    @property
    def finished(self) -> bool:
        """Whether the source has ended: no token will arrive any more."""
        with self._changed:
            return self._finished

    def wait_for(self, count: int) -> int:
        """Block until ``count`` tokens have arrived or the source has ended; return how many arrived."""
        with self._changed:
            self._wait(lambda: len(self._tokens) >= count or self._finished)
            if len(self._tokens) < count and self._error is not None:
                raise self._error
            return len(self._tokens)

    def tokens(self, end: int) -> list[int]:
        """A copy of the first ``end`` tokens (all that arrived, if fewer)."""
        with self._changed:
            return self._tokens[:end]

    def all_tokens(self) -> list[int]:
        """Every token, once the source has ended; raises the source's exception if it failed."""
        with self._changed:
            self._wait(lambda: self._finished)
            if self._error is not None:
                raise self._error
            return list(self._tokens)

    def close(self, wait_s: float) -> bool:
        """Stop reading and wait up to ``wait_s`` for the reader to let go of the source; whether it did.

        A reader waiting inside the source lets go at the source's next token: an LLM that is
        generating sends one within milliseconds, one that has stalled may not within ``wait_s``.
        """
        self.stop.set()
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    def _wait(self, done: Callable[[], bool]) -> None:
        """Wait (the condition held) until ``done()``; :class:`LLMStalled` once nothing came for ``stall_s``."""
        while not done():
            if self._stall_s is None:
                self._changed.wait()
                continue
            left = self._last_change + self._stall_s - time.monotonic()
            if left <= 0:
                raise LLMStalled(f"the LLM sent nothing for {self._stall_s:g} s")
            self._changed.wait(left)

    def _read(self, source: Generator[int, None, None]) -> None:
        error: BaseException | None = None
        try:
            for token in source:
                if self.stop.is_set():
                    break
                with self._changed:
                    self._tokens.append(token)
                    self._last_change = time.monotonic()
                    self._changed.notify_all()
        except BaseException as exc:  # raised to the consumer by wait_for and all_tokens
            error = exc
        finally:
            try:
                source.close()
            except Exception as exc:
                error = error or exc
            with self._changed:
                self._finished = True
                self._error = error
                self._last_change = time.monotonic()
                self._changed.notify_all()
