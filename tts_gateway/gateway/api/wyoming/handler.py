"""One Wyoming connection: its events, what it says, its limits.

- ``describe`` is answered with ``info`` (:mod:`.voices`).
- ``synthesize`` is spoken: ``audio-start``, ``audio-chunk``\\ s as the model produces audio, ``audio-stop``,
  16-bit mono at the rate of the model that speaks it (the socket's ``pcm_<rate>`` conversion of the
  speech service's audio), or at the speech service's 24 kHz where that conversion has no such rate.
- ``synthesize-start`` opens a streamed request: each ``synthesize-chunk``'s text goes to the same phrase
  chunker and synthesis as the text-streaming WebSocket's, so speech starts while text still comes;
  ``synthesize-stop`` ends the text, and ``synthesize-stopped`` follows the request's ``audio-stop``.
  A plain ``synthesize`` inside a streamed request is Home Assistant's copy of the whole text for
  servers that do not stream: it is not spoken again.

Events are read while audio is sent, so a streamed request takes text while it speaks, and a client
that goes away (end of its stream) has its synthesis cancelled at once. Requests on one connection
are spoken one after the other, in order.

Every failure a client can cause or see (an unknown voice, a Triton server failure, a limit, an event out of
place) is answered with an ``error`` event, and then the connection is closed, as ``wyoming-piper``
does: a client waiting for ``audio-stop`` learns that none is coming.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Protocol, cast

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, Eventable, async_read_event
from wyoming.info import Describe, Info
from wyoming.ping import Ping, Pong
from wyoming.server import AsyncEventHandler
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

from tts_gateway.gateway.api.text_stream.session import SynthesizerFactory
from tts_gateway.gateway.errors import GatewayError
from tts_gateway.gateway.speech.audio_encoding import OUTPUT_SAMPLE_RATE
from tts_gateway.gateway.speech.request import clean_text
from tts_gateway.gateway.speech.text_stream.output_format import FORMATS, AudioConverter
from tts_gateway.gateway.speech.text_stream.phrase_chunker import PhraseChunker
from tts_gateway.gateway.speech.text_stream.synthesis import TextStreamSynthesizer, VoiceChoice

logger = logging.getLogger(__name__)

# The speech service's output rate: sent for a model whose own rate no ``pcm_<rate>`` format offers.
RATE: Final = OUTPUT_SAMPLE_RATE
WIDTH: Final = 2
CHANNELS: Final = 1
# wyoming-piper's default chunk (1024 samples): clients that play as they receive get small, even pieces.
_CHUNK_BYTES: Final = 1024 * WIDTH
# Room for an event's JSON around its text (voice, format, context).
_EVENT_OVERHEAD_BYTES: Final = 4096


@dataclass(frozen=True)
class WyomingLimits:
    max_connections: int = 16
    """Connections open at once (in this worker); the next is answered with an error and closed."""
    max_buffered_chars: int = 20_000
    """Text of one request received and not yet cut into phrases: a ``synthesize``'s whole text."""
    speech_slots: int = 2
    """Speech slots one connection's synthesis holds at once, as a WebSocket's contexts do."""
    idle_timeout: float = 60.0
    """Seconds without an event unless audio is on its way (while a streamed request's text is still
    coming, it counts), or without the client taking audio."""

    @property
    def max_event_bytes(self) -> int:
        """The largest data or payload part of an event: the text limit in UTF-8, and its JSON."""
        return 4 * self.max_buffered_chars + _EVENT_OVERHEAD_BYTES


class Voices(Protocol):
    def info(self) -> Info: ...

    async def choose(self, requested: SynthesizeVoice | None) -> VoiceChoice:
        """The voice a request means (checked when its synthesis is planned); raises :class:`GatewayError` if
        there is none."""
        ...

    def sample_rate(self, voice: VoiceChoice) -> int:
        """The rate of the model that speaks ``voice``."""
        ...


class WyomingFailure(Exception):
    """Ends the connection after an ``error`` event with ``text`` and ``code``."""

    def __init__(self, text: str, code: str) -> None:
        super().__init__(text)
        self.text = text
        self.code = code


class _BoundedReader:
    """The connection's reader for :func:`async_read_event`, refusing a part larger than ``limit`` bytes
    before reading it (the library reads whatever length an event header announces)."""

    def __init__(self, reader: asyncio.StreamReader, limit: int) -> None:
        self._reader = reader
        self._limit = limit
        self.refused = ""

    async def readline(self) -> bytes:
        try:
            return await self._reader.readline()
        except ValueError:
            self.refused = "event header too long"
            raise

    async def readexactly(self, size: int) -> bytes:
        if size > self._limit:
            self.refused = f"event part of {size} bytes, over the limit of {self._limit}"
            raise ValueError(self.refused)
        return await self._reader.readexactly(size)


@dataclass(eq=False)
class _Request:
    """One ``synthesize`` or streamed request: its synthesis, and the task sending its audio."""

    synthesizer: TextStreamSynthesizer
    streamed: bool
    audio: AudioConverter
    """The speech service's audio as 16-bit PCM at the rate this request's audio is sent at."""
    sender: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def speaking(self) -> bool:
        return self.sender is not None and not self.sender.done()


class WyomingHandler(AsyncEventHandler):
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        voices: Voices,
        synthesizers: SynthesizerFactory,
        limits: WyomingLimits,
        refusal: str = "",
        on_close: Callable[[WyomingHandler], None] = lambda handler: None,
        on_error: Callable[[str], None] = lambda code: None,
    ) -> None:
        """``refusal``: why the connection is refused (a limit); it is told so and closed."""
        super().__init__(reader, writer)
        self._events = _BoundedReader(reader, limits.max_event_bytes)
        self._voices = voices
        self._synthesizers = synthesizers
        self._limits = limits
        self._refusal = refusal
        self._on_close = on_close
        self._on_error = on_error
        self._speech_slots = asyncio.Semaphore(limits.speech_slots)
        self._request: _Request | None = None
        self._stream: _Request | None = None
        """The streamed request whose text is still coming (``synthesize-start`` to ``synthesize-stop``)."""

    async def run(self) -> None:
        """Read events until the client leaves or a failure ends the connection.

        Replaces the library's loop for what it lacks: a bound on an event's size, the idle timeout,
        and an ``error`` event before the gateway closes the connection.
        """
        reading: asyncio.Future[Event | None] | None = None
        try:
            if self._refusal:
                raise WyomingFailure(self._refusal, "too_many_connections")
            while True:
                # One read is kept across waits: cancelling it could cut an event in half.
                reading = reading or asyncio.ensure_future(async_read_event(cast(asyncio.StreamReader, self._events)))
                done, _ = await asyncio.wait({reading}, timeout=self._limits.idle_timeout)
                if not done:
                    if self._speaking():
                        continue
                    raise WyomingFailure(f"idle timeout: no event for {self._limits.idle_timeout:g} s", "idle_timeout")
                event, reading = reading.result(), None
                if event is None:
                    if self._events.refused:
                        raise WyomingFailure(self._events.refused, "event_too_large")
                    if not self.reader.at_eof():
                        raise WyomingFailure("an event that is not a JSON object line", "invalid_event")
                    break
                await self.handle_event(event)
        except WyomingFailure as failure:
            await self._send_error(failure.text, failure.code)
        except (ConnectionError, TimeoutError):
            pass  # the client has gone, or takes nothing
        except Exception:
            logger.exception("Wyoming connection failed")
            await self._send_error("internal error", "internal_error")
        finally:
            if reading is not None:
                reading.cancel()
            await self.disconnect()
            self.writer.close()
            self._on_close(self)

    def _speaking(self) -> bool:
        """Audio is on its way and the client owes no text: a silence from it is no idleness."""
        return self._request is not None and self._request.speaking and self._stream is None

    async def handle_event(self, event: Event) -> bool:
        """Handle one event; raises :class:`WyomingFailure` when the connection must end."""
        try:
            if Describe.is_type(event.type):
                await self._send(self._voices.info())
            elif Ping.is_type(event.type):
                await self._send(Pong(text=Ping.from_event(event).text))
            elif Synthesize.is_type(event.type):
                if self._stream is None:
                    synthesize = Synthesize.from_event(event)
                    await self._start(synthesize.voice, synthesize.text, streamed=False)
            elif SynthesizeStart.is_type(event.type):
                if self._stream is not None:
                    raise WyomingFailure("synthesize-start while a streamed request is open", "unexpected_event")
                self._stream = await self._start(SynthesizeStart.from_event(event).voice, "", streamed=True)
            elif SynthesizeChunk.is_type(event.type):
                await self._push(self._open_stream(event.type), SynthesizeChunk.from_event(event).text)
            elif SynthesizeStop.is_type(event.type):
                stream, self._stream = self._open_stream(event.type), None
                await stream.synthesizer.end_input()
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise WyomingFailure(f"invalid {event.type} event: {exc}", "invalid_event") from None
        return True

    def _open_stream(self, event_type: str) -> _Request:
        if self._stream is None:
            raise WyomingFailure(f"{event_type} outside a streamed request (send synthesize-start)", "unexpected_event")
        return self._stream

    async def _start(self, requested: SynthesizeVoice | None, text: str, *, streamed: bool) -> _Request:
        previous = self._request
        if previous is not None and previous.sender is not None:
            await previous.sender
        try:
            voice = await self._voices.choose(requested)
            # Planned here, for all of its text: a voice that cannot be spoken is refused now.
            synthesizer = self._synthesizers(voice, PhraseChunker(), self._speech_slots)
        except GatewayError as exc:
            raise WyomingFailure(exc.message, exc.code or "invalid_voice") from None
        fmt = FORMATS.get(f"pcm_{self._voices.sample_rate(voice)}", FORMATS[f"pcm_{RATE}"])
        request = _Request(synthesizer, streamed, fmt.converter())
        self._request = request
        request.sender = asyncio.create_task(self._send_audio(request), name="wyoming-audio")
        await self._push(request, text)
        if not streamed:
            await request.synthesizer.end_input()
        return request

    async def _push(self, request: _Request, text: str) -> None:
        if not text:
            return
        if request.synthesizer.buffered + len(text) > self._limits.max_buffered_chars:
            raise WyomingFailure(
                f"buffered text limit: over {self._limits.max_buffered_chars} characters not yet spoken", "text_limit"
            )
        await request.synthesizer.push(clean_text(text))

    async def _send_audio(self, request: _Request) -> None:
        """Send the request's audio as it comes; a failure is told, and ends the connection."""
        started = failed = False
        rate = request.audio.format.sample_rate
        try:
            async for chunk in request.synthesizer.chunks():
                pcm = (await request.audio.convert_async(chunk.pcm, last=chunk.phrase_end)).data
                for offset in range(0, len(pcm), _CHUNK_BYTES):
                    if not started:
                        await self._send(AudioStart(rate=rate, width=WIDTH, channels=CHANNELS))
                        started = True
                    piece = pcm[offset : offset + _CHUNK_BYTES]
                    await self._send(AudioChunk(rate=rate, width=WIDTH, channels=CHANNELS, audio=piece))
            if not started:
                await self._send(AudioStart(rate=rate, width=WIDTH, channels=CHANNELS))
            await self._send(AudioStop())
            if request.streamed:
                await self._send(SynthesizeStopped())
        except GatewayError as exc:
            logger.warning("Wyoming synthesis failed: %s (%s)", exc.message, exc.code)
            await self._send_error(exc.message, exc.code or "synthesis_failed")
            failed = True
        except (ConnectionError, TimeoutError):
            logger.info("Wyoming client stopped taking audio; synthesis cancelled")
            failed = True
        except Exception:
            # A fault of the gateway: the client is told, as the reading loop tells its own.
            logger.exception("Wyoming audio failed")
            await self._send_error("internal error", "internal_error")
            failed = True
        finally:
            await request.synthesizer.aclose()
        if failed:
            # Last: the reader's end of stream ends the connection, whose end finds this task done.
            await self.stop()

    async def _send(self, message: Eventable) -> None:
        """Write an event; a client that takes nothing for the idle timeout has gone (``TimeoutError``)."""
        async with asyncio.timeout(self._limits.idle_timeout):
            await self.write_event(message.event())

    async def _send_error(self, text: str, code: str) -> None:
        self._on_error(code)
        with contextlib.suppress(ConnectionError, TimeoutError):
            await self._send(Error(text=text, code=code))

    async def disconnect(self) -> None:
        """Cancel what is still being spoken: the client has gone, or the connection failed."""
        request, self._request = self._request, None
        if request is None or request.sender is None or request.sender is asyncio.current_task():
            return
        if request.speaking:
            logger.info("Wyoming connection closed while speaking; synthesis cancelled")
        request.sender.cancel()
        # Not ``await``: a failure of the sender would skip the connection's closing and its count.
        await asyncio.wait({request.sender})
