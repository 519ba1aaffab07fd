"""PhrasePipeline in process, over a phrase synthesizer that answers when told: what counts as unspoken,
the socket's share of the speech slots, and which phrases continue a turn."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tts_gateway.gateway.speech.text_stream.phrase_chunker import PhraseChunker
from tts_gateway.gateway.speech.text_stream.synthesis import PhrasePipeline


class HeldPhrase:
    def __init__(self, release: asyncio.Event) -> None:
        self.normalized = "x"
        self._release = release

    async def __aiter__(self) -> AsyncIterator[bytes]:
        await self._release.wait()
        yield b"\x00\x00" * 240

    async def aclose(self) -> None:
        pass


class Phrases:
    """Opens every phrase at once; its audio comes when ``release`` is set. Records what was opened."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.opened: list[tuple[str, bool]] = []

    async def open(self, text: str, *, continued: bool = False) -> HeldPhrase:
        self.opened.append((text, continued))
        return HeldPhrase(self.release)


async def test_text_counts_as_unspoken_until_its_audio_is_handed_out() -> None:
    phrases = Phrases()
    pipeline = PhrasePipeline(phrases, PhraseChunker())
    await pipeline.push("One sentence here. And a half")
    assert pipeline.buffered == len("One sentence here. And a half")
    assert pipeline.in_progress
    await pipeline.end_input()
    phrases.release.set()
    chunks = [chunk async for chunk in pipeline.chunks()]
    assert len(chunks) == 2
    assert pipeline.buffered == 0
    assert not pipeline.in_progress


async def test_a_turns_later_phrases_continue_it() -> None:
    phrases = Phrases()
    pipeline = PhrasePipeline(phrases, PhraseChunker(auto_mode=True))
    for text in ("First.", "Second.", "Third."):
        await pipeline.push(text)
    await pipeline.end_input()
    phrases.release.set()
    assert len([chunk async for chunk in pipeline.chunks()]) == 3
    assert phrases.opened == [("First.", False), ("Second.", True), ("Third.", True)]


async def test_the_contexts_of_a_socket_share_its_speech_slots() -> None:
    phrases = Phrases()
    share = asyncio.Semaphore(1)
    contexts = [PhrasePipeline(phrases, PhraseChunker(auto_mode=True), speech_slots=share) for _ in range(3)]
    for index, pipeline in enumerate(contexts):
        await pipeline.push(f"Context {index}.")
    await asyncio.sleep(0.05)
    assert len(phrases.opened) == 1, "one slot: the other contexts wait their turn"
    phrases.release.set()
    for pipeline in contexts:
        await pipeline.end_input()
        assert len([chunk async for chunk in pipeline.chunks()]) == 1
    assert len(phrases.opened) == 3


class SlowlyClosedPhrase(HeldPhrase):
    """A phrase whose backend call takes until ``closed`` is set to end (the speech stream's aclose)."""

    def __init__(self, release: asyncio.Event, closed: asyncio.Event) -> None:
        super().__init__(release)
        self._closed = closed

    async def aclose(self) -> None:
        await self._closed.wait()


class SlowlyClosedPhrases(Phrases):
    def __init__(self) -> None:
        super().__init__()
        self.closed = asyncio.Event()
        self.speaking = asyncio.Event()

    async def open(self, text: str, *, continued: bool = False) -> HeldPhrase:
        self.opened.append((text, continued))
        self.speaking.set()
        return SlowlyClosedPhrase(self.release, self.closed)


async def test_closing_keeps_the_callers_own_cancellation() -> None:
    phrases = SlowlyClosedPhrases()
    pipeline = PhrasePipeline(phrases, PhraseChunker(auto_mode=True))
    await pipeline.push("One sentence.")
    await phrases.speaking.wait()
    closer = asyncio.create_task(pipeline.aclose())
    await asyncio.sleep(0.05)
    assert not closer.done(), "closing waits for the phrase's backend call to end"
    # The session that closes it ends meanwhile: its cancellation is not taken for the phrase's.
    closer.cancel()
    phrases.closed.set()
    await asyncio.wait({closer})
    assert closer.cancelled()
