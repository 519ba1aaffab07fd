"""The voice-prompt LRU: keys, eviction, counters and one computation under concurrency."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tts_gateway.models.cosyvoice2.orchestrator.prompt_cache import CacheStats, PromptCache, voice_key

pytestmark = pytest.mark.cosyvoice


def test_voice_key_depends_on_samples_and_text() -> None:
    wav = np.linspace(-1, 1, 1600, dtype=np.float32)
    key = voice_key(wav, "hello")
    assert key == voice_key(wav.copy(), "hello")
    assert len(key) == 64
    changed = wav.copy()
    changed[800] += 1e-3
    assert len({key, voice_key(changed, "hello"), voice_key(wav, "hello!"), voice_key(wav[:-1], "hello")}) == 4


def test_voice_key_does_not_mix_samples_into_text() -> None:
    wav = np.array([0.5], dtype=np.float32)
    tail = wav.tobytes().decode("latin-1")
    assert voice_key(np.concatenate([wav, wav]), "x") != voice_key(wav, tail + "x")


def test_voice_key_is_independent_of_input_float_type() -> None:
    wav = np.linspace(-1, 1, 100, dtype=np.float32)
    assert voice_key(wav.astype(np.float64), "t") == voice_key(wav, "t")


def test_computes_once_then_hits() -> None:
    cache: PromptCache[str] = PromptCache(max_entries=4)
    calls: list[str] = []

    def compute() -> str:
        calls.append("a")
        return "value-a"

    assert cache.get_or_compute("a", compute) == "value-a"
    assert cache.get_or_compute("a", compute) == "value-a"
    assert cache.get("a") == "value-a"
    assert cache.get("missing") is None
    assert calls == ["a"]
    assert cache.stats() == CacheStats(hits=2, misses=1, size=1)


def test_evicts_least_recently_used() -> None:
    cache: PromptCache[int] = PromptCache(max_entries=2)
    cache.get_or_compute("a", lambda: 1)
    cache.get_or_compute("b", lambda: 2)
    cache.get_or_compute("a", lambda: -1)  # a is now more recent than b
    cache.get_or_compute("c", lambda: 3)
    assert cache.get("b") is None
    assert cache.get("a") == 1
    assert cache.get("c") == 3
    assert cache.stats().size == 2


def test_failures_propagate_and_are_not_cached() -> None:
    cache: PromptCache[int] = PromptCache(max_entries=2)

    def broken() -> int:
        raise RuntimeError("decoder failed")

    with pytest.raises(RuntimeError, match="decoder failed"):
        cache.get_or_compute("a", broken)
    assert cache.get_or_compute("a", lambda: 7) == 7
    assert cache.stats() == CacheStats(hits=0, misses=2, size=1)


def test_concurrent_requests_for_one_voice_compute_once() -> None:
    cache: PromptCache[int] = PromptCache(max_entries=2)
    started = threading.Event()
    release = threading.Event()
    calls = 0

    def slow() -> int:
        nonlocal calls
        calls += 1
        started.set()
        assert release.wait(5)
        return 42

    with ThreadPoolExecutor(max_workers=8) as pool:
        first = pool.submit(cache.get_or_compute, "voice", slow)
        assert started.wait(5)
        waiters = [pool.submit(cache.get_or_compute, "voice", slow) for _ in range(7)]
        deadline = time.monotonic() + 5
        while cache.stats().hits < 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(waiter.done() for waiter in waiters)
        release.set()
        results = [first.result(5), *(waiter.result(5) for waiter in waiters)]
    assert results == [42] * 8
    assert calls == 1
    assert cache.stats() == CacheStats(hits=7, misses=1, size=1)


def test_concurrent_waiters_see_the_failure() -> None:
    cache: PromptCache[int] = PromptCache(max_entries=2)
    started = threading.Event()
    release = threading.Event()

    def failing() -> int:
        started.set()
        assert release.wait(5)
        raise ValueError("bad reference audio")

    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(cache.get_or_compute, "voice", failing)
        assert started.wait(5)
        waiter = pool.submit(cache.get_or_compute, "voice", lambda: 1)
        deadline = time.monotonic() + 5
        while cache.stats().hits < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        release.set()
        for future in (first, waiter):
            with pytest.raises(ValueError, match="bad reference audio"):
                future.result(5)
    assert cache.stats().size == 0


def test_independent_voices_compute_in_parallel() -> None:
    cache: PromptCache[str] = PromptCache(max_entries=8)
    barrier = threading.Barrier(3, timeout=5)

    def compute(name: str) -> str:
        barrier.wait()  # only passes if all three computations run at the same time
        return name

    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = [pool.submit(cache.get_or_compute, name, lambda name=name: compute(name)) for name in "abc"]
        assert [future.result(10) for future in futures] == ["a", "b", "c"]


def test_rejects_an_empty_bound() -> None:
    with pytest.raises(ValueError):
        PromptCache(max_entries=0)
