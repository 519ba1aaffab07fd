"""A started response either completes or visibly fails: never a short file that looks whole.

Two real Tritons serve the scripted model behind a real gateway process. A server killed under a
stream costs nothing when the other can take the broken sentence over (the response is
``resumed``); a stream that no server can complete is aborted, and real clients (httpx, the OpenAI
SDK, Pipecat's OpenAI TTS service) each report an error.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
from pipecat.frames.frames import EndFrame, ErrorFrame, Frame, TTSAudioRawFrame, TTSSpeakFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.tts import OpenAITTSService

from tests.e2e.gateway_process import GatewayProcess, crash, stream_requests_seen
from tests.fixtures.scripted_triton import TONE_SECONDS, ScriptedPair, scripted_pair
from tts_gateway.gateway.embedded.server import EmbeddedTriton, EmbeddedTritonError

pytestmark = pytest.mark.triton

# Three sentences; the middle one runs 4 s, so a server can be killed under it once the others are done.
SCRIPT = "Tone*2. Tone*16. Tone*2."
TONE_BYTES = round(TONE_SECONDS * 24_000) * 2  # one tone as 16-bit PCM at the gateway's 24 kHz
WHOLE_BYTES = 20 * TONE_BYTES
# The second sentence fails after two tones wherever it runs: no server can complete it.
DOOMED = "Tone*2. Tone*2 fail. Tone*2."
SPEECH = {"model": "scripted", "voice": "beeper", "response_format": "pcm"}


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[ScriptedPair]:
    # Every sentence of a script is synthesised on its own, however short.
    with scripted_pair(tmp_path, {"TTS_SENTENCE_MIN_CHARS": "0"}) as started:
        yield started


def speech_outcomes(gateway: GatewayProcess) -> dict[str, float]:
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    pattern = r'tts_speech_requests_total\{format="(\w+)",model="scripted",outcome="(\w+)"\} (\S+)'
    return {f"{fmt}/{outcome}": float(value) for fmt, outcome, value in re.findall(pattern, metrics)}


def busy_triton(pair: ScriptedPair) -> EmbeddedTriton:
    """The one Triton with a call of the gateway in flight."""
    health = httpx.get(f"{pair.gateway.url}/health", timeout=10).json()
    (port,) = [b["address"].rpartition(":")[2] for b in health["backends"] if b["outstanding"] > 0]
    (triton,) = [t for t in pair.tritons if t.grpc_url.endswith(f":{port}")]
    return triton


def stream_killing_a_server(pair: ScriptedPair, body: dict[str, Any]) -> bytes:
    """Stream ``body``; once only the long sentence is left in flight, kill the server streaming it."""
    received = bytearray()
    killed = False
    with httpx.stream("POST", f"{pair.gateway.url}/v1/audio/speech", json=body, timeout=60) as response:
        assert response.status_code == 200
        for piece in response.iter_raw():
            received += piece
            if not killed and len(received) > 4 * TONE_BYTES:
                crash(busy_triton(pair))
                killed = True
    assert killed
    return bytes(received)


def test_a_reproducible_stream_resumes_elsewhere_where_it_broke(pair: ScriptedPair) -> None:
    """With a seed, the restarted sentence skips what was sent: the audio is the same as unbroken."""
    body = {**SPEECH, "input": SCRIPT, "seed": 7}
    unbroken = httpx.post(f"{pair.gateway.url}/v1/audio/speech", json=body, timeout=60)
    assert unbroken.status_code == 200
    assert len(unbroken.content) == WHOLE_BYTES
    resumed = stream_killing_a_server(pair, body)
    assert resumed == unbroken.content
    assert speech_outcomes(pair.gateway) == {"pcm/ok": 1.0, "pcm/resumed": 1.0}
    log = pair.gateway.log_tail(400)
    assert re.search(r"sentence 1 broke .*skipping the audio already sent", log), log


def test_a_stream_resumes_elsewhere_repeating_its_sentence(pair: ScriptedPair) -> None:
    """Without a seed, the restarted sentence is heard from its start again: nothing is left out."""
    resumed = stream_killing_a_server(pair, {**SPEECH, "input": SCRIPT})
    repeated = len(resumed) - WHOLE_BYTES
    # Whole tones of the broken sentence again: those sent before the kill.
    assert 2 * TONE_BYTES <= repeated < 16 * TONE_BYTES
    assert repeated % TONE_BYTES == 0
    assert speech_outcomes(pair.gateway) == {"pcm/resumed": 1.0}
    assert re.search(r"sentence 1 broke .*repeating it from its start", pair.gateway.log_tail(400))


def test_an_aborted_audio_stream_is_an_error_for_httpx(pair: ScriptedPair) -> None:
    received = bytearray()
    with httpx.stream("POST", f"{pair.gateway.url}/v1/audio/speech", json={**SPEECH, "input": DOOMED}) as response:
        assert response.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            for piece in response.iter_raw():
                received += piece
    # The first sentence and the broken one's start (twice: tried on both servers), and no more (less
    # what the resampler still held: an aborted body has no tail).
    assert 5 * TONE_BYTES < len(received) <= 6 * TONE_BYTES
    assert speech_outcomes(pair.gateway) == {"pcm/aborted": 1.0}
    log = pair.gateway.log_tail(200)
    assert "speech response aborted at sentence 1 of 3: model 'scripted_stream' failed" in log


def test_an_aborted_sse_stream_sends_its_error_then_drops(pair: ScriptedPair) -> None:
    body = {**SPEECH, "input": DOOMED, "stream_format": "sse"}
    events = []
    with httpx.stream("POST", f"{pair.gateway.url}/v1/audio/speech", json=body) as response:
        assert response.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error"
    assert events[-1]["error"]["code"] == "backend_error"
    assert not any(e["type"] == "speech.audio.done" for e in events)


def test_an_aborted_stream_is_an_error_for_the_openai_sdk(pair: ScriptedPair) -> None:
    client = openai.OpenAI(base_url=f"{pair.gateway.url}/v1", api_key="unused", max_retries=0)
    speech = client.audio.speech.with_streaming_response
    # The SDK's own HTTP client (httpx2) reports the body that ends before its last chunk.
    with (
        speech.create(model="scripted", voice="alloy", input=DOOMED, response_format="pcm") as response,
        pytest.raises(httpx2.RemoteProtocolError),
    ):
        for _ in response.iter_bytes():
            pass
    # Read whole, the SDK turns the broken body into its connection error.
    with pytest.raises(openai.APIConnectionError):
        client.audio.speech.create(model="scripted", voice="alloy", input=DOOMED, response_format="pcm")
    assert speech_outcomes(pair.gateway) == {"pcm/aborted": 2.0}


class AudioCollector(FrameProcessor):
    """The end of a Pipecat pipeline: keeps the audio that reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.audio = bytearray()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.audio += frame.audio
        await self.push_frame(frame, direction)


async def pipecat_speech(url: str, text: str) -> tuple[bytes, list[ErrorFrame]]:
    """Speak ``text`` through Pipecat's OpenAI TTS service in a pipeline: the audio it passed on, the errors."""
    settings = OpenAITTSService.Settings(model="scripted", voice="alloy")
    tts = OpenAITTSService(base_url=f"{url}/v1", api_key="unused", settings=settings)
    collector = AudioCollector()
    worker = PipelineWorker(Pipeline([tts, collector]), enable_rtvi=False, idle_timeout_secs=None)
    errors: list[ErrorFrame] = []

    @worker.event_handler("on_pipeline_error")  # type: ignore[untyped-decorator]
    async def on_error(_: PipelineWorker, frame: ErrorFrame) -> None:
        errors.append(frame)

    await worker.queue_frames([TTSSpeakFrame(text), EndFrame()])
    await asyncio.wait_for(PipelineRunner(handle_sigint=False).run(worker), 60)
    return bytes(collector.audio), errors


def test_an_aborted_stream_is_an_error_for_pipecat(pair: ScriptedPair) -> None:
    audio, errors = asyncio.run(pipecat_speech(pair.gateway.url, DOOMED))
    assert errors, "Pipecat reports the broken stream"
    assert "incomplete chunked read" in errors[0].error
    # Pipecat reads in half-second pieces: the last, partial one is lost with the error.
    assert 4 * TONE_BYTES <= len(audio) <= 6 * TONE_BYTES
    # A whole response is whole for Pipecat too.
    audio, errors = asyncio.run(pipecat_speech(pair.gateway.url, "Tone*2. Tone*2."))
    assert errors == []
    assert len(audio) == 4 * TONE_BYTES


def restart(server: EmbeddedTriton, attempts: int = 3) -> None:
    """Start ``server`` again on its ports, as the supervisor does: Triton 2.51 at times aborts while it
    starts right after a crash on the same ports (its gRPC poller meets a closed descriptor), and the
    supervisor then tries again."""
    for attempt in range(attempts):
        try:
            server.start()
            return
        except EmbeddedTritonError:
            if attempt == attempts - 1:
                raise
            time.sleep(1.0)


def crash_out_of_rotation(pair: ScriptedPair, server: EmbeddedTriton) -> None:
    """Kill ``server`` and wait until the gateway has taken it out of rotation."""
    crash(server)
    deadline = time.monotonic() + 10
    while all(b["ready"] for b in httpx.get(f"{pair.gateway.url}/health", timeout=10).json()["backends"]):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_stream_resumes_on_the_restarted_server_when_there_is_no_other(pair: ScriptedPair) -> None:
    """With the other server gone, the broken sentence waits for its own server to come back."""
    first, second = pair.tritons
    crash_out_of_rotation(pair, second)
    received = bytearray()
    restarted = False
    body = {**SPEECH, "input": SCRIPT, "seed": 3}
    with httpx.stream("POST", f"{pair.gateway.url}/v1/audio/speech", json=body, timeout=60) as response:
        for piece in response.iter_raw():
            received += piece
            if not restarted and len(received) > 4 * TONE_BYTES:
                crash(first)
                restart(first)
                restarted = True
    assert len(received) == WHOLE_BYTES
    assert stream_requests_seen(first.grpc_url, "scripted_stream") > 0
    assert speech_outcomes(pair.gateway) == {"pcm/resumed": 1.0}
