"""A server killed under a text-to-speech WebSocket follows the HTTP path's rule: the broken phrase is
taken over by the other server, or by its own once it is back, and the turn completes; a phrase no
server can complete ends the socket with 1011 after an error, never with ``isFinal``.

Real tritonservers serve the scripted model (a phrase's text is its script: ``Tone*16.`` is 4 s of
tone) behind a real gateway process, as in ``test_stream_failover.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from tests.e2e.gateway_process import GatewayProcess, crash, tritonserver_pid
from tests.e2e.test_stream_failover import TONE_BYTES, busy_triton, crash_out_of_rotation, restart
from tests.e2e.test_text_stream_ws import Received, send, ws_url
from tests.fixtures.scripted_triton import ScriptedPair, scripted_pair
from tests.speech_recognition import transcribe

pytestmark = pytest.mark.triton

RATE = 24_000
# Two phrases before the long one is killed; the last is sent once it has broken.
OPENING = "Tone*2. Tone*16. "
CLOSING = "Tone*2."
WHOLE_BYTES = 20 * TONE_BYTES


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[ScriptedPair]:
    with scripted_pair(tmp_path, {"TTS_SENTENCE_MIN_CHARS": "0"}) as started:
        yield started


def url(gateway: GatewayProcess) -> str:
    return ws_url(gateway, voice="beeper", model_id="scripted", output_format="pcm_24000")


def counted(gateway: GatewayProcess, name: str) -> dict[str, float]:
    """The samples of a metric family, by their labels."""
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    return {labels: float(value) for labels, value in re.findall(rf"^{name}\{{(.*)\}} (\S+)$", text, re.MULTILINE)}


async def speak_killing(pair: ScriptedPair, kill: object) -> Received:
    """Speak the script in one context; once four tones are heard, ``kill()``, then send the last phrase."""
    received = Received()
    async with websockets.connect(url(pair.gateway), max_queue=None) as ws:
        await send(ws, text=OPENING, context_id="turn")
        while len(received.audio.get("turn", b"")) <= 4 * TONE_BYTES:
            received.take(json.loads(await asyncio.wait_for(ws.recv(), 60)), RATE)
        await asyncio.to_thread(kill)  # type: ignore[arg-type]
        await send(ws, text=CLOSING, context_id="turn", flush=True)
        await send(ws, context_id="turn", close_context=True)
        while not received.finals and not received.errors:
            received.take(json.loads(await asyncio.wait_for(ws.recv(), 90)), RATE)
        await send(ws, close_socket=True)
    return received


def test_a_phrase_broken_by_a_killed_server_resumes_on_the_other(pair: ScriptedPair) -> None:
    received = asyncio.run(speak_killing(pair, lambda: crash(busy_triton(pair))))
    assert received.errors == []
    assert received.finals == ["turn"]
    repeated = len(received.audio["turn"]) - WHOLE_BYTES
    # The broken phrase again from its start, as over HTTP: whole tones, those heard before the kill.
    assert 2 * TONE_BYTES <= repeated < 16 * TONE_BYTES
    assert repeated % TONE_BYTES == 0
    assert received.chars["turn"] == OPENING + CLOSING
    assert (
        counted(pair.gateway, "tts_speech_requests_total").get('format="pcm",model="scripted",outcome="resumed"') == 1.0
    )
    assert re.search(r"sentence 0 broke .*repeating it from its start", pair.gateway.log_tail(400))


def test_with_no_other_server_the_turn_waits_for_its_own_to_come_back(pair: ScriptedPair) -> None:
    """The broken phrase, and the phrase sent while no server is up, wait for the restarted server."""
    first, second = pair.tritons
    crash_out_of_rotation(pair, second)

    def crash_and_restart() -> None:
        crash(first)
        time.sleep(1)  # the last phrase arrives while no server is up
        restart(first)

    received = asyncio.run(speak_killing(pair, crash_and_restart))
    assert received.errors == []
    assert received.finals == ["turn"]
    assert len(received.audio["turn"]) >= WHOLE_BYTES
    assert len(received.audio["turn"]) % TONE_BYTES == 0


def test_a_phrase_no_server_can_complete_fails_the_socket_without_is_final(pair: ScriptedPair) -> None:
    async def doomed() -> tuple[Received, int | None, str]:
        received = Received()
        async with websockets.connect(url(pair.gateway), max_queue=None) as ws:
            await send(ws, text="Tone*2. Tone*2 fail. Tone*2.", context_id="turn", flush=True)
            await send(ws, context_id="turn", close_context=True)
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    received.take(json.loads(await asyncio.wait_for(ws.recv(), 60)), RATE)
            return received, ws.close_code, ws.close_reason or ""

    received, code, reason = asyncio.run(doomed())
    assert code == 1011
    assert reason.startswith("synthesis failed: model 'scripted_stream' failed"), reason
    assert received.finals == []
    context_error, socket_error = received.errors
    assert context_error["contextId"] == "turn"
    assert context_error["error"] == "backend_error"
    assert socket_error["code"] == 1011
    assert counted(pair.gateway, "tts_ws_contexts_failed_total") == {'code="backend_error"': 1.0}


def test_the_embedded_triton_killed_while_words_stream_in_costs_no_words(
    embedded: tuple[GatewayProcess, Path],
) -> None:
    """The words sent while the supervisor restarts the server are spoken once it is back."""
    gateway, workdir = embedded
    words = " ".join(f"Sentence number {n} is spoken in full." for n in range(12)).split(" ")

    async def stream() -> Received:
        received = Received()
        async with websockets.connect(ws_url(gateway, output_format="pcm_24000"), max_queue=None) as ws:
            for index, word in enumerate(words):
                await send(ws, text=word if index == 0 else f" {word}", context_id="turn")
                if index == len(words) // 3:
                    while "turn" not in received.audio:
                        received.take(json.loads(await asyncio.wait_for(ws.recv(), 60)), RATE)
                    os.kill(tritonserver_pid(workdir), signal.SIGKILL)
            await send(ws, context_id="turn", flush=True)
            await send(ws, context_id="turn", close_context=True)
            while not received.finals and not received.errors:
                received.take(json.loads(await asyncio.wait_for(ws.recv(), 120)), RATE)
        return received

    received = asyncio.run(stream())
    assert received.errors == []
    assert received.finals == ["turn"]
    assert received.chars["turn"] == " ".join(words)
    audio = received.speech("turn", rate=RATE)
    heard = transcribe(audio)
    assert "eleven" in heard.split(), heard
    assert "embedded Triton restarted" in gateway.log_path.read_text()
