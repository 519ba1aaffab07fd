"""From a context's text to its audio, behind a small interface.

:class:`TextStreamSynthesizer` is what a socket's context talks to: text goes in piece by piece,
chunks of audio with their alignment come out in order. A model that takes text as it arrives
can implement it directly. :class:`PhrasePipeline` implements it for every other model: a
:class:`PhraseChunker` cuts the text into phrases, each phrase is synthesised on its own by a
:class:`PhraseSynthesizer` as soon as it is complete (up to ``parallel`` at once, so the next
phrase is ready when the current one ends), and the audio goes out strictly in phrase order.
Every phrase also holds one of the socket's share of the speech slots while it synthesises.

:class:`SpeechServicePhrases` is the :class:`PhraseSynthesizer` of the gateway's models: each
phrase is one request to the speech service (admission control, the Triton pool, the streamed
model variant, resampling to 24 kHz PCM), planned within the context's :class:`ContextPlan`
(model and voice resolved once, when the context opened): the phrase is only normalised and cut
into sentences. This package thus holds no synthesis machinery of its own. A phrase after a
context's first continues audio the listener is already hearing, as a started response's later
sentences do, so it follows their rule when a server fails: it waits for another (or the
restarted one) within the request's deadline instead of failing at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Final, Protocol

from tts_gateway.gateway.errors import GatewayError
from tts_gateway.gateway.speech.audio_queue import AudioQueue
from tts_gateway.gateway.speech.plan import ContextPlan, SpeechPlan, SpeechPlanner
from tts_gateway.gateway.speech.service import SpeechStream, StreamAborted
from tts_gateway.gateway.speech.text_stream.alignment import CharAlignment, PhraseAligner
from tts_gateway.gateway.speech.text_stream.output_format import pcm_pieces
from tts_gateway.gateway.speech.text_stream.phrase_chunker import PhraseChunker, push_async

# Chunks one phrase may have ready before its producer waits for the socket: a slow client
# then slows the Triton stream instead of growing the gateway's memory.
_PHRASE_QUEUE_CHUNKS: Final = 32


@dataclass(frozen=True)
class VoiceChoice:
    """What a context asks to speak with, by name (resolved when the context opens: :class:`ContextPlan`)."""

    voice: str
    model: str
    speed: float = 1.0
    normalize: bool | None = None
    """Text normalisation; ``None`` follows the gateway's default."""


@dataclass(frozen=True)
class SpeechChunk:
    pcm: bytes
    """16-bit little-endian mono PCM at the speech service's output rate (24 kHz)."""
    spoken: PhraseAligner
    normalized: PhraseAligner
    phrase_end: bool
    """The last chunk of a phrase: resamplers and encoders may drain."""

    def align(self, audio_ms: float) -> tuple[CharAlignment, CharAlignment]:
        """The characters (as sent, as spoken) of this chunk's audio, once converted to ``audio_ms``
        milliseconds: a resampler's delay moves a little audio from one message to the next."""
        return (
            self.spoken.take(audio_ms, last=self.phrase_end),
            self.normalized.take(audio_ms, last=self.phrase_end),
        )


class TextStreamSynthesizer(Protocol):
    """One context's synthesis: text in as it comes, audio out in order."""

    @property
    def buffered(self) -> int:
        """Characters received and not yet spoken (whose audio has not all been handed out)."""
        ...

    @property
    def in_progress(self) -> bool:
        """Some of the text is being synthesised or its audio handed out (not merely buffered)."""
        ...

    async def push(self, text: str) -> None: ...

    async def flush(self) -> None:
        """Synthesise everything received so far, without waiting for more."""
        ...

    async def end_input(self) -> None:
        """No more text: :meth:`chunks` ends once everything received is spoken."""
        ...

    def chunks(self) -> AsyncIterator[SpeechChunk]:
        """The audio, in order; raises :class:`GatewayError` if synthesis fails."""
        ...

    async def aclose(self) -> None:
        """Stop at once: cancel every Triton call of the context."""
        ...


class PhraseAudio(Protocol):
    normalized: str
    """The phrase as the model reads it (numbers, money... as words)."""

    def __aiter__(self) -> AsyncIterator[bytes]:
        """16-bit PCM at the speech service's output rate, as the model produces it."""
        ...

    async def aclose(self) -> None: ...


class PhraseSynthesizer(Protocol):
    """The phrases of one context, in the voice it opened with."""

    async def open(self, text: str, *, continued: bool = False) -> PhraseAudio | None:
        """Start synthesising ``text``; ``None`` when it holds nothing to speak.

        ``continued``: the listener already hears the context's audio, so a server that fails is
        waited for rather than reported at once.
        """
        ...


class OpenStream(Protocol):
    """:meth:`SpeechService.open_stream`."""

    def __call__(self, plan: SpeechPlan, *, continued: bool = False) -> Awaitable[SpeechStream]: ...


class SpeechServicePhrases:
    """One context's phrases synthesised by the speech service, one speech request each.

    Each phrase is planned within ``context`` (:meth:`SpeechPlanner.piece`), then streamed through
    the service's one entry point, passed in so that this module depends on nothing else of the
    service. A continued phrase waits for a server there, as a started response's sentences do.
    """

    def __init__(self, planner: SpeechPlanner, open_stream: OpenStream, context: ContextPlan) -> None:
        self._planner = planner
        self._open_stream = open_stream
        self._context = context

    async def open(self, text: str, *, continued: bool = False) -> PhraseAudio | None:
        normalized = await self._planner.normalize(self._context, text)
        try:
            stream = await self._open_stream(self._planner.piece(self._context, normalized), continued=continued)
        except GatewayError as exc:
            if exc.code == "nothing_to_speak":
                return None
            raise
        return _StreamedPhrase(normalized, stream)


class _StreamedPhrase:
    def __init__(self, normalized: str, stream: SpeechStream) -> None:
        self.normalized = normalized
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for data in self._stream:
                yield data
        except StreamAborted as exc:
            # The service could not complete the phrase (its failover included): the phrase's failure.
            raise exc.error from exc

    async def aclose(self) -> None:
        await self._stream.aclose()


@dataclass(eq=False)
class _Phrase:
    text: str
    continued: bool
    queue: AudioQueue[bytes] = field(default_factory=lambda: AudioQueue(_PHRASE_QUEUE_CHUNKS))
    normalized: str = ""
    task: asyncio.Task[None] | None = None


class PhrasePipeline:
    """A :class:`TextStreamSynthesizer` over any :class:`PhraseSynthesizer` (see the module's docstring)."""

    def __init__(
        self,
        phrases: PhraseSynthesizer,
        chunker: PhraseChunker,
        *,
        parallel: int = 2,
        speech_slots: asyncio.Semaphore | None = None,
    ) -> None:
        """``speech_slots``: the socket's share of the speech slots, shared by its contexts."""
        self._phrases = phrases
        self._chunker = chunker
        self._slots = asyncio.Semaphore(parallel)
        self._speech_slots = speech_slots or asyncio.Semaphore(parallel)
        self._order: asyncio.Queue[_Phrase | None] = asyncio.Queue()
        self._started: list[_Phrase] = []
        self._started_chars = 0
        self._count = 0
        self._ended = False

    @property
    def buffered(self) -> int:
        return self._chunker.buffered + self._started_chars

    @property
    def in_progress(self) -> bool:
        return self._started_chars > 0

    async def push(self, text: str) -> None:
        self._start(await push_async(self._chunker, text))

    async def flush(self) -> None:
        self._start(self._chunker.flush())

    async def end_input(self) -> None:
        if not self._ended:
            self._start(self._chunker.flush())
            self._ended = True
            self._order.put_nowait(None)

    def _start(self, texts: list[str]) -> None:
        for text in texts:
            phrase = _Phrase(text, continued=self._count > 0)
            self._count += 1
            phrase.task = asyncio.create_task(phrase.queue.produce(self._synthesise(phrase), "a streamed phrase"))
            self._started.append(phrase)
            self._started_chars += len(text)
            self._order.put_nowait(phrase)

    async def _synthesise(self, phrase: _Phrase) -> None:
        async with self._slots, self._speech_slots:
            audio = await self._phrases.open(phrase.text.strip(), continued=phrase.continued)
            if audio is not None:
                phrase.normalized = audio.normalized
                try:
                    async for data in audio:
                        for piece in pcm_pieces(data):
                            await phrase.queue.put(piece)
                finally:
                    await audio.aclose()

    async def chunks(self) -> AsyncIterator[SpeechChunk]:
        ms_per_weight: float | None = None
        while (phrase := await self._order.get()) is not None:
            spoken = aligned = None
            pending: bytes | None = None
            while (item := await phrase.queue.get()) is not None:
                if spoken is None or aligned is None:
                    # The spaces around a phrase belong to both alignments: clients join them into words.
                    lead = phrase.text[: len(phrase.text) - len(phrase.text.lstrip())]
                    trail = phrase.text[len(phrase.text.rstrip()) :]
                    rate = {} if ms_per_weight is None else {"ms_per_weight": ms_per_weight}
                    spoken = PhraseAligner(phrase.text, **rate)
                    aligned = PhraseAligner(lead + phrase.normalized + trail, **rate)
                if pending is not None:
                    yield SpeechChunk(pending, spoken, aligned, phrase_end=False)
                # One chunk is held back: only once the next one (or the end) has come is it
                # known whether it is the phrase's last, which takes the remaining characters.
                pending = item
            if pending is not None and spoken is not None and aligned is not None:
                yield SpeechChunk(pending, spoken, aligned, phrase_end=True)
                ms_per_weight = spoken.measured_ms_per_weight or ms_per_weight
            self._started.remove(phrase)
            self._started_chars -= len(phrase.text)

    async def aclose(self) -> None:
        tasks = [phrase.task for phrase in self._started if phrase.task is not None]
        self._started.clear()
        self._started_chars = 0
        for task in tasks:
            task.cancel()
        if tasks:
            # Not ``await task``: the caller's own cancellation meanwhile would pass for the task's and be lost.
            await asyncio.wait(tasks)
