"""The gateway's free heap goes back to the kernel once it is idle, never while responses run."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

from tts_gateway.gateway.speech.idle_memory import IdleMemoryRelease, freeze_startup_objects


class Releases:
    def __init__(self) -> None:
        self.calls = 0
        self.threads: list[str] = []
        self.done = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def __call__(self) -> None:
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        self._loop.call_soon_threadsafe(self.done.set)


async def test_released_once_after_the_last_response_has_been_idle_for_the_delay() -> None:
    releases = Releases()
    idle = IdleMemoryRelease(delay_s=0.05, release=releases)
    idle.begin()
    idle.begin()
    idle.end()
    await asyncio.sleep(0.15)
    assert releases.calls == 0  # one response still runs
    idle.end()
    await asyncio.wait_for(releases.done.wait(), 2.0)
    await asyncio.sleep(0.15)
    assert releases.calls == 1
    assert releases.threads[0] != threading.main_thread().name  # off the event loop's thread


async def test_a_response_that_starts_within_the_delay_cancels_the_release() -> None:
    releases = Releases()
    idle = IdleMemoryRelease(delay_s=0.1, release=releases)
    idle.begin()
    idle.end()
    await asyncio.sleep(0.03)
    idle.begin()  # back-to-back requests: no trim between them
    await asyncio.sleep(0.2)
    assert releases.calls == 0
    assert idle.active == 1
    idle.end()
    await asyncio.wait_for(releases.done.wait(), 2.0)
    assert releases.calls == 1


async def test_a_failing_release_is_logged_and_later_idles_release_again() -> None:
    calls: list[int] = []
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    def release() -> None:
        calls.append(1)
        loop.call_soon_threadsafe(done.set)
        raise OSError("no malloc_trim")

    idle = IdleMemoryRelease(delay_s=0.01, release=release)
    for _ in range(2):
        done.clear()
        idle.begin()
        idle.end()
        await asyncio.wait_for(done.wait(), 2.0)
    assert len(calls) == 2


def test_a_response_ended_outside_the_event_loop_schedules_nothing() -> None:
    idle = IdleMemoryRelease(delay_s=0.01, release=lambda: None)
    idle.begin()
    idle.end()  # no running loop (a generator finalised by the garbage collector): no error
    assert idle.active == 0


class _Cyclic:
    """An object only the cyclic collector frees: it refers to itself."""

    def __init__(self) -> None:
        self.me = self


async def test_the_cyclic_garbage_is_collected_on_the_loop_then_the_trim_runs() -> None:
    enabled = gc.isenabled()
    gc.disable()  # no collection of the interpreter's own in between: only the one at rest
    try:
        garbage = _Cyclic()
        alive = weakref.ref(garbage)
        del garbage
        order: list[tuple[str, str]] = []

        def collect() -> None:
            order.append(("collect", threading.current_thread().name))
            gc.collect()

        releases = Releases()

        def trim() -> None:
            order.append(("trim", threading.current_thread().name))
            releases()

        idle = IdleMemoryRelease(delay_s=0.05, release=trim, collect=collect)
        idle.begin()
        idle.end()
        assert alive() is not None  # not before the delay
        await asyncio.wait_for(releases.done.wait(), 2.0)
        assert alive() is None
        assert [step for step, _ in order] == ["collect", "trim"]
        assert order[0][1] == threading.main_thread().name  # the loop's thread
        assert order[1][1] != threading.main_thread().name
    finally:
        if enabled:
            gc.enable()


def test_startup_objects_are_frozen_out_of_later_collections() -> None:
    try:
        made_at_startup = _Cyclic()
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
        alive = weakref.ref(made_at_startup)
        del made_at_startup
        gc.collect()
        assert alive() is not None  # frozen: no pass looks at it again
    finally:
        gc.unfreeze()
