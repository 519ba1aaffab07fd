"""The text-streaming WebSocket on CosyVoice2's text-streaming deployment (tiny random weights): a
gateway process over the cosyvoice2-cpu profile, real sockets, the ``websockets`` client.

A context is one ``cosyvoice2_bistream`` session: its words go to the model as they come and its
audio arrives while the text is still coming (the phrase path would wait for a sentence end here).
With random weights the audio is noise; the checks are about the session: whole 40 ms tokens, the
alignment, normalised numbers, an interruption that ends the session and frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import pytest
import websockets
from websockets.asyncio.client import ClientConnection

from tests.conftest import CosyVoiceServer
from tests.e2e.gateway_process import GatewayProcess, stream_requests_seen
from tests.e2e.test_text_stream_ws import Received, metric, send, ws_url

pytestmark = [pytest.mark.triton, pytest.mark.cosyvoice]

RATE = 24_000
SAMPLES_PER_TOKEN = 960
# No clause break or sentence end before its last word, and shorter than the phrase path's first
# schedule entry: phrases would speak none of it before the end.
TEXT = "The fox paid $3.50 for a quick brown hat and then jumped over the lazy dog near the old river bank."
WAIT_S = 120.0


class Listener:
    """Reads a socket's messages in the background, noting when audio came."""

    def __init__(self, ws: ClientConnection) -> None:
        self.received = Received()
        self.audio_at: dict[str | None, list[float]] = {}
        self._ws = ws
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for raw in self._ws:
            message = json.loads(raw)
            if message.get("audio"):
                self.audio_at.setdefault(message.get("contextId"), []).append(time.monotonic())
            self.received.take(message, RATE)

    async def until(self, done: Callable[[], object], within: float = WAIT_S) -> None:
        """Wait until ``done()`` holds; a failed check of a message, or the socket's close, fails it."""
        deadline = time.monotonic() + within
        while not done():
            if self._task.done():
                self._task.result()
                raise AssertionError(f"the socket closed: {self._ws.close_code} {self._ws.close_reason}")
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def send_words(ws: ClientConnection, words: list[str], context: str | None, pause: float) -> None:
    for word in words:
        await send(ws, text=f"{word} ", **({"context_id": context} if context else {}))
        await asyncio.sleep(pause)


async def test_words_are_spoken_while_they_still_come(
    cosy_gateway: GatewayProcess, cosyvoice_server: CosyVoiceServer
) -> None:
    triton_url = cosyvoice_server.triton.grpc_url
    sessions_before = stream_requests_seen(triton_url, "cosyvoice2_bistream")
    phrases_before = stream_requests_seen(triton_url, "cosyvoice2_stream")
    url = ws_url(cosy_gateway, multi=False, voice="lumen", output_format=f"pcm_{RATE}", apply_text_normalization="on")
    async with websockets.connect(url) as ws:
        listener = Listener(ws)
        *words, last = TEXT.split(" ")
        await send_words(ws, words, None, pause=0.2)
        # The last word waits until audio came: with the text incomplete, only a session speaks.
        await listener.until(lambda: listener.audio_at.get(None))
        last_sent = time.monotonic()
        await send(ws, text=last)
        await send(ws, text="")
        await listener.until(lambda: listener.received.finals)
        await listener.stop()
    received = listener.received
    assert received.finals == [None] and not received.errors
    assert listener.audio_at[None][0] < last_sent
    # Every character sent is aligned once, within its message's audio (checked by Received).
    assert received.chars[None] == " ".join(words) + " " + last
    assert "three dollars and fifty cents" in received.normalized[None]
    audio = received.speech(None, RATE)
    assert audio.samples.size > 0 and audio.samples.size % SAMPLES_PER_TOKEN == 0
    # One session per context, no phrase requests.
    assert stream_requests_seen(triton_url, "cosyvoice2_bistream") > sessions_before
    assert stream_requests_seen(triton_url, "cosyvoice2_stream") == phrases_before


async def test_close_context_stops_the_session_and_frees_it(cosy_gateway: GatewayProcess) -> None:
    url = ws_url(cosy_gateway, voice="lumen", output_format=f"pcm_{RATE}")
    async with websockets.connect(url) as ws:
        listener = Listener(ws)
        await send_words(ws, TEXT.split(" "), "talk", pause=0.0)
        await listener.until(lambda: listener.audio_at.get("talk"))
        assert await metric(cosy_gateway, "tts_speech_slots_in_use") == 1
        # Not flushed: an interruption.
        await send(ws, context_id="talk", close_context=True)
        await listener.until(lambda: "talk" in listener.received.finals, within=30)
        final_at = time.monotonic()
        assert await metric(cosy_gateway, "tts_speech_slots_in_use") == 0
        # A new session on the same socket speaks to its end.
        await send_words(ws, ["A", "new", "turn", "starts", "here."], "next", pause=0.0)
        await send(ws, text="", context_id="next", flush=True)
        await send(ws, context_id="next", close_context=True)
        await listener.until(lambda: "next" in listener.received.finals)
        await listener.stop()
    received = listener.received
    assert not received.errors
    assert all(at < final_at for at in listener.audio_at["talk"]), "audio of the interrupted context after its end"
    assert received.chars["next"] == "A new turn starts here."
    assert received.speech("next", RATE).samples.size % SAMPLES_PER_TOKEN == 0
    assert await metric(cosy_gateway, "tts_speech_slots_in_use") == 0
