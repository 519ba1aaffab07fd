"""How the gateway schedules a request's sentences at the backend, seen from Triton's side.

The scripted test model (``tests/fixtures/triton_repo/scripted``) runs its input text as a
script; Triton's statistics count the sentence requests it has received. The first
sentence must have the backend to itself until its first audio exists (nothing competes
with the first byte), and the next sentences must start as soon as it does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.audio_checks import decode
from tests.e2e.gateway_process import GatewayProcess, stream_requests_seen
from tests.fixtures.scripted_triton import TONE_SECONDS, start_scripted_triton
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = pytest.mark.triton

STREAM_MODEL = "scripted_stream"


@pytest.fixture(scope="module")
def scripted_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    server = start_scripted_triton(tmp_path_factory.mktemp("pipelining_triton"))
    yield server
    server.stop(grace=2.0)


def _start_gateway(triton: EmbeddedTriton, workdir: Path, **env: str) -> GatewayProcess:
    env = {
        "TTS_TRITON_URL": triton.grpc_url,
        "TTS_VOICES_DIR": str(workdir / "voices"),
        "TTS_SYNTHESIS_PARALLELISM": "2",
        "TTS_TEXT_NORMALIZATION": "false",  # the scripted model's input is a script ("tone*2"), not prose
        **env,
    }
    process = GatewayProcess(workdir / "gateway.log", env)
    process.start()
    return process


@pytest.fixture(scope="module")
def gateway(scripted_triton: EmbeddedTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    # The scripts' sentences are short on purpose: one request each.
    process = _start_gateway(scripted_triton, tmp_path_factory.mktemp("pipelining_gateway"), TTS_SENTENCE_MIN_CHARS="0")
    yield process
    process.stop()


def _speak_in_background(gateway: GatewayProcess, script: str) -> tuple[threading.Thread, list[bytes]]:
    body: list[bytes] = []

    def speak() -> None:
        payload = {"model": "scripted", "voice": "alloy", "input": script, "response_format": "wav"}
        response = httpx.post(f"{gateway.url}/v1/audio/speech", json=payload, timeout=30)
        response.raise_for_status()
        body.append(response.content)

    thread = threading.Thread(target=speak)
    thread.start()
    return thread, body


def _received_after(triton: EmbeddedTriton, gateway: GatewayProcess, script: str, seconds: float) -> tuple[int, int]:
    """Sentence requests Triton received ``seconds`` into a speech request, and the request's audio in tones."""
    before = stream_requests_seen(triton.grpc_url, STREAM_MODEL)
    thread, body = _speak_in_background(gateway, script)
    time.sleep(seconds)
    during = stream_requests_seen(triton.grpc_url, STREAM_MODEL) - before
    thread.join(timeout=30)
    assert body, "the speech request failed"
    audio = decode(body[0], "wav")
    return during, round(audio.duration / TONE_SECONDS)


def test_second_sentence_waits_for_the_first_sentences_first_audio(
    scripted_triton: EmbeddedTriton, gateway: GatewayProcess
) -> None:
    # Sentence 0 takes 2.25 s to its first audio: until then it is the only request.
    during, tones = _received_after(scripted_triton, gateway, "Wait*2 tone. Tone.", seconds=1.0)
    assert during == 1
    assert tones == 2


def test_next_sentences_start_once_the_first_audio_exists(
    scripted_triton: EmbeddedTriton, gateway: GatewayProcess
) -> None:
    # Sentence 0 sends its first audio at 0.25 s, then stalls for 2 s: sentence 1 goes out at
    # that first audio, not when sentence 0 ends.
    during, tones = _received_after(scripted_triton, gateway, "Tone wait*2 tone. Tone.", seconds=1.25)
    assert during == 2
    assert tones == 3


def test_short_sentences_go_to_the_backend_with_the_next_one(
    scripted_triton: EmbeddedTriton, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gateway = _start_gateway(scripted_triton, tmp_path_factory.mktemp("merging_gateway"))  # 40 characters, the default
    try:
        requests = []
        for script in ("Tone. Tone. Tone.", "Tone tone tone tone tone tone tone tone tone. Tone."):
            before = stream_requests_seen(scripted_triton.grpc_url, STREAM_MODEL)
            thread, body = _speak_in_background(gateway, script)
            thread.join(timeout=30)
            assert body, "the speech request failed"
            requests.append(stream_requests_seen(scripted_triton.grpc_url, STREAM_MODEL) - before)
            assert round(decode(body[0], "wav").duration / TONE_SECONDS) == script.lower().count("tone")
    finally:
        gateway.stop()
    # Three short sentences in one request; a 45-character one on its own, and the short last one after it.
    assert requests == [1, 2]
