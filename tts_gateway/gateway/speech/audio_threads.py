"""The threads that encode and time-stretch the responses' audio: a pool of its own, bounded.

asyncio's default pool grows to ``min(32, CPUs + 4)`` threads as work piles up and never shrinks,
and every thread keeps resident the deepest stack its work ever touched, which ``malloc_trim`` does
not return. In one process on two cores, 32 threads that had encoded mp3, Opus, AAC and FLAC held
31-33 MiB at rest, rising from one round of encodes to the next, against 23 MiB for 4 threads: on a
32-CPU host a gateway worker's memory at rest could rise whenever a new peak of concurrent responses
added encoding threads. Encoding is CPU work, so threads beyond the process's CPUs only queue for
them. The default pool keeps the gateway's other blocking calls (name lookups, voice uploads, the
idle trim), which wait on other things than the CPU and must not queue behind audio.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

MAX_AUDIO_THREADS: Final = 8
# Two at least: one long encode does not hold up every other response's.
MIN_AUDIO_THREADS: Final = 2


def audio_thread_count(cpus: int | None = None) -> int:
    """Threads for one process: one per CPU it may run on, within the bounds above."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(MIN_AUDIO_THREADS, min(MAX_AUDIO_THREADS, cpus))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=audio_thread_count(), thread_name_prefix="audio")


async def run_audio_work(work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``work(*args, **kwargs)`` on the audio pool, in the caller's context (its request id), as
    :func:`asyncio.to_thread` runs it on the default pool."""
    context = contextvars.copy_context()
    call = functools.partial(context.run, work, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_pool(), call)


async def run_audio_work_unless_cheap(cheap: bool, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``work(*args, **kwargs)`` right here when it is ``cheap`` (a hop to a thread and back would cost
    more than the work: raw PCM, wav), else on the audio pool (:func:`run_audio_work`)."""
    if cheap:
        return work(*args, **kwargs)
    return await run_audio_work(work, *args, **kwargs)
