"""The ElevenLabs text-to-speech WebSocket, over real sockets (the ``websockets`` package), against a
real gateway process in front of the embedded CPU default (Piper): every message, the alignment,
interruption, limits, bad input, auth, and what the voice says."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection

from tests.audio_checks import DecodedAudio
from tests.e2e.gateway_process import GatewayProcess
from tests.speech_recognition import transcribe, which_was_said
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = pytest.mark.triton

SENTENCE = "The quick brown fox jumps over the lazy dog."
KEY = "text-stream-key"


def ws_url(gateway: GatewayProcess, *, multi: bool = True, voice: str = "joe", **query: str) -> str:
    path = "multi-stream-input" if multi else "stream-input"
    params = {"model_id": "eleven_flash_v2_5", "output_format": "pcm_16000", **query}
    return f"ws://127.0.0.1:{gateway.port}/v1/text-to-speech/{voice}/{path}?" + "&".join(
        f"{name}={value}" for name, value in params.items()
    )


@dataclass
class Received:
    audio: dict[str | None, bytearray] = field(default_factory=dict)
    chars: dict[str | None, str] = field(default_factory=dict)
    normalized: dict[str | None, str] = field(default_factory=dict)
    finals: list[str | None] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)

    def take(self, message: dict[str, Any], rate: int) -> None:
        self.messages.append(message)
        context = message.get("contextId")
        if message.get("error"):
            self.errors.append(message)
        if message.get("audio"):
            audio = base64.b64decode(message["audio"])
            self.audio.setdefault(context, bytearray()).extend(audio)
            for key, target in (("alignment", self.chars), ("normalizedAlignment", self.normalized)):
                alignment = message[key]
                starts, durations = alignment["charStartTimesMs"], alignment["charDurationsMs"]
                assert len(alignment["chars"]) == len(starts) == len(durations)
                assert starts == sorted(starts)
                # Within the audio of this very message.
                assert all(s + d <= len(audio) / 2 / rate * 1000 + 1 for s, d in zip(starts, durations, strict=True))
                target[context] = target.get(context, "") + "".join(alignment["chars"])
        if message.get("isFinal"):
            self.finals.append(context)

    def speech(self, context: str | None, rate: int = 16_000) -> DecodedAudio:
        samples = np.frombuffer(bytes(self.audio[context]), dtype="<i2").astype(np.float32) / 32768.0
        return DecodedAudio(samples, rate, 1)


async def receive_until(ws: ClientConnection, received: Received, finals: int, rate: int = 16_000) -> None:
    while len(received.finals) < finals:
        received.take(json.loads(await asyncio.wait_for(ws.recv(), 60)), rate)


async def send(ws: ClientConnection, **message: Any) -> None:
    await ws.send(json.dumps(message))


async def stream_words(ws: ClientConnection, text: str, context: str | None = None, pause: float = 0.0) -> None:
    words = text.split(" ")
    for index, word in enumerate(words):
        await send(ws, text=word if index == 0 else f" {word}", **({"context_id": context} if context else {}))
        if pause:
            await asyncio.sleep(pause)


async def close_reason(ws: ClientConnection) -> tuple[int | None, str]:
    with pytest.raises(websockets.ConnectionClosed):
        while True:
            await asyncio.wait_for(ws.recv(), 30)
    assert ws.close_code is not None
    return ws.close_code, ws.close_reason or ""


async def metric(gateway: GatewayProcess, name: str) -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{gateway.url}/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not in /metrics")


async def test_single_stream_word_by_word_is_heard_and_aligned(gateway: GatewayProcess) -> None:
    received = Received()
    async with websockets.connect(ws_url(gateway, multi=False)) as ws:
        await send(ws, text=" ", voice_settings={"speed": 1.0}, generation_config={"chunk_length_schedule": [50]})
        await stream_words(ws, SENTENCE, pause=0.03)
        await send(ws, text="")
        await receive_until(ws, received, 1)
        code, _ = await close_reason(ws)
    assert code == 1000
    assert received.finals == [None]
    assert all("contextId" not in message for message in received.messages)
    assert received.chars[None].strip() == SENTENCE
    audio = received.speech(None)
    assert audio.duration > 1.5
    # Piper returns a sentence's audio whole; it still goes out in pieces a real-time player can start on.
    pieces = [len(base64.b64decode(m["audio"])) / 2 / 16_000 for m in received.messages if m.get("audio")]
    assert len(pieces) >= audio.duration / 0.25 and max(pieces) <= 0.25, pieces
    heard = transcribe(audio)
    assert sum(word in heard.split() for word in ("quick", "brown", "fox", "lazy", "dog")) >= 3, heard


async def test_both_alignments_keep_the_spaces_between_phrases(gateway: GatewayProcess) -> None:
    """Whole phrases (auto_mode, as LiveKit sends them): a client joining characters into words must not
    read "that.The" in either alignment."""
    text = ["I saw that. ", "The dog ran down. ", "Is it over?"]
    received = Received()
    async with websockets.connect(ws_url(gateway, auto_mode="true", apply_text_normalization="off")) as ws:
        await send(ws, text=" ", context_id="a")
        for piece in text:
            await send(ws, text=piece, context_id="a")
        await send(ws, text="", context_id="a", flush=True)
        await send(ws, context_id="a", close_context=True)
        await receive_until(ws, received, 1)
    assert received.chars["a"].strip() == "".join(text)
    assert received.normalized["a"] == received.chars["a"]


async def test_normalized_alignment_carries_the_spoken_words(gateway: GatewayProcess) -> None:
    received = Received()
    async with websockets.connect(ws_url(gateway, apply_text_normalization="on")) as ws:
        await send(ws, text=" ", context_id="money")
        await stream_words(ws, "It costs $3.50 today.", "money")
        await send(ws, text="", context_id="money", flush=True)
        await send(ws, context_id="money", close_context=True)
        await receive_until(ws, received, 1)
    assert received.chars["money"].strip() == "It costs $3.50 today."
    assert "three dollars and fifty cents" in received.normalized["money"]
    assert which_was_said(
        received.speech("money"), ["it costs three dollars and fifty cents today", "it costs three fifty today"]
    )


async def test_two_contexts_and_an_interruption(gateway: GatewayProcess) -> None:
    """close_context on text not flushed interrupts at once; the other context finishes."""
    received = Received()
    long_text = " ".join(["This sentence is here to keep the voice busy for a while."] * 6)
    async with websockets.connect(ws_url(gateway, auto_mode="true")) as ws:
        await send(ws, text=" ", context_id="kept")
        await send(ws, text=" ", context_id="cut")
        await send(ws, text=long_text, context_id="cut")
        await send(ws, text=SENTENCE, context_id="kept")
        # The interrupted context's first audio, then the interruption.
        while "cut" not in received.audio:
            received.take(json.loads(await asyncio.wait_for(ws.recv(), 60)), 16_000)
        await send(ws, text=" more", context_id="cut")
        await send(ws, context_id="cut", close_context=True)
        await send(ws, text="", context_id="kept", flush=True)
        await send(ws, context_id="kept", close_context=True)
        cut_final_at: int | None = None
        while len(received.finals) < 2:
            received.take(json.loads(await asyncio.wait_for(ws.recv(), 60)), 16_000)
            if received.finals and received.finals[0] == "cut" and cut_final_at is None:
                cut_final_at = len(received.messages)
        cut_after = [m for m in received.messages[cut_final_at or 0 :] if m.get("contextId") == "cut"]
    assert received.finals[0] == "cut", "the interruption is answered before the other context's end"
    assert cut_after == []
    assert len(received.audio["cut"]) / 2 / 16_000 < 12, "the long text was not spoken to its end"
    assert received.chars["kept"].strip() == SENTENCE
    await asyncio.sleep(0.5)
    assert await metric(gateway, "tts_ws_contexts_open") == 0


@pytest.mark.parametrize("immediate", [True, False])
async def test_close_after_a_flush_finishes_the_turn_unless_immediate(gateway: GatewayProcess, immediate: bool) -> None:
    """The end of a turn (close_context right after a flush) is graceful; with "immediate" it is an interruption."""
    received = Received()
    long_text = " ".join(["This sentence is here to keep the voice busy for a while."] * 6)
    async with websockets.connect(ws_url(gateway, auto_mode="true")) as ws:
        await send(ws, text=" ", context_id="turn")
        await send(ws, text=long_text, context_id="turn", flush=True)
        while "turn" not in received.audio:
            received.take(json.loads(await asyncio.wait_for(ws.recv(), 60)), 16_000)
        await send(ws, context_id="turn", close_context=True, **({"immediate": True} if immediate else {}))
        await receive_until(ws, received, 1)
    spoken = len(received.audio["turn"]) / 2 / 16_000
    if immediate:
        assert spoken < 12, "the flushed text was spoken to its end"
        assert received.chars["turn"].strip() != long_text
    else:
        assert spoken > 15, spoken
        assert received.chars["turn"].strip() == long_text


async def test_keepalives_flushes_and_close_socket(gateway: GatewayProcess) -> None:
    received = Received()
    async with websockets.connect(ws_url(gateway)) as ws:
        await send(ws, text="")  # a keepalive before any context
        await send(ws, text=" ", context_id="a")
        await send(ws, text="", context_id="a")  # a keepalive of an open context
        await send(ws, text="Hello", context_id="a", try_trigger_generation=True)
        await send(ws, text=" there.", context_id="a")
        await send(ws, context_id="a", flush=True)
        await send(ws, close_socket=True)
        await receive_until(ws, received, 1)
        code, _ = await close_reason(ws)
    assert code == 1000
    assert received.chars["a"].strip() == "Hello there."


@pytest.mark.parametrize(
    ("url_query", "reason"),
    [
        ({"voice": "nobody"}, "voice 'nobody' does not exist"),
        ({"model_id": "no-such-model"}, "no-such-model"),
        ({"output_format": "wav_16000"}, "output_format 'wav_16000' is not supported"),
        ({"inactivity_timeout": "0"}, "inactivity_timeout"),
    ],
)
async def test_bad_parameters_close_with_the_reason(
    gateway: GatewayProcess, url_query: dict[str, str], reason: str
) -> None:
    voice = url_query.pop("voice", "joe")
    async with websockets.connect(ws_url(gateway, voice=voice, **url_query)) as ws:
        error = json.loads(await ws.recv())
        code, close_text = await close_reason(ws)
    assert code == 1008
    assert reason in error["message"]
    assert reason[:40] in close_text


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        ("{not json", "invalid message"),
        ("[1, 2]", "a message is a JSON object"),
        (json.dumps({"text": 5}), "text"),
        (json.dumps({"text": " ", "generation_config": {"chunk_length_schedule": [5]}}), "chunk_length_schedule"),
    ],
)
async def test_bad_messages_close_with_1007(gateway: GatewayProcess, frame: str, reason: str) -> None:
    async with websockets.connect(ws_url(gateway)) as ws:
        await ws.send(frame)
        code, close_text = await close_reason(ws)
    assert code == 1007
    assert reason in close_text


async def test_context_limit(gateway: GatewayProcess) -> None:
    async with websockets.connect(ws_url(gateway)) as ws:
        for index in range(6):
            await send(ws, text=" ", context_id=f"c{index}")
        error = json.loads(await asyncio.wait_for(ws.recv(), 30))
        code, close_text = await close_reason(ws)
    assert code == 1008
    assert "context limit" in close_text
    # An error about a context names it: LiveKit's plugin drops one that does not.
    assert error["contextId"] == "c5" and "context limit" in error["message"]


async def test_inactivity_timeout(gateway: GatewayProcess) -> None:
    async with websockets.connect(ws_url(gateway, inactivity_timeout="1")) as ws:
        await send(ws, text=" ", context_id="a")
        code, close_text = await close_reason(ws)
    assert code == 1008
    assert "inactivity timeout" in close_text


async def test_a_client_that_vanishes_mid_stream_leaves_nothing_behind(gateway: GatewayProcess) -> None:
    ws = await websockets.connect(ws_url(gateway, auto_mode="true"))
    await send(ws, text=" ", context_id="gone")
    await send(ws, text=" ".join([SENTENCE] * 8), context_id="gone")
    json.loads(await asyncio.wait_for(ws.recv(), 60))  # audio is flowing
    ws.transport.abort()  # no close frame
    for _ in range(100):
        if await metric(gateway, "tts_ws_sockets_open") == 0 and await metric(gateway, "tts_ws_contexts_open") == 0:
            break
        await asyncio.sleep(0.1)
    assert await metric(gateway, "tts_ws_sockets_open") == 0
    assert await metric(gateway, "tts_ws_contexts_open") == 0
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(f"{gateway.url}/health")).status_code == 200


@pytest.fixture(scope="module")
def keyed_gateway(
    cpu_triton: EmbeddedTriton, voices_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    log = tmp_path_factory.mktemp("keyed") / "gateway.log"
    env = {"TTS_TRITON_URL": cpu_triton.grpc_url, "TTS_VOICES_DIR": str(voices_dir), "TTS_API_KEYS": KEY}
    process = GatewayProcess(log, env)
    process.start()
    yield process
    process.stop()


@pytest.mark.parametrize(
    "headers", [{}, {"xi-api-key": "wrong"}, {"Authorization": "Bearer wrong"}], ids=["none", "xi", "bearer"]
)
async def test_a_bad_key_is_refused_before_accept(keyed_gateway: GatewayProcess, headers: dict[str, str]) -> None:
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(ws_url(keyed_gateway), additional_headers=headers)
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body)["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("headers", [{"xi-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}], ids=["xi", "bearer"])
async def test_a_good_key_is_let_in(keyed_gateway: GatewayProcess, headers: dict[str, str]) -> None:
    received = Received()
    async with websockets.connect(ws_url(keyed_gateway, multi=False), additional_headers=headers) as ws:
        await send(ws, text="Hi there.")
        await send(ws, text="")
        await receive_until(ws, received, 1)
    assert received.chars[None] == "Hi there."
