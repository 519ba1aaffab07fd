"""Admission control: slots, the bounded queue, 429s with Retry-After, and slots freed exactly once."""

from __future__ import annotations

import asyncio
import time

import pytest

from tts_gateway.gateway.errors import RateLimitError
from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.speech.admission import AdmissionControl


def _admission(slots: int = 1, max_queued: int = 1, queue_timeout: float = 5.0) -> AdmissionControl:
    return AdmissionControl(slots=slots, max_queued=max_queued, queue_timeout=queue_timeout, metrics=GatewayMetrics())


def _sample(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


async def test_free_slots_are_taken_at_once_then_requests_queue() -> None:
    admission = _admission(slots=2, max_queued=1)
    first, second = await admission.acquire(), await admission.acquire()
    waiting = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0.01)
    assert (admission.in_use, admission.queued) == (2, 1)
    assert not waiting.done()
    first.release()
    third = await asyncio.wait_for(waiting, 1.0)
    assert (admission.in_use, admission.queued) == (2, 0)
    for slot in (second, third):
        slot.release()
    assert admission.in_use == 0


async def test_a_full_queue_is_a_429_with_retry_after() -> None:
    metrics = GatewayMetrics()
    admission = AdmissionControl(slots=1, max_queued=1, queue_timeout=5.0, metrics=metrics)
    slot = await admission.acquire()
    waiting = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0.01)
    with pytest.raises(RateLimitError) as info:
        await admission.acquire()
    error = info.value
    assert error.status_code == 429
    assert error.body()["error"] == {
        "message": error.message,
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    assert int(error.headers["Retry-After"]) >= 1
    assert _sample(metrics, "tts_speech_rejected_total", reason="queue_full") == 1
    assert _sample(metrics, "tts_speech_queued") == 1
    slot.release()
    (await waiting).release()
    assert _sample(metrics, "tts_speech_slots_in_use") == 0
    assert _sample(metrics, "tts_speech_slots") == 1


async def test_no_queue_means_no_waiting() -> None:
    admission = _admission(slots=1, max_queued=0)
    slot = await admission.acquire()
    with pytest.raises(RateLimitError):
        await admission.acquire()
    slot.release()
    (await admission.acquire()).release()


async def test_waiting_past_the_queue_timeout_is_a_429() -> None:
    metrics = GatewayMetrics()
    admission = AdmissionControl(slots=1, max_queued=4, queue_timeout=0.2, metrics=metrics)
    slot = await admission.acquire()
    started = time.monotonic()
    with pytest.raises(RateLimitError) as info:
        await admission.acquire()
    assert 0.2 <= time.monotonic() - started < 1.0
    assert "0.2 s" in info.value.message
    assert admission.queued == 0
    assert _sample(metrics, "tts_speech_rejected_total", reason="queue_timeout") == 1
    slot.release()
    assert admission.in_use == 0


async def test_releasing_twice_frees_one_slot() -> None:
    admission = _admission(slots=2, max_queued=0)
    first = await admission.acquire()
    second = await admission.acquire()
    first.release()
    first.release()
    assert admission.in_use == 1
    second.release()
    assert admission.in_use == 0


async def test_slots_go_to_waiters_first_come_first_served() -> None:
    admission = _admission(slots=1, max_queued=3)
    slot = await admission.acquire()
    order: list[int] = []

    async def wait(n: int) -> None:
        granted = await admission.acquire()
        order.append(n)
        await asyncio.sleep(0.01)
        granted.release()

    tasks = []
    for n in range(3):
        tasks.append(asyncio.create_task(wait(n)))
        await asyncio.sleep(0.01)  # queue them in a known order
    slot.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert (admission.in_use, admission.queued) == (0, 0)


async def test_a_cancelled_waiter_leaves_the_queue_and_loses_no_slot() -> None:
    admission = _admission(slots=1, max_queued=2)
    slot = await admission.acquire()
    gone = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0.01)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert admission.queued == 0
    slot.release()
    assert admission.in_use == 0


async def test_a_waiter_cancelled_as_it_is_handed_a_slot_passes_it_on() -> None:
    admission = _admission(slots=1, max_queued=2)
    slot = await admission.acquire()
    unlucky = asyncio.create_task(admission.acquire())
    next_in_line = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0.01)
    slot.release()  # hands the slot to `unlucky`, which has not run yet
    unlucky.cancel()
    with pytest.raises(asyncio.CancelledError):
        await unlucky
    (await asyncio.wait_for(next_in_line, 1.0)).release()
    assert (admission.in_use, admission.queued) == (0, 0)


async def test_retry_after_is_when_the_admitted_work_should_be_done() -> None:
    admission = _admission(slots=1, max_queued=3)

    async def retry_after_when_full() -> int:
        slot = await admission.acquire()
        waiters = [asyncio.create_task(admission.acquire()) for _ in range(3)]
        await asyncio.sleep(0.01)
        with pytest.raises(RateLimitError) as info:
            await admission.acquire()
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        slot.release()
        return info.value.retry_after

    # Nothing measured yet: one second per request, four requests ahead (one running, three queued).
    assert await retry_after_when_full() == 4
    for _ in range(20):
        slot = await admission.acquire()
        await asyncio.sleep(0.01)
        slot.release()
    # Requests now take about 10 ms: whole seconds round up to the minimum.
    assert await retry_after_when_full() == 1
