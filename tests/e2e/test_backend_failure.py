"""Triton dies while a response streams: the stream ends cleanly and the gateway stays up."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.embedded_triton import EmbeddedTriton
from tests.audio_checks import decode
from tests.e2e.gateway_process import GatewayProcess, processes_under

pytestmark = pytest.mark.triton

LONG_TEXT = " ".join(f"Sentence number {n} keeps the stream going for a while." for n in range(60))


@pytest.fixture()
def doomed(cpu_repository: Path, tmp_path: Path) -> Iterator[tuple[EmbeddedTriton, GatewayProcess]]:
    """A Triton of its own (the test kills it) and a gateway in front of it."""
    triton = EmbeddedTriton(cpu_repository, workdir=tmp_path / "triton")
    triton.start()
    gateway = GatewayProcess(
        tmp_path / "gateway.log", {"TTS_TRITON_URL": triton.grpc_url, "TTS_VOICES_DIR": str(tmp_path / "voices")}
    )
    gateway.start()
    try:
        yield triton, gateway
    finally:
        gateway.stop()
        triton.stop(grace=1.0)


def _kill(triton: EmbeddedTriton) -> None:
    assert triton.pid is not None
    os.kill(triton.pid, signal.SIGKILL)


def _assert_no_model_process_left(triton: EmbeddedTriton) -> None:
    """Stopping a server that crashed also ends its Python backend processes."""
    triton.stop(grace=1.0)
    deadline = time.monotonic() + 5  # SIGKILLed processes take a moment to leave /proc
    while processes_under(triton.workdir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_under(triton.workdir) == []


def test_sse_stream_ends_with_an_error_event(doomed: tuple[EmbeddedTriton, GatewayProcess]) -> None:
    triton, gateway = doomed
    events = []
    body = {"model": "tts-1", "voice": "alloy", "input": LONG_TEXT, "response_format": "pcm", "stream_format": "sse"}
    with httpx.stream("POST", f"{gateway.url}/v1/audio/speech", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line.removeprefix("data: ")))
            if len(events) == 1:
                _kill(triton)
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error"
    assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
    assert events[-1]["error"]["type"] == "server_error"
    assert not any(e["type"] == "speech.audio.done" for e in events)
    assert "ended early" in gateway.log_tail(200)
    # The gateway is up and says the backend is gone.
    assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 503
    _assert_no_model_process_left(triton)


def test_audio_stream_ends_as_a_valid_shorter_file(doomed: tuple[EmbeddedTriton, GatewayProcess]) -> None:
    triton, gateway = doomed
    received = bytearray()
    body = {"model": "tts-1", "voice": "alloy", "input": LONG_TEXT, "response_format": "wav"}
    with httpx.stream("POST", f"{gateway.url}/v1/audio/speech", json=body, timeout=60) as response:
        assert response.status_code == 200
        for piece in response.iter_bytes():
            if not received:
                _kill(triton)
            received += piece
    audio = decode(bytes(received), "wav")
    assert audio.sample_rate == 24_000
    assert 0.5 < audio.duration < 120.0
    assert "ended early" in gateway.log_tail(200)
    speech = httpx.post(f"{gateway.url}/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": "Hi."})
    assert speech.status_code == 503
    assert speech.json()["error"]["code"] == "backend_unavailable"
    _assert_no_model_process_left(triton)
