"""A context's text streamed into one model session, for models with a text-streaming deployment.

Such a model (CosyVoice2's ``cosyvoice2_bistream``) keeps one session per context: one voice prompt
and one LLM context for all of its text, so the prosody runs on from phrase to phrase where
:class:`PhrasePipeline` starts every phrase afresh. Text goes to the session as soon as its words
are complete (a word with a digit or a symbol waits for the next word, so that numbers, money and
units are normalised with their neighbours), normalised as in a speech request, in the model and
voice of the context's :class:`ContextPlan`; the model decides when it has enough to speak, and its
audio goes out as it comes. Each piece waits until the model took the one before, and the words
that waited behind a piece in flight go together as the next one: a request per word outruns the
model under load. Nothing waits for more words: an idle model gets each word once it is complete.

The session opens with the context's first words, on the least busy Triton server serving the
deployment (:meth:`TritonPool.session`), and holds one of the speech service's admission slots for
its life (and one of its socket's share of them): a socket shares the limits of the speech requests.
A session's state lives in its server, so a server that fails ends it: the context fails.

Alignment: the audio is laid over the characters sent so far at the estimated speaking rate, never
past what was sent (:meth:`PhraseAligner.extend`). Once the text is complete, the last chunk should
take the rest, so a chunk that comes then waits a moment (``_END_WAIT_S``) for the session's audio to
be complete, which the reader marks as soon as the model's stream ends, right after its last chunk.
Only a moment: waiting for the next chunk instead held every chunk after the text's end back by a
chunk (at 64 sockets, whose text had all arrived before their first audio, first audio came 435 ms
late at p50) and could starve a listener between chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Final

from tts_gateway.gateway.errors import ServerUnavailableError
from tts_gateway.gateway.speech.admission import AdmissionControl
from tts_gateway.gateway.speech.audio_encoding import OUTPUT_SAMPLE_RATE, create_encoder
from tts_gateway.gateway.speech.audio_queue import AudioQueue
from tts_gateway.gateway.speech.plan import ContextPlan
from tts_gateway.gateway.speech.text_stream.alignment import PhraseAligner
from tts_gateway.gateway.speech.text_stream.phrase_chunker import PhraseChunker, push_async
from tts_gateway.gateway.speech.text_stream.session_times import SessionTimes
from tts_gateway.gateway.speech.text_stream.synthesis import SpeechChunk
from tts_gateway.gateway.triton.pool import TritonPool
from tts_gateway.gateway.triton.text_stream_call import TextStreamCall
from tts_gateway.models.stage_trace import StageTrace


class TextStreamCalls:
    """Text-streaming sessions over the gateway's services: the planner's normalisation, the pool, admission;
    ``trace`` records when each session reached its first steps (:mod:`.session_times`)."""

    def __init__(
        self,
        normalize: Callable[[ContextPlan, str], Awaitable[str]],
        pool: TritonPool,
        admission: AdmissionControl,
        trace: StageTrace | None = None,
    ) -> None:
        self._normalize = normalize
        self._pool = pool
        self._admission = admission
        self.trace = trace or StageTrace("gateway", None)

    def serves(self, context: ContextPlan) -> bool:
        """``context``'s model has a text-streaming deployment, and speaks at the speed asked (these
        sessions do not change tempo; the speech service time-stretches phrases)."""
        return context.speed == 1.0 and context.model.text_stream_model is not None

    async def normalized(self, context: ContextPlan, text: str) -> str:
        """``text`` as ``context``'s model reads it."""
        return await self._normalize(context, text)

    @contextlib.asynccontextmanager
    async def open(self, context: ContextPlan) -> AsyncIterator[TextStreamCall]:
        """A session in ``context``'s model and voice, holding an admission slot; cancelled on leaving."""
        model = context.model.text_stream_model
        if model is None:
            raise ServerUnavailableError(f"model {context.model.id!r} has no text-streaming deployment now")
        slot = await self._admission.acquire()
        try:
            async with self._pool.session(model) as client:
                session_id = f"text-stream-{uuid.uuid4().hex}"
                session = await TextStreamCall.open(client, model, session_id, context.voice_inputs())
                try:
                    yield session
                finally:
                    await session.cancel()
        finally:
            slot.release()


# A session's end may come as one long chunk (the rest of the text spoken at once): sent in pieces
# of at most a second, it stays within clients' message limits (1 MiB in ``websockets``) and each
# piece gets its own alignment.
_MAX_CHUNK_BYTES: Final = OUTPUT_SAMPLE_RATE * 2
# How long a chunk that came after the text's end waits for the session's audio to be complete, to know
# whether it is the last (see the module's doc): the model ends its stream right after the last chunk, so
# the mark comes within a few turns of the event loop; a chunk that more audio follows loses this much.
_END_WAIT_S: Final = 0.02


class _AudioComplete:
    """Marks, in the session's audio, that the model's stream has ended: no chunk follows."""


_COMPLETE: Final = _AudioComplete()


class StreamedTextSynthesis:
    """A :class:`TextStreamSynthesizer` over one :class:`TextStreamCall` (see the module's docstring)."""

    def __init__(
        self,
        sessions: TextStreamCalls,
        context: ContextPlan,
        chunker: PhraseChunker,
        speech_slots: asyncio.Semaphore,
    ) -> None:
        """``speech_slots``: the socket's share of the speech slots, shared by its contexts."""
        self._sessions = sessions
        self._context = context
        self._chunker = chunker
        self._speech_slots = speech_slots
        self._texts: asyncio.Queue[str | None] = asyncio.Queue()
        self._unsent = 0
        self._audio: AudioQueue[bytes | _AudioComplete] = AudioQueue()
        self._spoken = PhraseAligner("")
        self._normalized = PhraseAligner("")
        self._sender: asyncio.Task[None] | None = None
        self._ended = False
        self._times = SessionTimes()
        # The session's id and its opening request's, once it is open (the trace names it by them).
        self._traced: tuple[str, str] | None = None

    @property
    def buffered(self) -> int:
        return self._chunker.buffered + self._unsent + self._spoken.pending

    @property
    def in_progress(self) -> bool:
        # Text sent may wait in the model for more: only text not yet sent is certain to be in progress.
        return self._unsent > 0

    async def push(self, text: str) -> None:
        if text and not self._times.text_in:
            self._times.text_in = time.monotonic()
        self._send(await push_async(self._chunker, text) + self._chunker.take_words(keep_numbers_whole=True))

    async def flush(self) -> None:
        self._send(self._chunker.flush())

    async def end_input(self) -> None:
        if not self._ended:
            self._send(self._chunker.flush())
            self._ended = True
            self._texts.put_nowait(None)
            self._start()

    def _send(self, texts: list[str]) -> None:
        for text in texts:
            self._start()
            self._unsent += len(text)
            self._texts.put_nowait(text)

    def _start(self) -> None:
        if self._sender is None:
            work = self._audio.produce(self._run(), "a text-streaming session")
            self._sender = asyncio.create_task(work, name="text-stream-session")

    async def _run(self) -> None:
        """Opens the session with the first text, sends the rest as it comes (the texts that waited, joined
        into one piece), then waits for the audio's end (the end of the context's audio once this returns)."""
        async with contextlib.AsyncExitStack() as stack:
            session: TextStreamCall | None = None
            reader: asyncio.Task[None] | None = None
            input_done = False
            while not input_done:
                text, input_done = self._waiting(await self._texts.get())
                if not text:  # nothing to send: an empty piece, or the input's end alone
                    continue
                words = await self._sessions.normalized(self._context, text.strip())
                if session is None:
                    self._times.opening = time.monotonic()
                    await stack.enter_async_context(self._speech_slots)
                    session = await stack.enter_async_context(self._sessions.open(self._context))
                    self._times.opened = time.monotonic()
                    self._traced = session.session_id, session.opening_request_id
                    # The reader's failure goes to the context's reader at once; its end is this task's.
                    audio = self._read(session, self._context.model.sample_rate)
                    reader = asyncio.create_task(self._audio.produce(audio, "reading a session's audio", end=False))
                    stack.push_async_callback(_stop, reader)
                lead, trail = text[: len(text) - len(text.lstrip())], text[len(text.rstrip()) :]
                normalized = lead + words + trail
                self._unsent -= len(text)
                # Counted as sent before the model acknowledges it: its audio may come first.
                self._spoken.extend(text)
                self._normalized.extend(normalized)
                await session.send_text(normalized)
                if not self._times.first_taken:
                    self._times.first_taken = time.monotonic()
            if session is not None and reader is not None:
                await session.finish()
                await reader

    def _waiting(self, first: str | None) -> tuple[str, bool]:
        """``first`` and the texts queued behind it, joined (one piece for the model), and whether the
        input's end came among them."""
        texts: list[str] = []
        item = first
        while item is not None:
            texts.append(item)
            if self._texts.empty():
                return "".join(texts), False
            item = self._texts.get_nowait()
        return "".join(texts), True

    async def _read(self, session: TextStreamCall, sample_rate: int) -> None:
        encoder = create_encoder("pcm", sample_rate)
        async for chunk in session:
            if not self._times.first_audio:
                self._times.first_audio = time.monotonic()
            await self._put(encoder.encode(chunk))
        await self._put(encoder.finish())
        await self._audio.put(_COMPLETE)

    async def _put(self, pcm: bytes) -> None:
        for start in range(0, len(pcm), _MAX_CHUNK_BYTES):
            await self._audio.put(pcm[start : start + _MAX_CHUNK_BYTES])

    async def chunks(self) -> AsyncIterator[SpeechChunk]:
        async with contextlib.aclosing(self._chunks()) as chunks:
            async for chunk in chunks:
                if not self._times.first_out:
                    self._times.first_out = time.monotonic()
                yield chunk

    async def _chunks(self) -> AsyncGenerator[SpeechChunk, None]:
        pending: bytes | None = None
        sent = False
        while True:
            try:
                async with asyncio.timeout(None if pending is None else _END_WAIT_S):
                    item = await self._audio.get()
            except TimeoutError:
                # More audio is coming: this chunk is not the last, and goes now.
                assert pending is not None
                yield SpeechChunk(pending, self._spoken, self._normalized, phrase_end=False)
                pending = None
                continue
            if item is None:
                break
            if isinstance(item, _AudioComplete):
                if self._ended:
                    break
                # The model ended the session before the text's end: the session's task reports why.
                continue
            if pending is not None:
                yield SpeechChunk(pending, self._spoken, self._normalized, phrase_end=False)
                pending = None
            sent = True
            if self._ended:
                pending = item
            else:
                yield SpeechChunk(item, self._spoken, self._normalized, phrase_end=False)
        if sent:
            # The end: the characters not yet aligned, and the output converter's tail.
            yield SpeechChunk(pending or b"", self._spoken, self._normalized, phrase_end=True)
        if self._traced is not None:
            self._times.record(self._sessions.trace, *self._traced)
        if item is not None:
            # The context's audio ends with the session's task, which may still fail (closing the session).
            while await self._audio.get() is not None:
                pass

    async def aclose(self) -> None:
        if self._sender is not None:
            await _stop(self._sender)


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
