"""TextStreamSession in process, over a socket whose client sends and then reads nothing: the session
gives it up after its inactivity timeout, whichever of its tasks waits to send."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from starlette.websockets import WebSocket, WebSocketState

from tts_gateway.gateway.api.text_stream.messages import StreamQuery
from tts_gateway.gateway.api.text_stream.metrics import TextStreamMetrics
from tts_gateway.gateway.api.text_stream.session import SynthesizerFactory, TextStreamLimits, TextStreamSession
from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.speech.text_stream.output_format import AudioConverter, OutputFormat
from tts_gateway.gateway.speech.text_stream.synthesis import PhrasePipeline, SpeechChunk, VoiceChoice

VOICE = VoiceChoice("joe", "piper")


class Phrase:
    normalized = "x"

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"\x00\x00" * 2400

    async def aclose(self) -> None:
        pass


class Phrases:
    async def open(self, text: str, *, continued: bool = False) -> Phrase:
        return Phrase()


class UnreadSocket:
    """The server's side of a socket whose client has sent ``messages`` and reads nothing: each send waits
    for good (its buffers are full), and nothing more comes in."""

    client_state = WebSocketState.CONNECTED

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.scope: dict[str, Any] = {"client": ("127.0.0.1", 50000)}
        self.messages: asyncio.Queue[str] = asyncio.Queue()
        for message in messages:
            self.messages.put_nowait(json.dumps(message))

    async def receive_text(self) -> str:
        return await self.messages.get()

    async def send_text(self, data: str) -> None:
        await asyncio.Event().wait()

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        pass


def multi_stream_session(
    socket: UnreadSocket,
    synthesizers: SynthesizerFactory,
    metrics: GatewayMetrics,
    *,
    inactivity_timeout: int,
    voice: VoiceChoice = VOICE,
    output_format: str = "pcm_24000",
) -> TextStreamSession:
    return TextStreamSession(
        cast(WebSocket, socket),
        StreamQuery(inactivity_timeout=inactivity_timeout),
        OutputFormat.parse(output_format, socket=True),
        multi=True,
        voice=voice,
        synthesizers=synthesizers,
        limits=TextStreamLimits(),
        metrics=TextStreamMetrics(metrics),
    )


async def test_a_client_that_reads_nothing_is_given_up_while_the_receiver_waits_to_answer_it() -> None:
    # The interruption's isFinal is sent by the receiver, which thus waits on the client instead of
    # watching the inactivity timeout between messages.
    socket = UnreadSocket(
        [
            {"text": "A sentence to speak. ", "context_id": "a", "flush": True},
            {"context_id": "a", "close_context": True, "immediate": True},
        ]
    )
    metrics = GatewayMetrics()
    session = multi_stream_session(
        socket,
        lambda voice, chunker, slots: PhrasePipeline(Phrases(), chunker, speech_slots=slots),
        metrics,
        inactivity_timeout=1,
    )
    # Well past the timeout and the close's own wait for a client that reads nothing.
    await asyncio.wait_for(session.run(), 30)
    closes = metrics.registry.get_sample_value("tts_ws_closes_total", {"reason": "inactivity timeout"})
    assert closes == 1


class FaultySynthesizer:
    """A context's synthesis that fails with an error of the gateway's own (not a :class:`GatewayError`)."""

    buffered = 0
    in_progress = False

    async def push(self, text: str) -> None:
        pass

    async def flush(self) -> None:
        pass

    async def end_input(self) -> None:
        pass

    async def chunks(self) -> AsyncIterator[SpeechChunk]:
        raise RuntimeError("a fault of the gateway's own")
        yield

    async def aclose(self) -> None:
        pass


class RecordingSocket(UnreadSocket):
    """A client that reads everything: what it was sent, and how it was closed."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        super().__init__(messages)
        self.sent: list[dict[str, Any]] = []
        self.closed: tuple[int, str | None] | None = None
        self.audio_sent = asyncio.Event()

    async def send_text(self, data: str) -> None:
        self.sent.append(json.loads(data))
        if self.sent[-1].get("audio"):
            self.audio_sent.set()

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.closed = (code, reason)
        self.client_state = WebSocketState.DISCONNECTED


async def test_an_unexpected_fault_in_a_context_fails_the_socket_instead_of_leaving_it_open() -> None:
    socket = RecordingSocket([{"text": "A sentence to speak. ", "context_id": "a", "flush": True}])
    session = multi_stream_session(
        socket, lambda voice, chunker, slots: FaultySynthesizer(), GatewayMetrics(), inactivity_timeout=20
    )
    # Well under the inactivity timeout: the fault, not the idle socket, ends the session.
    await asyncio.wait_for(session.run(), 10)
    assert socket.closed is not None and socket.closed[0] == 1011
    assert {"error": "internal_error", "message": "internal error", "contextId": "a"} in socket.sent
    assert not any(message.get("isFinal") for message in socket.sent)


class EndlessPhrase(Phrase):
    """A phrase whose audio keeps coming until the context is interrupted."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            yield b"\x00\x00" * 2400
            await asyncio.sleep(0.01)


class EndlessPhrases:
    async def open(self, text: str, *, continued: bool = False) -> EndlessPhrase:
        return EndlessPhrase()


async def test_an_interrupted_context_lets_go_of_its_encoder_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[AudioConverter] = []
    any_closed = asyncio.Event()
    close = AudioConverter.close

    def recorded(converter: AudioConverter) -> None:
        close(converter)
        closed.append(converter)
        any_closed.set()

    monkeypatch.setattr(AudioConverter, "close", recorded)
    socket = RecordingSocket([{"text": "A sentence to speak. ", "context_id": "a", "flush": True}])
    session = multi_stream_session(
        socket,
        lambda voice, chunker, slots: PhrasePipeline(EndlessPhrases(), chunker, speech_slots=slots),
        GatewayMetrics(),
        inactivity_timeout=20,
        output_format="mp3_44100_128",
    )
    running = asyncio.create_task(session.run())
    await asyncio.wait_for(socket.audio_sent.wait(), 10)
    assert closed == []
    socket.messages.put_nowait(json.dumps({"context_id": "a", "close_context": True, "immediate": True}))
    await asyncio.wait_for(any_closed.wait(), 10)
    # The interrupted context's mp3 encoder is closed: a codec freed now, not at the next full collection.
    (converter,) = closed
    with pytest.raises(RuntimeError, match="finished"):
        await converter.convert_async(b"\x00\x00" * 2400)
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
