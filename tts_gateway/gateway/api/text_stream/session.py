"""One text-streaming WebSocket: its contexts, their audio, its limits.

``stream-input`` has one context, whose id is never sent: ``{"text": ""}`` ends its input, and
the socket closes (1000) after the final message. ``multi-stream-input`` has up to
``max_contexts`` contexts named by ``context_id`` (a message without one goes to the context
named ``""``), each answered with its ``contextId``; ``{"text": ""}`` only keeps it alive.

``close_context`` after a ``flush`` (nothing sent since) lets the flushed text finish speaking,
then ``isFinal`` follows: the end of a turn. Otherwise (text not flushed, a second
``close_context``, or ``"immediate": true``) it is an interruption: the context's Triton calls
are cancelled at once, nothing more of its audio is sent, and ``isFinal`` follows straight away.
Other contexts go on.

Limits: a context may hold ``max_buffered_chars`` characters received and not yet spoken, the
socket ``max_socket_buffered_chars`` over all its contexts, counted however the text is sent. A
message larger than one context may hold closes the socket before it is parsed; text that would
take a context over its limit is refused before it is processed: on ``stream-input`` the socket
closes, on ``multi-stream-input`` that context gets an ``error`` message and ``isFinal`` and the
others go on; over the socket's limit the socket closes. The contexts of one socket synthesise
with at most ``speech_slots`` of the speech service's slots at once, so a socket that reads slowly
(or never) holds no more than that.

Inactivity: the socket closes after ``inactivity_timeout`` seconds without text from the client,
unless a context still has text to speak and the client reads its audio.

Synthesis that fails (the speech service already tried another server, or its own once back) ends
the socket: the context gets an ``error`` message, never an ``isFinal`` that would pass off a turn
with audio missing as a whole one, and the socket closes with 1011 (1013 when the gateway is out
of capacity). A context is planned as it opens, its voice resolved once for all of its text; a
voice that can no longer be spoken then (deleted since the socket opened) fails it the same way.

Close codes: 1000 done; 1007 a message that is not valid JSON or not a valid message; 1008 a
limit or a bad parameter (reason says which); 1011 a gateway fault; 1013 too many sockets, or no
capacity left.
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

from tts_gateway.gateway.api.log_limits import RateLimitedLog, client_address
from tts_gateway.gateway.api.text_stream.messages import ClientMessage, StreamQuery
from tts_gateway.gateway.api.text_stream.metrics import TextStreamMetrics
from tts_gateway.gateway.errors import GatewayError, RateLimitError
from tts_gateway.gateway.speech.text_stream.output_format import ConvertedAudio, OutputFormat
from tts_gateway.gateway.speech.text_stream.phrase_chunker import DEFAULT_SCHEDULE, PhraseChunker
from tts_gateway.gateway.speech.text_stream.synthesis import SpeechChunk, TextStreamSynthesizer, VoiceChoice

logger = logging.getLogger(__name__)

NORMAL: Final = 1000
INVALID_PAYLOAD: Final = 1007
POLICY: Final = 1008
INTERNAL: Final = 1011
TRY_LATER: Final = 1013
# A close frame's reason is at most 123 bytes.
_MAX_REASON_BYTES: Final = 123
# How long closing may wait for a client that reads nothing: its socket is given up after it.
_CLOSE_TIMEOUT: Final = 5.0
# Room in a message for its fields other than ``text``.
_MESSAGE_OVERHEAD_CHARS: Final = 16_384
# JSON may write a character as six (``\\uXXXX``).
_JSON_CHARS_PER_CHAR: Final = 6

_closes_log = RateLimitedLog(logger)


@dataclass(frozen=True)
class TextStreamLimits:
    max_sockets: int = 64
    """Sockets open at once in this worker; the next is closed with 1013."""
    max_contexts: int = 5
    """Contexts open at once on one socket (ElevenLabs' limit)."""
    max_buffered_chars: int = 20_000
    """Text received by one context and not yet spoken."""
    max_socket_buffered_chars: int = 40_000
    """Text received by all the contexts of one socket and not yet spoken."""
    speech_slots: int = 2
    """Speech slots the contexts of one socket hold at once."""

    @property
    def max_message_chars(self) -> int:
        """The longest message: one that carries the most text a context may hold, every character escaped."""
        return self.max_buffered_chars * _JSON_CHARS_PER_CHAR + _MESSAGE_OVERHEAD_CHARS


class SocketClosed(Exception):
    """The session must end: ``code`` and ``reason`` go in the close frame; ``ids``, the ``contextId`` of
    the context it is about, in the error message before it."""

    def __init__(self, code: int, reason: str, ids: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.ids = ids or {}


SynthesizerFactory = Callable[[VoiceChoice, PhraseChunker, asyncio.Semaphore], TextStreamSynthesizer]
"""A context's synthesizer: its voice, its chunker, and the socket's share of the speech slots. Raises
:class:`GatewayError` when the voice cannot be spoken."""


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
        self._sending_since: float | None = None
        self._last_activity = time.monotonic()
        self._speech_slots = asyncio.Semaphore(limits.speech_slots)
        self._done = asyncio.Event()
        self._failure: SocketClosed | None = None

    async def run(self) -> None:
        """Serve the (accepted) socket until it ends; never raises for anything the client does."""
        code, reason, ids = NORMAL, "", {}
        receiver = asyncio.create_task(self._receive())
        finished = asyncio.create_task(self._done.wait())
        try:
            await asyncio.wait({receiver, finished}, return_when=asyncio.FIRST_COMPLETED)
            if self._failure is not None:
                code, reason, ids = self._failure.code, self._failure.reason, self._failure.ids
            elif receiver.done() and not receiver.cancelled():
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

    def _end(self, code: int, reason: str, ids: dict[str, str] | None = None) -> None:
        """End the session from one of its tasks (the first reason given wins)."""
        if self._failure is None:
            self._failure = SocketClosed(code, reason, ids)
        self._done.set()

    # -- input -------------------------------------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            raw = await self._next_message()
            if len(raw) > self._limits.max_message_chars:
                raise SocketClosed(POLICY, f"message too large: over {self._limits.max_message_chars} characters")
            try:
                data = json.loads(raw)
                if not isinstance(data, dict):
                    raise ValueError("a message is a JSON object")
                message = ClientMessage.model_validate(data)
            except (ValueError, ValidationError) as exc:
                raise SocketClosed(INVALID_PAYLOAD, f"invalid message: {_first_line(exc)}") from None
            await self._handle(message)

    async def _next_message(self) -> str:
        """The next text frame; closes the socket after ``inactivity_timeout`` seconds without
        activity: text received, audio sent, or a context with text still to speak to a client that
        reads."""
        timeout = self._query.inactivity_timeout
        while True:
            remaining = self._last_activity + timeout - time.monotonic()
            try:
                async with asyncio.timeout(max(remaining, 0.0)):
                    raw = await self._ws.receive_text()
            except TimeoutError:
                now = time.monotonic()
                if now - self._last_activity < timeout:
                    continue  # audio went out meanwhile
                if self._sending_since is not None and now - self._sending_since >= timeout:
                    raise SocketClosed(POLICY, f"inactivity timeout: no audio read for {timeout} s") from None
                if self._speaking():
                    self._last_activity = now
                    continue
                raise SocketClosed(POLICY, f"inactivity timeout: no text for {timeout} s") from None
            except KeyError:
                raise SocketClosed(INVALID_PAYLOAD, "invalid message: send JSON as text frames") from None
            self._last_activity = time.monotonic()
            return raw

    def _speaking(self) -> bool:
        """Some context has text in synthesis or audio to send (waiting for a server included)."""
        return any(context.closing or context.synthesizer.in_progress for context in self._contexts.values())

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
        if text and len(text) > self._limits.max_buffered_chars:
            raise SocketClosed(POLICY, f"message too large: over {self._limits.max_buffered_chars} characters of text")
        if context is None:
            if not text:
                return  # a keepalive or a flush of a context never opened: nothing to open
            context = await self._open(context_id, message)
            if context is None:
                return
        if context.closing:
            return
        if text:
            if not await self._room_for(context, len(text)):
                return
            if text.strip():
                context.flushed = False
                if context.first_text_at is None:
                    context.first_text_at = time.monotonic()
            await context.synthesizer.push(text)
        if message.flush or (text == "" and not self._multi):
            await context.synthesizer.flush()
            context.flushed = True
        if text == "" and not self._multi:
            await self._close_context(context, graceful=True)

    async def _room_for(self, context: _Context, chars: int) -> bool:
        """Whether ``context`` may take ``chars`` more characters; refuses it (or the socket) otherwise."""
        limit = self._limits.max_socket_buffered_chars
        if sum(c.synthesizer.buffered for c in self._contexts.values()) + chars > limit:
            raise SocketClosed(POLICY, f"buffered text limit: over {limit} characters not yet spoken on this socket")
        limit = self._limits.max_buffered_chars
        if context.synthesizer.buffered + chars <= limit:
            return True
        reason = f"buffered text limit: over {limit} characters not yet spoken"
        if not self._multi:
            raise SocketClosed(POLICY, reason)
        # Only this context is refused: the socket's other contexts go on.
        self._metrics.closes.labels(_label(reason)).inc()
        await self._discard(context)
        await self._send({"error": reason, "message": reason, "code": POLICY, **self._ids(context)})
        await self._send_final(context)
        return False

    async def _open(self, context_id: str, message: ClientMessage) -> _Context | None:
        """The context, planned for all of its text; ``None`` if its voice cannot be spoken now (the socket
        then ends as if its synthesis had failed)."""
        ids = {"contextId": context_id} if self._multi else {}
        if len(self._contexts) >= self._limits.max_contexts:
            limit = f"context limit: at most {self._limits.max_contexts} contexts at once"
            raise SocketClosed(POLICY, limit, ids)
        voice = self._voice
        if message.voice_settings is not None and message.voice_settings.speed is not None:
            voice = VoiceChoice(voice.voice, voice.model, message.voice_settings.speed, voice.normalize)
        schedule: tuple[int, ...] = DEFAULT_SCHEDULE
        if message.generation_config is not None and message.generation_config.chunk_length_schedule:
            schedule = tuple(message.generation_config.chunk_length_schedule)
        chunker = PhraseChunker(schedule, auto_mode=self._query.auto_mode)
        try:
            synthesizer = self._synthesizers(voice, chunker, self._speech_slots)
        except GatewayError as exc:
            # Checked when the socket opened, the voice (or its model) has gone since.
            await self._fail(ids, exc)
            return None
        context = _Context(context_id, synthesizer)
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
                await self._send(self._audio_message(context, audio, chunk))
            if tail := await converter.finish():
                # A compressed format's last frames: audio that the messages before already aligned.
                await self._send({"audio": base64.b64encode(tail).decode(), "isFinal": False, **self._ids(context)})
        except GatewayError as exc:
            await self._fail(self._ids(context), exc)
            return
        except Exception:
            # A fault of the gateway's own ends the socket as a failed synthesis does: a context left
            # registered and unfinished would keep the socket from ever going idle.
            logger.exception("text stream context failed")
            await self._fail(self._ids(context), GatewayError("internal error", code="internal_error"))
            return
        finally:
            # An interrupted context's codec goes now, not with Python's next full garbage collection.
            converter.close()
        if self._contexts.get(context.id) is context:
            del self._contexts[context.id]
            self._metrics.contexts.dec()
        await context.synthesizer.aclose()
        await self._send_final(context)

    async def _fail(self, ids: dict[str, str], error: GatewayError) -> None:
        """A context's synthesis failed for good: its error (``ids`` name the context), then the socket
        closes (no ``isFinal``)."""
        logger.warning("text stream context failed: %s (%s)", error.message, error.code)
        self._metrics.failed.labels(error.code or "synthesis_failed").inc()
        await self._send({"error": error.code or "synthesis_failed", "message": error.message, **ids})
        code = TRY_LATER if isinstance(error, RateLimitError) else INTERNAL
        self._end(code, f"synthesis failed: {error.message.removeprefix('synthesis failed: ')}", ids)

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
        """Send a message; a client that has gone ends the session instead of failing the sender, and so
        does one that takes nothing for the inactivity timeout: the receiver, which checks that between
        messages, may itself be the one waiting here (an interruption's ``isFinal``)."""
        timeout = self._query.inactivity_timeout
        async with self._send_lock:
            self._sending_since = time.monotonic()
            try:
                async with asyncio.timeout(timeout):
                    await self._ws.send_text(json.dumps(payload, separators=(",", ":")))
            except TimeoutError:
                self._end(POLICY, f"inactivity timeout: no audio read for {timeout} s")
            except (WebSocketDisconnect, RuntimeError, OSError):
                self._done.set()
            finally:
                self._sending_since = None
            # Sent: the client reads (a send waits while the client's buffers are full).
            self._last_activity = time.monotonic()

    # -- ending ------------------------------------------------------------------------------------

    async def _discard(self, context: _Context) -> None:
        """Stop ``context`` at once: its forwarder, then its Triton calls."""
        if self._contexts.get(context.id) is context:
            del self._contexts[context.id]
            self._metrics.contexts.dec()
        if context.forwarder is not None and context.forwarder is not asyncio.current_task():
            context.forwarder.cancel()
            # Not ``await``: the caller's own cancellation meanwhile (the session ending) would be taken for the
            # forwarder's and lost, and the receiver would go on reading after the session's end.
            await asyncio.wait({context.forwarder})
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
    (LiveKit's plugin drops an error without one), and logged (rate-limited: clients cause it).

    A client that reads nothing cannot take the close frame: it is given up after a few seconds.
    """
    if websocket.client_state != WebSocketState.CONNECTED:
        return
    reason = reason or "done"
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError, TimeoutError):
        async with asyncio.timeout(_CLOSE_TIMEOUT):
            if code != NORMAL:
                metrics.closes.labels(_label(reason)).inc()
                where = client_address(websocket.scope.get("client"))
                _closes_log.log(logging.INFO, "text stream from %s closed with %d: %s", where, code, reason)
                await websocket.send_text(json.dumps({"error": reason, "message": reason, "code": code, **(ids or {})}))
            await websocket.close(code, reason.encode()[:_MAX_REASON_BYTES].decode(errors="ignore"))


def _label(reason: str) -> str:
    """The reason's first words, which name the limit or check: a bounded metric label."""
    return reason.split(":")[0][:40]


def _first_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        return f"{where}: {error['msg']}" if where else str(error["msg"])
    return str(exc).splitlines()[0]
