"""The embedded Triton killed under a running gateway comes back without the gateway being restarted."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.audio_checks import assert_speech, decode
from tests.e2e.gateway_process import GatewayProcess, processes_under, tritonserver_pid

pytestmark = pytest.mark.triton

SPEECH = {"model": "tts-1", "voice": "alloy", "input": "Back on my feet.", "response_format": "wav"}
# The required bound: healthy and speaking again within 30 s of the kill.
RECOVERY_LIMIT = 30.0


def restarts(gateway: GatewayProcess) -> float:
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    match = re.search(r"^tts_embedded_triton_restarts_total (\S+)$", metrics, re.MULTILINE)
    assert match, metrics
    return float(match[1])


def kill_and_recover(gateway: GatewayProcess, workdir: Path) -> None:
    old = tritonserver_pid(workdir)
    os.kill(old, signal.SIGKILL)
    started = time.monotonic()
    gateway.wait_for("/health", 503, within=10)
    while True:
        remaining = RECOVERY_LIMIT - (time.monotonic() - started)
        assert remaining > 0, f"not speaking again {RECOVERY_LIMIT} s after the kill:\n{gateway.log_tail()}"
        try:
            response = httpx.post(f"{gateway.url}/v1/audio/speech", json=SPEECH, timeout=remaining)
        except httpx.TimeoutException:
            continue
        if response.status_code == 200:
            break
        assert response.status_code == 503, response.text
        time.sleep(0.2)
    audio = decode(response.content, "wav")
    assert_speech(audio, expected_seconds=audio.duration)
    assert httpx.get(f"{gateway.url}/health", timeout=5).status_code == 200
    assert tritonserver_pid(workdir) != old


def test_killed_three_times_it_recovers_each_time_without_a_gateway_restart(
    embedded: tuple[GatewayProcess, Path],
) -> None:
    gateway, workdir = embedded
    pid = gateway.pid
    assert restarts(gateway) == 0
    for count in (1, 2, 3):
        kill_and_recover(gateway, workdir)
        assert restarts(gateway) == count
    assert gateway.pid == pid and gateway.wait_for("/health", 200, within=1) >= 0
    log = gateway.log_path.read_text()
    assert log.count("embedded Triton exited with status -9; restarting it. Its log ends:") == 3
    assert log.count("embedded Triton restarted") == 3

    gateway.stop()
    assert gateway.wait(timeout=1) == 0
    deadline = time.monotonic() + 10
    while processes_under(workdir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_under(workdir), "no tritonserver or model process may outlive the gateway"


def test_a_request_in_flight_at_the_crash_resumes_on_the_restarted_server(
    embedded: tuple[GatewayProcess, Path],
) -> None:
    gateway, workdir = embedded
    body = {
        **SPEECH,
        "input": " ".join(["This sentence keeps the server busy for a while."] * 12),
        "response_format": "pcm",
    }
    whole = decode(httpx.post(f"{gateway.url}/v1/audio/speech", json=body, timeout=60).content, "pcm")
    with httpx.stream("POST", f"{gateway.url}/v1/audio/speech", json=body, timeout=60) as response:
        assert response.status_code == 200
        chunks = response.iter_bytes()
        received = [next(chunks)]
        os.kill(tritonserver_pid(workdir), signal.SIGKILL)
        received += chunks  # no transport error: the response completes
    heard = decode(b"".join(received), "pcm")
    # Every sentence is spoken, the one that broke again from its start if any of it had been sent.
    # A sentence left out would cost a twelfth of the speech.
    assert heard.speaking_seconds > whole.speaking_seconds * (1 - 1 / 24)
    assert restarts(gateway) == 1
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert re.search(r'tts_speech_requests_total\{format="pcm",model="\w+",outcome="resumed"\} 1\.0', metrics), metrics


def test_a_server_that_stops_answering_is_replaced(embedded: tuple[GatewayProcess, Path]) -> None:
    gateway, workdir = embedded
    hung = tritonserver_pid(workdir)
    os.kill(hung, signal.SIGSTOP)  # alive, but answers nothing
    try:
        gateway.wait_for("/health", 503, within=10)
        # Given up on after 10 s of silence, then started again like a crashed one.
        gateway.wait_for("/health", 200, within=RECOVERY_LIMIT + 10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGCONT)
    assert tritonserver_pid(workdir) != hung
    assert restarts(gateway) == 1
    assert "embedded Triton has not answered for 10 s; restarting it" in gateway.log_path.read_text()
    response = httpx.post(f"{gateway.url}/v1/audio/speech", json=SPEECH, timeout=30)
    assert response.status_code == 200
