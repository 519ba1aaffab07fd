"""A bounded, thread-safe LRU cache of voice prompts, computed once per voice.

Tokenizing, embedding and featurising a reference recording depends only on the recording, so
repeated requests with the same voice reuse the result. Concurrent requests for a voice that is
being computed wait for that computation instead of starting their own.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
from numpy.typing import NDArray

V = TypeVar("V")


def voice_key(wav16k: NDArray[np.float32], reference_text: str) -> str:
    """sha256 of the reference samples (float32, little-endian) and the reference text."""
    samples = np.ascontiguousarray(wav16k, dtype="<f4").tobytes()
    digest = hashlib.sha256()
    # The length prefix keeps (samples, text) pairs from colliding through their concatenation.
    digest.update(len(samples).to_bytes(8, "little"))
    digest.update(samples)
    digest.update(reference_text.encode("utf-8"))
    return digest.hexdigest()


@dataclass(frozen=True)
class CacheStats:
    """Counters of a :class:`PromptCache`; ``misses`` counts computations started."""

    hits: int
    misses: int
    size: int


class PromptCache(Generic[V]):
    """LRU of at most ``max_entries`` values by key; failed computations are not cached."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self._max_entries = max_entries
        self._entries: OrderedDict[str, V] = OrderedDict()
        self._pending: dict[str, Future[V]] = {}
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def get(self, key: str) -> V | None:
        """The cached value of ``key`` (marking it recently used), or None."""
        with self._lock:
            if key not in self._entries:
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return self._entries[key]

    def get_or_compute(self, key: str, compute: Callable[[], V]) -> V:
        """The value of ``key``, computing it with ``compute`` only if no one has or is doing so.

        An exception from ``compute`` reaches every caller waiting for it and nothing is cached.
        """
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self._hits += 1
                return self._entries[key]
            pending = self._pending.get(key)
            if pending is None:
                owner = True
                pending = Future()
                self._pending[key] = pending
                self._misses += 1
            else:
                owner = False
                self._hits += 1
        if not owner:
            return pending.result()
        try:
            value = compute()
        except BaseException as exc:
            with self._lock:
                del self._pending[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._pending[key]
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
        pending.set_result(value)
        return value

    def stats(self) -> CacheStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return CacheStats(hits=self._hits, misses=self._misses, size=len(self._entries))

    def clear(self) -> None:
        """Drop every cached value (computations under way still complete for their callers)."""
        with self._lock:
            self._entries.clear()
