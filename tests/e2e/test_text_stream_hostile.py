"""The text-to-speech WebSocket against hostile clients, on a real gateway process in front of the
embedded CPU default (Piper): whatever one client sends, at whatever pace, the others are served.

A poller asks ``/health`` throughout the module and every poll must be answered (within a generous
bound: a stalled event loop, not a slow one, fails it). Each case checks the close code and reason;
the module ends by checking that a normal socket is still served and that the log holds no error
and no traceback, then that SIGTERM stops the gateway within its grace period with hostile sockets
open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from websockets.asyncio.client import ClientConnection

from tests.audio_checks import assert_speech, decode
from tests.e2e.gateway_process import GatewayProcess
from tests.e2e.test_text_stream_ws import SENTENCE, Received, close_reason, metric, receive_until, send, ws_url
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = pytest.mark.triton

KEY = "hostile-suite-key"
HEADERS = {"xi-api-key": KEY}
GRACE = 3
# Far more than any poll takes while the loop is free; a message that blocked the loop took 48 s.
POLL_BOUND = 10.0
CONTEXT_LIMIT = 20_000  # TTS_WS_MAX_BUFFERED_CHARS' default
SOCKET_LIMIT = 40_000  # TTS_WS_MAX_SOCKET_BUFFERED_CHARS' default
SENTENCES = "This is a sentence. "
MAX_SOCKETS = 8


class HealthPoller(threading.Thread):
    """Polls ``/health`` until stopped; keeps every poll that failed or was not answered in time."""

    def __init__(self, gateway: GatewayProcess) -> None:
        super().__init__(daemon=True)
        self.polls = 0
        self.failures: list[str] = []
        self._url = f"{gateway.url}/health"
        self._stopping = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=POLL_BOUND) as client:
            while not self._stopping.wait(0.2):
                try:
                    status = client.get(self._url).status_code
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                self.polls += 1
                if status != 200:
                    self.failures.append(f"status {status}")

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=POLL_BOUND + 5)


@pytest.fixture(scope="module")
def hostile_gateway(
    cpu_triton: EmbeddedTriton, voices_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    log = tmp_path_factory.mktemp("hostile") / "gateway.log"
    env = {
        "TTS_TRITON_URL": cpu_triton.grpc_url,
        "TTS_VOICES_DIR": str(voices_dir),
        "TTS_API_KEYS": KEY,
        "TTS_PUBLIC_ENDPOINTS": "/health,/metrics",
        "TTS_SHUTDOWN_GRACE": str(GRACE),
        "TTS_WS_MAX_SOCKETS": str(MAX_SOCKETS),
    }
    process = GatewayProcess(log, env)
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def health(hostile_gateway: GatewayProcess) -> Iterator[HealthPoller]:
    poller = HealthPoller(hostile_gateway)
    poller.start()
    yield poller
    poller.stop()


@pytest.fixture()
def gateway(hostile_gateway: GatewayProcess, health: HealthPoller) -> Iterator[GatewayProcess]:
    """The module's gateway, /health polled meanwhile: every poll of the test must be answered."""
    failures = len(health.failures)
    yield hostile_gateway
    assert health.failures[failures:] == []


def connect(gateway: GatewayProcess, **query: str) -> websockets.connect:
    multi = query.pop("multi", "true") == "true"
    # Every message read as it comes: a close frame is seen at once.
    return websockets.connect(
        ws_url(gateway, multi=multi, **query), additional_headers=HEADERS, max_size=None, max_queue=None
    )


async def test_a_message_larger_than_a_socket_may_buffer_is_refused_unread(gateway: GatewayProcess) -> None:
    for size in (100_000, 10_000_000):
        async with connect(gateway, multi="false") as ws:
            await send(ws, text=SENTENCES * (size // len(SENTENCES)))
            code, reason = await close_reason(ws)
        assert code == 1008
        assert reason.startswith("message too large"), reason


async def test_text_in_one_message_over_a_context_limit_is_refused(gateway: GatewayProcess) -> None:
    async with connect(gateway, multi="false") as ws:
        await send(ws, text="a " * (CONTEXT_LIMIT // 2 + 1))
        code, reason = await close_reason(ws)
    assert (code, reason) == (1008, f"message too large: over {CONTEXT_LIMIT} characters of text")


async def test_the_context_limit_holds_across_small_pieces(gateway: GatewayProcess) -> None:
    """Text sent in pieces counts until it is spoken: twice the limit in pieces of 23 characters is refused
    at the limit. (Pieces still in flight when the closing handshake ends would meet a closed socket, whose
    reset could overtake the close frame: the client sends no more than twice the limit.)"""
    async with connect(gateway, multi="false") as ws:
        with contextlib.suppress(websockets.ConnectionClosed):
            for _ in range(2 * CONTEXT_LIMIT // 23):
                await send(ws, text="Piece of text to speak ")
        code, reason = await close_reason(ws)
    assert (code, reason) == (1008, f"buffered text limit: over {CONTEXT_LIMIT} characters not yet spoken")


async def test_a_context_over_its_limit_is_refused_and_the_others_go_on(gateway: GatewayProcess) -> None:
    received = Received()
    async with connect(gateway, output_format="pcm_24000") as ws:
        await send(ws, text=" ", context_id="calm")
        await send(ws, text=" ", context_id="greedy")
        for _ in range(CONTEXT_LIMIT // 1000 + 1):
            await send(ws, text="word " * 200, context_id="greedy")
        await send(ws, text=SENTENCE, context_id="calm", flush=True)
        await send(ws, context_id="calm", close_context=True)
        await receive_until(ws, received, 2, rate=24_000)
        await send(ws, close_socket=True)
        code, _ = await close_reason(ws)
    assert code == 1000
    (error,) = received.errors
    assert error == {
        "error": f"buffered text limit: over {CONTEXT_LIMIT} characters not yet spoken",
        "message": f"buffered text limit: over {CONTEXT_LIMIT} characters not yet spoken",
        "code": 1008,
        "contextId": "greedy",
    }
    assert set(received.finals) == {"calm", "greedy"}
    assert received.chars["calm"].strip() == SENTENCE
    calm = received.speech("calm", rate=24_000)
    assert_speech(calm, expected_seconds=calm.duration)


async def test_the_socket_limit_holds_across_contexts(gateway: GatewayProcess) -> None:
    per_context = CONTEXT_LIMIT - 1000
    async with connect(gateway) as ws:
        for context in ("a", "b", "c"):
            await send(ws, text=" ", context_id=context)
            for _ in range(per_context // 1000):
                await send(ws, text="word " * 200, context_id=context)
        code, reason = await close_reason(ws)
    assert (code, reason) == (
        1008,
        f"buffered text limit: over {SOCKET_LIMIT} characters not yet spoken on this socket",
    )


async def test_a_phrase_too_long_for_one_request_is_spoken_in_parts(gateway: GatewayProcess) -> None:
    """5,000 characters of words without a sentence end, in one message, are spoken: no internal_error."""
    received = Received()
    text = " ".join(["words without an end"] * 250)
    async with connect(gateway) as ws:
        await send(ws, text=text, context_id="long", flush=True)
        while "long" not in received.audio:
            received.take(json.loads(await asyncio.wait_for(ws.recv(), 60)), 16_000)
        # A second close_context interrupts.
        await send(ws, context_id="long", close_context=True)
        await send(ws, context_id="long", close_context=True)
        await receive_until(ws, received, 1)
    assert received.errors == []
    assert text.startswith(received.chars["long"])


async def test_audio_still_being_sent_counts_as_activity(gateway: GatewayProcess) -> None:
    """With a 1 s inactivity timeout and no close_context, the socket stays open until all is spoken."""
    received = Received()
    text = " ".join(["The inactivity timeout waits while this audio is still on its way."] * 12)
    async with connect(gateway, inactivity_timeout="1") as ws:
        await send(ws, text=text, context_id="long", flush=True)
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                received.take(json.loads(await asyncio.wait_for(ws.recv(), 60)), 16_000)
        assert ws.close_code == 1008
        assert ws.close_reason == "inactivity timeout: no text for 1 s"
    assert received.chars["long"] == text
    assert received.errors[-1]["error"] == "inactivity timeout: no text for 1 s"


async def never_reading_socket(gateway: GatewayProcess, contexts: int = 5) -> ClientConnection:
    """A socket whose contexts all have much to say, and that never reads what it is sent (and whose
    kernel buffer is tiny, so that the gateway soon has to wait for it)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", gateway.port))
    url = ws_url(gateway, output_format="pcm_48000", inactivity_timeout="3")
    ws = await websockets.connect(url, sock=sock, additional_headers=HEADERS, max_queue=1)
    for index in range(contexts):
        await send(ws, text=" ".join([SENTENCE] * 40), context_id=f"c{index}", flush=True)
    return ws


async def test_a_socket_that_never_reads_holds_only_its_share_of_the_speech_slots(gateway: GatewayProcess) -> None:
    ws = await never_reading_socket(gateway)
    try:
        await asyncio.sleep(2)
        in_use = [await metric(gateway, "tts_speech_slots_in_use") for _ in range(5)]
        assert max(in_use) <= 2, in_use
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "tts-1", "voice": "alloy", "input": SENTENCE, "response_format": "wav"}
            response = await client.post(
                f"{gateway.url}/v1/audio/speech", json=body, headers={"Authorization": f"Bearer {KEY}"}
            )
        assert response.status_code == 200
        audio = decode(response.content, "wav")
        assert_speech(audio, expected_seconds=audio.duration)
        # Given up once it has read nothing for its inactivity timeout: its slots are free again.
        for _ in range(200):
            if await metric(gateway, "tts_ws_sockets_open") == 0:
                break
            await asyncio.sleep(0.1)
        assert await metric(gateway, "tts_ws_sockets_open") == 0
        assert await metric(gateway, "tts_speech_slots_in_use") == 0
    finally:
        ws.transport.abort()
    assert "inactivity timeout: no audio read for 3 s" in gateway.log_path.read_text()


async def test_a_text_frame_that_is_not_utf8_closes_with_1007_and_a_reason(gateway: GatewayProcess) -> None:
    async with connect(gateway) as ws:
        await ws.send(b'{"text": "\xff\xfe"}', text=True)
        code, reason = await close_reason(ws)
    assert (code, reason) == (1007, "invalid message: a text frame that is not UTF-8")


@pytest.mark.parametrize(
    ("frame", "code", "reason"),
    [
        (b"\x00binary", 1007, "invalid message: send JSON as text frames"),
        ("{not json", 1007, "invalid message: Expecting property name"),
        ("x" * 20_000_000, 1009, "frame exceeds limit"),
    ],
    ids=["binary", "not-json", "20MB"],
)
async def test_malformed_frames_close_with_their_reason(
    gateway: GatewayProcess, frame: str | bytes, code: int, reason: str
) -> None:
    async with connect(gateway) as ws:
        await ws.send(frame)
        closed = await close_reason(ws)
    assert closed[0] == code
    assert closed[1].startswith(reason), closed


async def test_a_sixth_context_closes_the_socket(gateway: GatewayProcess) -> None:
    async with connect(gateway) as ws:
        for index in range(6):
            await send(ws, text=" ", context_id=f"c{index}")
        closed = await close_reason(ws)
    assert closed == (1008, "context limit: at most 5 contexts at once")


async def test_sockets_beyond_the_limit_are_closed_with_1013(gateway: GatewayProcess) -> None:
    async with contextlib.AsyncExitStack() as stack:
        sockets = await asyncio.gather(*(stack.enter_async_context(connect(gateway)) for _ in range(3 * MAX_SOCKETS)))
        await asyncio.sleep(1)
        refused = [ws for ws in sockets if ws.close_code is not None]
        assert len(sockets) - len(refused) == MAX_SOCKETS
        assert {(ws.close_code, ws.close_reason) for ws in refused} == {
            (1013, f"socket limit: {MAX_SOCKETS} text streams are open")
        }


async def test_refused_handshakes_are_logged_once_as_warnings(gateway: GatewayProcess) -> None:
    for _ in range(3):
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(ws_url(gateway), additional_headers={"xi-api-key": "wrong"})
        assert refused.value.response.status_code == 401
    log = gateway.log_path.read_text()
    assert "WARNING" in log and "refused (401): incorrect API key provided" in log
    assert "ASGI callable returned without completing handshake" not in log


async def test_afterwards_a_normal_socket_is_served_and_the_log_is_clean(gateway: GatewayProcess) -> None:
    received = Received()
    async with connect(gateway, multi="false", output_format="pcm_24000") as ws:
        await send(ws, text=SENTENCE)
        await send(ws, text="")
        await receive_until(ws, received, 1, rate=24_000)
        code, _ = await close_reason(ws)
    assert code == 1000
    assert received.chars[None] == SENTENCE
    audio = received.speech(None, rate=24_000)
    assert_speech(audio, expected_seconds=audio.duration)
    log = gateway.log_path.read_text()
    assert " ERROR " not in log and "Traceback" not in log, log[-4000:]
    # Every close the gateway made carries its reason in the log, and in the close frame.
    assert "closed with 1008: " in log


def test_sigterm_stops_the_gateway_within_its_grace_period_whatever_the_sockets_do(
    hostile_gateway: GatewayProcess, health: HealthPoller
) -> None:
    async def hostile_sockets() -> None:
        stalled = await never_reading_socket(hostile_gateway, contexts=2)
        async with connect(hostile_gateway, multi="false") as busy:
            await send(busy, text=" ".join([SENTENCE] * 100), flush=True)
            await busy.recv()
            health.stop()
            hostile_gateway.send_signal(signal.SIGTERM)
            status = await asyncio.to_thread(hostile_gateway.wait, GRACE + 10)
            code, reason = await close_reason(busy)
        stalled.transport.abort()
        assert status == 0
        assert (code, reason) == (1012, "the gateway is shutting down")

    asyncio.run(hostile_sockets())
