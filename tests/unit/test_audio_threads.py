"""The responses' audio is encoded and stretched on a bounded pool of its own, in the request's context."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest

from tts_gateway.gateway.speech.audio_threads import (
    MAX_AUDIO_THREADS,
    audio_thread_count,
    run_audio_work,
    run_audio_work_unless_cheap,
)

REQUEST = contextvars.ContextVar("request", default="none")


def thread_and_request(hold_s: float) -> tuple[str, str]:
    time.sleep(hold_s)
    return threading.current_thread().name, REQUEST.get()


@pytest.mark.parametrize(("cpus", "threads"), [(1, 2), (2, 2), (6, 6), (32, 8), (128, 8)])
def test_one_thread_per_cpu_within_the_bounds(cpus: int, threads: int) -> None:
    assert audio_thread_count(cpus) == threads
    assert audio_thread_count() <= MAX_AUDIO_THREADS


async def test_audio_work_piles_up_on_the_bounded_pool_in_its_requests_context() -> None:
    async def one(request: str) -> tuple[str, str]:
        REQUEST.set(request)
        return await run_audio_work(thread_and_request, 0.05)

    jobs = 3 * audio_thread_count()
    results = await asyncio.gather(*(one(f"r{i}") for i in range(jobs)))
    names = {name for name, _ in results}
    assert all(name.startswith("audio") for name in names)
    assert len(names) == audio_thread_count()
    assert [request for _, request in results] == [f"r{i}" for i in range(jobs)]


async def test_the_default_pool_is_left_to_the_gateways_other_blocking_calls() -> None:
    await run_audio_work(thread_and_request, 0.0)
    name, _ = await asyncio.to_thread(thread_and_request, 0.0)
    assert not name.startswith("audio")


async def test_cheap_work_runs_here_and_costly_work_on_the_pool() -> None:
    REQUEST.set("r")
    here, _ = await run_audio_work_unless_cheap(True, thread_and_request, 0.0)
    pooled = await run_audio_work_unless_cheap(False, thread_and_request, 0.0)
    assert here == threading.current_thread().name
    assert pooled[0].startswith("audio") and pooled[1] == "r"
