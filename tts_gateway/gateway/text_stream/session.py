"""One text-streaming WebSocket: its contexts, their audio, its limits.

``stream-input`` has one context, whose id is never sent: ``{"text": ""}`` ends its input, and
the socket closes (1000) after the final message. ``multi-stream-input`` has up to
``max_contexts`` contexts named by ``context_id`` (a message without one goes to the context
named ``""``), each answered with its ``contextId``; ``{"text": ""}`` only keeps it alive.

``close_context`` after a ``flush`` (nothing sent since) lets the flushed text finish speaking,
then ``isFinal`` follows: the end of a turn. Otherwise (text not flushed, a second
``close_context``, or ``"immediate": true``) it is an interruption: the context's backend calls
are cancelled at once, nothing more of its audio is sent, and ``isFinal`` follows straight away.
Other contexts go on.

Close codes: 1000 done; 1007 a message that is not valid JSON or not a valid message; 1008 a
limit or a bad parameter (reason says which); 1011 a gateway fault; 1013 too many sockets.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from tts_gateway.gateway.errors import GatewayError
from tts_gateway.gateway.text_stream.messages import ClientMessage, StreamQuery
from tts_gateway.gateway.text_stream.metrics import TextStreamMetrics
from tts_gateway.gateway.text_stream.output_format import ConvertedAudio, OutputFormat
from tts_gateway.gateway.text_stream.phrase_chunker import DEFAULT_SCHEDULE, PhraseChunker
from tts_gateway.gateway.text_stream.synthesis import SpeechChunk, TextStreamSynthesizer, VoiceChoice

logger = logging.getLogger(__name__)

NORMAL: Final = 1000
INVALID_PAYLOAD: Final = 1007
POLICY: Final = 1008
INTERNAL: Final = 1011
TRY_LATER: Final = 1013
# A close frame's reason is at most 123 bytes.
_MAX_REASON_BYTES: Final = 123


@dataclass(frozen=True)
class TextStreamLimits:
    max_sockets: int = 64
    """Sockets open at once in this worker; the next is closed with 1013."""
    max_contexts: int = 5
    """Contexts open at once on one socket (ElevenLabs' limit)."""
    max_buffered_chars: int = 20_000
    """Text received by one context and not yet spoken."""


class SocketClosed(Exception):
    """The session must end: ``code`` and ``reason`` go in the close frame; ``ids``, the ``contextId`` of
    the context it is about, in the error message before it."""

    def __init__(self, code: int, reason: str, ids: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.ids = ids or {}


SynthesizerFactory = Callable[[VoiceChoice, PhraseChunker], TextStreamSynthesizer]


@dataclass(eq=False)
class _Context:
    id: str
    synthesizer: TextStreamSynthesizer
    flushed: bool = False
    closing: bool = False
    first_text_at: float | None = None
    forwarder: asyncio.Task[None] | None = None
    sent_audio: bool = False


class TextStreamSession:
    def __init__(
        self,
        websocket: WebSocket,
        query: StreamQuery,
        output: OutputFormat,
        *,
        multi: bool,
        voice: VoiceChoice,
        synthesizers: SynthesizerFactory,
        limits: TextStreamLimits,
        metrics: TextStreamMetrics,
    ) -> None:
        self._ws = websocket
        self._query = query
        self._output = output
        self._multi = multi
        self._voice = voice
        self._synthesizers = synthesizers
        self._limits = limits
        self._metrics = metrics
        self._contexts: dict[str, _Context] = {}
        self._send_lock = asyncio.Lock()
        self._last_activity = time.monotonic()
        self._done = asyncio.Event()

    async def run(self) -> None:
        """Serve the (accepted) socket until it ends; never raises for anything the client does."""
        code, reason, ids = NORMAL, "", {}
        receiver = asyncio.create_task(self._receive())
        finished = asyncio.create_task(self._done.wait())
        try:
            await asyncio.wait({receiver, finished}, return_when=asyncio.FIRST_COMPLETED)
            if receiver.done() and not receiver.cancelled():
                error = receiver.exception()
                if isinstance(error, SocketClosed):
                    code, reason, ids = error.code, error.reason, error.ids
                elif error is not None and not isinstance(error, WebSocketDisconnect):
                    logger.error("text stream failed", exc_info=error)
                    code, reason = INTERNAL, "internal error"
        finally:
            for task in (receiver, finished):
                task.cancel()
            await self._stop_all()
        await self.close(code, reason, ids)

    async def close(self, code: int, reason: str, ids: dict[str, str] | None = None) -> None:
        async with self._send_lock:
            await close_socket(self._ws, code, reason, self._metrics, ids)

    # -- input -------------------------------------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            raw = await self._next_message()
            try:
                data = json.loads(raw)
                if not isinstance(data, dict):
                    raise ValueError("a message is a JSON object")
                message = ClientMessage.model_validate(data)
            except (ValueError, ValidationError) as exc:
                raise SocketClosed(INVALID_PAYLOAD, f"invalid message: {_first_line(exc)}") from None
            await self._handle(message)

    async def _next_message(self) -> str:
        """The next text frame; closes the socket after ``inactivity_timeout`` seconds without input
        while no context is speaking."""
        timeout = self._query.inactivity_timeout
        while True:
            remaining = self._last_activity + timeout - time.monotonic()
            try:
                async with asyncio.timeout(max(remaining, 0.0)):
                    raw = await self._ws.receive_text()
            except TimeoutError:
                if self._speaking():
                    self._last_activity = time.monotonic()
                    continue
                raise SocketClosed(POLICY, f"inactivity timeout: no text for {timeout} s") from None
            except KeyError:
                raise SocketClosed(INVALID_PAYLOAD, "invalid message: send JSON as text frames") from None
            self._last_activity = time.monotonic()
            return raw

    def _speaking(self) -> bool:
        """Some context has all its text and is still sending audio (which counts as activity)."""
        return any(context.closing for context in self._contexts.values())

    async def _handle(self, message: ClientMessage) -> None:
        if message.close_socket:
            for open_context in list(self._contexts.values()):
                await self._close_context(open_context, graceful=True)
            await self._wait_all()
            self._done.set()
            return
        context_id = (message.context_id or "") if self._multi else ""
        context = self._contexts.get(context_id)
        if message.close_context:
            if context is not None:
                graceful = context.flushed and not context.closing and not message.immediate
                await self._close_context(context, graceful=graceful)
            return
        text = message.text
        if context is None:
            if not text:
                return  # a keepalive or a flush of a context never opened: nothing to open
            context = self._open(context_id, message)
        if context.closing:
            return
        if text:
            if text.strip():
                context.flushed = False
                if context.first_text_at is None:
                    context.first_text_at = time.monotonic()
            await context.synthesizer.push(text)
            if context.synthesizer.buffered > self._limits.max_buffered_chars:
                raise SocketClosed(
                    POLICY,
                    f"buffered text limit: over {self._limits.max_buffered_chars} characters not yet spoken",
                    self._ids(context),
                )
        if message.flush or (text == "" and not self._multi):
            await context.synthesizer.flush()
            context.flushed = True
        if text == "" and not self._multi:
            await self._close_context(context, graceful=True)

    def _open(self, context_id: str, message: ClientMessage) -> _Context:
        if len(self._contexts) >= self._limits.max_contexts:
            limit = f"context limit: at most {self._limits.max_contexts} contexts at once"
            raise SocketClosed(POLICY, limit, {"contextId": context_id} if self._multi else {})
        voice = self._voice
        if message.voice_settings is not None and message.voice_settings.speed is not None:
            voice = VoiceChoice(voice.voice, voice.model, message.voice_settings.speed, voice.normalize)
        schedule: tuple[int, ...] = DEFAULT_SCHEDULE
        if message.generation_config is not None and message.generation_config.chunk_length_schedule:
            schedule = tuple(message.generation_config.chunk_length_schedule)
        chunker = PhraseChunker(schedule, auto_mode=self._query.auto_mode)
        context = _Context(context_id, self._synthesizers(voice, chunker))
        context.forwarder = asyncio.create_task(self._forward(context))
        self._contexts[context_id] = context
        self._metrics.contexts.inc()
        return context

    async def _close_context(self, context: _Context, *, graceful: bool) -> None:
        if graceful:
            context.closing = True
            await context.synthesizer.end_input()
            return
        # An interruption: nothing more of this context is sent.
        self._metrics.interrupted.inc()
        await self._discard(context)
        await self._send_final(context)

    # -- output ------------------------------------------------------------------------------------

    async def _forward(self, context: _Context) -> None:
        converter = self._output.converter()
        try:
            async for chunk in context.synthesizer.chunks():
                audio = await converter.convert_async(chunk.pcm, last=chunk.phrase_end)
                if not context.sent_audio and context.first_text_at is not None:
                    self._metrics.first_audio.observe(time.monotonic() - context.first_text_at)
                context.sent_audio = True
                self._last_activity = time.monotonic()
                await self._send(self._audio_message(context, audio, chunk))
            if tail := await converter.finish():
                # A compressed format's last frames: audio that the messages before already aligned.
                await self._send({"audio": base64.b64encode(tail).decode(), "isFinal": False, **self._ids(context)})
        except GatewayError as exc:
            logger.warning("text stream context failed: %s (%s)", exc.message, exc.code)
            await self._send({"error": exc.code or "synthesis_failed", "message": exc.message, **self._ids(context)})
        if self._contexts.get(context.id) is context:
            del self._contexts[context.id]
            self._metrics.contexts.dec()
        await context.synthesizer.aclose()
        await self._send_final(context)

    def _audio_message(self, context: _Context, audio: ConvertedAudio, chunk: SpeechChunk) -> dict[str, Any]:
        spoken, normalized = chunk.align(audio.duration_ms)
        return {
            "audio": base64.b64encode(audio.data).decode(),
            "isFinal": False,
            "alignment": spoken.to_json(),
            "normalizedAlignment": normalized.to_json(),
            **self._ids(context),
        }

    def _ids(self, context: _Context) -> dict[str, str]:
        return {"contextId": context.id} if self._multi else {}

    async def _send_final(self, context: _Context) -> None:
        await self._send({"isFinal": True, **self._ids(context)})
        if not self._multi:
            self._done.set()

    async def _send(self, payload: dict[str, Any]) -> None:
        """Send a message; a client that has gone ends the session instead of failing the sender."""
        async with self._send_lock:
            try:
                await self._ws.send_text(json.dumps(payload, separators=(",", ":")))
            except (WebSocketDisconnect, RuntimeError, OSError):
                self._done.set()

    # -- ending ------------------------------------------------------------------------------------

    async def _discard(self, context: _Context) -> None:
        """Stop ``context`` at once: its forwarder, then its backend calls."""
        if self._contexts.get(context.id) is context:
            del self._contexts[context.id]
            self._metrics.contexts.dec()
        if context.forwarder is not None and context.forwarder is not asyncio.current_task():
            context.forwarder.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await context.forwarder
        await context.synthesizer.aclose()

    async def _wait_all(self) -> None:
        tasks = [c.forwarder for c in self._contexts.values() if c.forwarder is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stop_all(self) -> None:
        for context in list(self._contexts.values()):
            await self._discard(context)


async def close_socket(
    websocket: WebSocket, code: int, reason: str, metrics: TextStreamMetrics, ids: dict[str, str] | None = None
) -> None:
    """Close an accepted socket; an abnormal close is also told in an ``error`` message first
    (clients show messages, few show close reasons), with the ``contextId`` of a context it is about
    (LiveKit's plugin drops an error without one)."""
    if websocket.client_state != WebSocketState.CONNECTED:
        return
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        if code != NORMAL:
            # The reason's first words name the limit or check: a bounded label.
            metrics.closes.labels(reason.split(":")[0][:40]).inc()
            await websocket.send_text(json.dumps({"error": reason, "message": reason, "code": code, **(ids or {})}))
        await websocket.close(code, reason.encode()[:_MAX_REASON_BYTES].decode(errors="ignore"))


def _first_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        return f"{where}: {error['msg']}" if where else str(error["msg"])
    return str(exc).splitlines()[0]
