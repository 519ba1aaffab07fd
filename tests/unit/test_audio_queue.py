"""AudioQueue in process: the audio in order, then its end or the error that ended it, whatever failed."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tts_gateway.gateway.errors import GatewayError, ServerUnavailableError, SynthesisError
from tts_gateway.gateway.speech.audio_queue import AudioQueue


async def _drain(queue: AudioQueue[bytes]) -> list[bytes]:
    items = []
    while (item := await queue.get()) is not None:
        items.append(item)
    return items


async def test_the_audio_comes_in_order_then_its_end() -> None:
    queue: AudioQueue[bytes] = AudioQueue()

    async def work() -> None:
        for piece in (b"a", b"b", b"c"):
            await queue.put(piece)

    producer = asyncio.create_task(queue.produce(work(), "a test"))
    assert await _drain(queue) == [b"a", b"b", b"c"]
    await producer


async def test_a_gateway_error_reaches_the_reader_after_the_audio_before_it() -> None:
    queue: AudioQueue[bytes] = AudioQueue()

    async def work() -> None:
        await queue.put(b"a")
        raise ServerUnavailableError("the server went away")

    await queue.produce(work(), "a test")
    assert await queue.get() == b"a"
    with pytest.raises(ServerUnavailableError, match="went away"):
        await queue.get()


async def test_a_bug_in_the_producer_reaches_the_reader_as_an_internal_error(caplog: pytest.LogCaptureFixture) -> None:
    queue: AudioQueue[bytes] = AudioQueue()

    async def work() -> None:
        raise KeyError("a bug")

    with caplog.at_level(logging.ERROR):
        await queue.produce(work(), "the test's producer")
    with pytest.raises(SynthesisError) as raised:
        await queue.get()
    assert raised.value.code == "internal_error"
    assert raised.value.message == "synthesis failed: KeyError"
    assert "the test's producer failed" in caplog.text


async def test_a_bounded_queue_holds_its_producer_until_the_reader_takes_audio() -> None:
    queue: AudioQueue[bytes] = AudioQueue(maxsize=2)

    async def work() -> None:
        for piece in (b"a", b"b", b"c", b"d"):
            await queue.put(piece)

    producer = asyncio.create_task(queue.produce(work(), "a test"))
    for _ in range(10):
        await asyncio.sleep(0)
    assert not producer.done(), "two pieces wait for the reader: the producer waits with the third"
    assert await _drain(queue) == [b"a", b"b", b"c", b"d"]
    await producer


async def test_a_producer_that_leaves_the_end_to_another_passes_on_its_failure_at_once() -> None:
    """Two producers, as a text-streaming session has (its text sender ends the audio, its audio reader
    may fail first): the failure reaches the reader while the other producer still runs."""
    queue: AudioQueue[bytes] = AudioQueue()
    release = asyncio.Event()

    async def reader() -> None:
        await queue.put(b"a")
        raise SynthesisError("the session broke")

    async def sender() -> None:
        await release.wait()

    ending = asyncio.create_task(queue.produce(sender(), "the sender"))
    await queue.produce(reader(), "the reader", end=False)
    assert await queue.get() == b"a"
    with pytest.raises(GatewayError, match="the session broke"):
        await queue.get()
    assert not ending.done()
    release.set()
    await ending
    assert await queue.get() is None
