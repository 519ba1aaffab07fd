"""StreamedTextSynthesis in process, over a model session that takes pieces when told: the words that
wait behind a piece in flight go to the model as one piece, normalised once, in order, and their
characters are still aligned once each."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np
from numpy.typing import NDArray

from tests.unit.test_text_stream_alignment import check
from tts_gateway.gateway.speech.audio_encoding import OUTPUT_SAMPLE_RATE
from tts_gateway.gateway.speech.plan import ContextPlan
from tts_gateway.gateway.speech.text_stream.phrase_chunker import PhraseChunker
from tts_gateway.gateway.speech.text_stream.text_streaming_model import StreamedTextSynthesis, TextStreamCalls
from tts_gateway.models.stage_trace import StageTrace, read_traces

# The context's model speaks at the output rate, so the audio's length in bytes gives its duration.
CONTEXT = cast(ContextPlan, SimpleNamespace(model=SimpleNamespace(sample_rate=OUTPUT_SAMPLE_RATE)))
# What the model speaks for each piece, and at the text's end.
SPOKEN_SAMPLES = OUTPUT_SAMPLE_RATE // 5
# Turns of the event loop (no clock) within which a word reaches an idle model: a handful of task
# switches from the socket's push to the session's send, with room to spare; a send that waited on a
# timer for more words would still miss them (they take microseconds).
TURNS = 50


class Model:
    """One session in the model: notes every piece as it is sent (``None`` for the text's end) and takes
    it once ``taking`` is set; speaks a little audio for each piece taken, and for the end."""

    session_id = "session-1"
    opening_request_id = "session-1:0"

    def __init__(self, *, taking: bool = True) -> None:
        self.received: list[str | None] = []
        self.taking = asyncio.Event()
        if taking:
            self.taking.set()
        self._sent = asyncio.Condition()
        self._audio: asyncio.Queue[NDArray[np.float32] | None] = asyncio.Queue()

    async def send_text(self, piece: str) -> None:
        self.received.append(piece)
        async with self._sent:
            self._sent.notify_all()
        await self.taking.wait()
        self._audio.put_nowait(np.zeros(SPOKEN_SAMPLES, np.float32))

    async def finish(self) -> None:
        self.received.append(None)
        self._audio.put_nowait(np.zeros(SPOKEN_SAMPLES, np.float32))
        self._audio.put_nowait(None)

    async def sent(self, count: int) -> None:
        """Until ``count`` pieces were sent."""
        async with self._sent:
            await self._sent.wait_for(lambda: len(self.received) >= count)

    async def cancel(self) -> None:
        self._audio.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[NDArray[np.float32]]:
        while (chunk := await self._audio.get()) is not None:
            yield chunk


class Sessions:
    """:class:`TextStreamCalls` over one :class:`Model`, whose normalisation upper-cases and notes its input."""

    def __init__(self, model: Model, trace: StageTrace | None = None) -> None:
        self.model = model
        self.normalized_texts: list[str] = []
        self.trace = trace or StageTrace("gateway", None)

    async def normalized(self, context: ContextPlan, text: str) -> str:
        self.normalized_texts.append(text)
        return text.upper()

    @contextlib.asynccontextmanager
    async def open(self, context: ContextPlan) -> AsyncIterator[Model]:
        try:
            yield self.model
        finally:
            # As the real sessions: the model's session is closed when its owner leaves it.
            await self.model.cancel()


def synthesis(sessions: Sessions) -> StreamedTextSynthesis:
    return StreamedTextSynthesis(cast(TextStreamCalls, sessions), CONTEXT, PhraseChunker(), asyncio.Semaphore(1))


async def turns(count: int = TURNS) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def aligned(stream: StreamedTextSynthesis) -> tuple[str, str, list[bool]]:
    """The characters (as sent, as spoken) that the chunks report, each chunk's alignment checked within
    its audio, and which chunks end the phrase."""
    chars, normalized, ends = "", "", []
    async for chunk in stream.chunks():
        ms = len(chunk.pcm) / 2 / OUTPUT_SAMPLE_RATE * 1000
        sent, spoken = chunk.align(ms)
        for alignment in (sent, spoken):
            check(alignment.chars, alignment.start_ms, alignment.duration_ms, ms)
        chars += "".join(sent.chars)
        normalized += "".join(spoken.chars)
        ends.append(chunk.phrase_end)
    return chars, normalized, ends


async def test_words_that_wait_behind_a_piece_in_flight_go_as_one_piece_normalised_once() -> None:
    model = Model(taking=False)
    sessions = Sessions(model)
    stream = synthesis(sessions)
    await stream.push("One ")
    await model.sent(1)
    for word in ("two ", "three ", "four "):
        await stream.push(word)
    await turns()
    assert model.received == ["ONE "], "nothing more is sent while the model has not taken the first piece"
    assert stream.in_progress
    model.taking.set()
    await model.sent(2)
    await turns()
    assert model.received == ["ONE ", "TWO THREE FOUR "]
    assert sessions.normalized_texts == ["One", "two three four"]
    assert not stream.in_progress
    await stream.aclose()


async def test_with_an_idle_model_every_word_goes_as_soon_as_it_is_complete() -> None:
    model = Model()
    sessions = Sessions(model)
    stream = synthesis(sessions)
    words = ["One ", "two ", "three ", "four "]
    for count, word in enumerate(words, start=1):
        await stream.push(word)
        # No clock: the word reaches the model within a few turns of the event loop.
        await turns()
        assert len(model.received) == count
    assert model.received == [word.upper() for word in words]
    assert sessions.normalized_texts == [word.strip() for word in words]
    await stream.aclose()


async def test_the_end_that_waits_with_words_sends_them_then_finishes() -> None:
    model = Model(taking=False)
    stream = synthesis(Sessions(model))
    await stream.push("One ")
    await model.sent(1)
    await stream.push("two ")
    await stream.push("three")
    await stream.end_input()
    model.taking.set()
    chars, normalized, ends = await aligned(stream)
    assert model.received == ["ONE ", "TWO THREE", None]
    assert chars == "One two three"
    assert normalized == "ONE TWO THREE"
    assert ends[-1] and not any(ends[:-1])
    assert stream.buffered == 0 and not stream.in_progress


async def test_the_characters_of_joined_pieces_are_each_aligned_once() -> None:
    model = Model(taking=False)
    stream = synthesis(Sessions(model))
    listener = asyncio.create_task(aligned(stream))
    words = ["  Hello ", "there,  ", "how ", "are ", "you ", "today? ", "Fine, ", "thanks."]
    await stream.push(words[0])
    await model.sent(1)
    for word in words[1:4]:
        await stream.push(word)
    model.taking.set()
    await model.sent(2)
    for word in words[4:]:
        await stream.push(word)
    await stream.end_input()
    chars, normalized, ends = await listener
    assert model.received == ["  HELLO ", "THERE,  HOW ARE ", "YOU TODAY? FINE, THANKS.", None]
    text = "".join(words)
    assert chars == text
    assert normalized == text.upper()
    assert len(ends) == 4 and ends[-1]


async def test_a_traced_session_records_when_it_reached_its_first_steps(tmp_path: Path) -> None:
    model = Model(taking=False)
    stream = synthesis(Sessions(model, StageTrace("gateway", tmp_path)))
    listener = asyncio.create_task(aligned(stream))
    await stream.push("One ")
    await model.sent(1)
    held = time.monotonic()
    await asyncio.sleep(0.05)
    model.taking.set()
    await stream.end_input()
    await listener

    [event] = read_traces(tmp_path)
    assert event["key"] == "session-1" and event["request"] == "session-1:0"
    steps = [float(event[name]) for name in ("text_in", "opening", "opened", "first_taken")]
    assert steps[0] > 0 and steps == sorted(steps)
    # The piece was taken once the model let it, and its audio came after that and then went on.
    assert float(event["first_taken"]) - held >= 0.05
    assert float(event["first_taken"]) <= float(event["first_audio"]) <= float(event["first_out"])


class ModelThatEndsWhenTold(Model):
    """A :class:`Model` whose audio ends when the test says, not at the text's end."""

    async def finish(self) -> None:
        self.received.append(None)

    def speak(self) -> None:
        self._audio.put_nowait(np.zeros(SPOKEN_SAMPLES, np.float32))

    def end(self) -> None:
        self._audio.put_nowait(None)


async def test_after_the_texts_end_a_chunk_goes_out_before_the_next_one_comes() -> None:
    model = ModelThatEndsWhenTold()
    stream = synthesis(Sessions(model))
    await stream.push("One ")
    await stream.end_input()
    chunks = stream.chunks()
    # The piece's audio came after the text's end; no more comes until the test sends it.
    first = await asyncio.wait_for(anext(chunks), 5.0)
    assert len(first.pcm) == 2 * SPOKEN_SAMPLES and not first.phrase_end
    # The last chunk, which the end follows at once, is the phrase's end and takes the rest.
    model.speak()
    model.end()
    rest = [chunk async for chunk in chunks]
    assert [(len(chunk.pcm), chunk.phrase_end) for chunk in rest] == [(2 * SPOKEN_SAMPLES, True)]
    assert model.received == ["ONE ", None]


class ModelThatClosesSlowly(ModelThatEndsWhenTold):
    """Its session's close takes a round trip of 100 ms, as a close through Triton's sequence batcher may."""

    async def cancel(self) -> None:
        await asyncio.sleep(0.1)
        await super().cancel()


async def test_the_last_chunk_takes_the_rest_though_the_session_closes_slowly() -> None:
    model = ModelThatClosesSlowly()
    stream = synthesis(Sessions(model))
    text = "One two three four five six seven "
    listener = asyncio.create_task(chunks_of(stream))
    await stream.push(text)
    await stream.end_input()
    await model.sent(1)
    await asyncio.sleep(0.05)
    model.speak()
    model.end()
    chunks = await listener
    # The last chunk is the one the model ended its stream with, not an empty one after the close.
    assert chunks[-1][:2] == (2 * SPOKEN_SAMPLES, True) and not any(end for _, end, _ in chunks[:-1])
    assert "".join(chars for _, _, chars in chunks) == text


async def chunks_of(stream: StreamedTextSynthesis) -> list[tuple[int, bool, str]]:
    """Each chunk's bytes of audio, whether it ends the phrase, and the characters it was aligned with."""
    out = []
    async for chunk in stream.chunks():
        ms = len(chunk.pcm) / 2 / OUTPUT_SAMPLE_RATE * 1000
        sent, _ = chunk.align(ms)
        out.append((len(chunk.pcm), chunk.phrase_end, "".join(sent.chars)))
    return out


async def test_a_session_the_model_ended_before_the_texts_end_is_not_finished_by_it() -> None:
    # A model that ends the session early (unloading, say) has not spoken the text sent: no chunk may
    # claim the phrase's end until the session's task is done with it.
    model = ModelThatEndsWhenTold()
    stream = synthesis(Sessions(model))
    received: list[tuple[int, bool]] = []

    async def listen() -> None:
        async for chunk in stream.chunks():
            received.append((len(chunk.pcm), chunk.phrase_end))

    listener = asyncio.create_task(listen())
    await stream.push("One ")
    await model.sent(1)
    model.end()
    await turns()
    assert received == [(2 * SPOKEN_SAMPLES, False)]
    await stream.end_input()
    await listener
    assert received == [(2 * SPOKEN_SAMPLES, False), (0, True)]
