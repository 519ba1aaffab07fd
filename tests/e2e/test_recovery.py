"""Triton comes and goes under a running gateway: the gateway answers 503 meanwhile and recovers on its own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.audio_checks import assert_speech, decode
from tests.e2e.gateway_process import GatewayProcess, crash, free_ports
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = pytest.mark.triton

SPEECH = {"model": "tts-1", "voice": "alloy", "input": "The backend is back.", "response_format": "wav"}
# The gateway checks Triton every 2 s and reconnects within 1 s of Triton listening again.
RECOVERY_LIMIT = 5.0


@dataclass
class Deployment:
    triton: EmbeddedTriton
    gateway: GatewayProcess


@pytest.fixture()
def deployment(cpu_repository: Path, tmp_path: Path) -> Iterator[Deployment]:
    """A gateway and a Triton on fixed ports, both left to the test to start (and Triton to kill)."""
    grpc_port, http_port, metrics_port = free_ports(3)
    triton = EmbeddedTriton(cpu_repository, workdir=tmp_path / "triton", ports=(grpc_port, http_port, metrics_port))
    gateway = GatewayProcess(
        tmp_path / "gateway.log",
        {"TTS_TRITON_URL": f"127.0.0.1:{grpc_port}", "TTS_VOICES_DIR": str(tmp_path / "voices")},
    )
    try:
        yield Deployment(triton, gateway)
    finally:
        gateway.stop()
        triton.stop(grace=1.0)


def assert_unavailable(gateway: GatewayProcess) -> None:
    """Speech is refused at once, with OpenAI's error envelope; the other routes answer too."""
    started = time.monotonic()
    speech = httpx.post(f"{gateway.url}/v1/audio/speech", json=SPEECH, timeout=10)
    assert time.monotonic() - started < 2.0, "a request to a dead backend must not hang"
    assert speech.status_code == 503
    error = speech.json()["error"]
    assert error == {"message": error["message"], "type": "server_error", "param": None, "code": "backend_unavailable"}
    models = httpx.get(f"{gateway.url}/v1/models", timeout=5)
    assert models.status_code == 503
    assert models.json()["error"]["code"] == "backend_unavailable"
    assert httpx.get(f"{gateway.url}/health", timeout=5).status_code == 503


def assert_speaks(gateway: GatewayProcess) -> None:
    response = httpx.post(f"{gateway.url}/v1/audio/speech", json=SPEECH, timeout=30)
    assert response.status_code == 200, response.text
    audio = decode(response.content, "wav")
    assert_speech(audio, expected_seconds=audio.duration)
    assert 0.8 < audio.duration < 3.0


def test_gateway_started_before_triton_recovers_by_itself(deployment: Deployment) -> None:
    gateway, triton = deployment.gateway, deployment.triton
    gateway.start(expect_healthy=False)  # after its start-up wait for Triton (10 s)
    assert_unavailable(gateway)
    # Triton comes a while later, when gRPC's default backoff would wait 10 s between attempts.
    time.sleep(5.0)
    triton.start()
    gateway.wait_for("/health", 200, within=RECOVERY_LIMIT)
    assert_speaks(gateway)


def test_gateway_recovers_from_a_triton_restart(deployment: Deployment) -> None:
    gateway, triton = deployment.gateway, deployment.triton
    triton.start()
    gateway.start()
    assert_speaks(gateway)
    crash(triton)
    gateway.wait_for("/health", 503, within=3.0)
    # The catalog goes at the next check of Triton (every 2 s); until then speech fails at the backend.
    gateway.wait_for("/v1/models", 503, within=3.0)
    assert_unavailable(gateway)
    # A built-in voice stays one while its model is down: deleting it is refused, not "does not exist".
    deleted = httpx.delete(f"{gateway.url}/v1/audio/voices/joe", timeout=5)
    assert deleted.status_code == 403, deleted.text
    assert deleted.json()["error"]["code"] == "voice_read_only"
    # Down for long enough that gRPC's default reconnection backoff would reach 6 s or more.
    time.sleep(8.0)
    assert_unavailable(gateway)
    triton.start()
    gateway.wait_for("/health", 200, within=RECOVERY_LIMIT)
    assert_speaks(gateway)
