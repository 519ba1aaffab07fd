"""``tts-gateway serve --workers 2``: several processes on one port, one embedded Triton, one set of voices.

Which worker answers a connection is the kernel's choice, so the tests repeat a request on fresh
connections until the access log (it names the answering process) shows that both workers answered.
"""

from __future__ import annotations

import io
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.audio_checks import assert_speech, decode
from tests.e2e.gateway_process import GatewayProcess, cmdline, processes_under, tritonserver_pid

pytestmark = pytest.mark.triton

WORKERS = 2
_ACCESS_LINE = re.compile(r" INFO (\d+) uvicorn\.access \[\S+\]: .* \"(\w+) (\S+) HTTP/1\.1\" (\d+)")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("workers")


@pytest.fixture(scope="module")
def gateway(workdir: Path) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        workdir / "gateway.log",
        {"TTS_VOICES_DIR": str(workdir / "voices"), "TTS_EMBEDDED_WORKDIR": str(workdir / "embedded")},
        ["--workers", str(WORKERS)],
    )
    process.start(timeout=180)
    yield process
    process.stop()


def _workers(gateway: GatewayProcess) -> set[int]:
    """The uvicorn worker processes: the gateway's children that are Python, not Triton."""
    children = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rpartition(")")[2].split()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == gateway.pid and b"spawn_main" in cmdline and stat[0] != "Z":
            children.add(int(proc.name))
    return children


def _answered_by(gateway: GatewayProcess, method: str, path: str, since: int) -> list[int]:
    """Processes that answered ``method path`` in the log lines after byte ``since``."""
    log = gateway.log_path.read_bytes()[since:].decode(errors="replace")
    return [int(m[1]) for m in _ACCESS_LINE.finditer(log) if m[2] == method and m[3] == path]


def _on_every_worker(gateway: GatewayProcess, method: str, path: str, call: Callable[[], None]) -> None:
    """Repeat ``call`` (one request on a fresh connection) until each worker has answered it."""
    since = gateway.log_path.stat().st_size
    for _ in range(200):
        call()
        if len(set(_answered_by(gateway, method, path, since))) >= WORKERS:
            return
    raise AssertionError(f"only {set(_answered_by(gateway, method, path, since))} answered {method} {path}")


def _recording(seconds: float, rate: int = 22_050) -> bytes:
    t = np.arange(round(seconds * rate)) / rate
    buffer = io.BytesIO()
    sf.write(buffer, 0.4 * np.sin(2 * np.pi * 190 * t), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def test_workers_share_one_embedded_triton_and_all_speak(gateway: GatewayProcess, workdir: Path) -> None:
    assert len(_workers(gateway)) == WORKERS
    tritons = [pid for pid in processes_under(workdir / "embedded") if b"tritonserver" in cmdline(pid)]
    assert len(tritons) == 1, tritons

    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)

    def speak() -> None:
        with httpx.Client() as fresh:
            audio = client.with_options(http_client=fresh).audio.speech.create(
                model="tts-1", voice="alloy", input="Two workers, one voice.", response_format="wav"
            )
        assert_speech(decode(audio.content, "wav"), expected_seconds=1.6, tolerance=0.6)

    _on_every_worker(gateway, "POST", "/v1/audio/speech", speak)


def test_a_voice_uploaded_through_one_worker_is_known_to_all(gateway: GatewayProcess) -> None:
    created = httpx.post(
        f"{gateway.url}/v1/audio/voices",
        data={"name": "shared-voice", "transcript": "A shared voice."},
        files={"audio_sample": ("a.wav", _recording(2.0), "audio/wav")},
        timeout=60,
    )
    assert created.status_code == 201, created.text

    def listed() -> None:
        voices = httpx.get(f"{gateway.url}/v1/audio/voices?all=true", timeout=10).json()["voices"]
        assert "shared-voice" in {v["id"] for v in voices}

    def taken() -> None:
        again = httpx.post(
            f"{gateway.url}/v1/audio/voices",
            data={"name": "Shared-Voice"},
            files={"audio_sample": ("a.wav", _recording(1.5), "audio/wav")},
            timeout=60,
        )
        assert again.status_code == 409, again.text

    _on_every_worker(gateway, "GET", "/v1/audio/voices?all=true", listed)
    _on_every_worker(gateway, "POST", "/v1/audio/voices", taken)

    assert httpx.delete(f"{gateway.url}/v1/audio/voices/shared-voice", timeout=10).status_code == 200

    def gone() -> None:
        voices = httpx.get(f"{gateway.url}/v1/audio/voices?all=true", timeout=10).json()["voices"]
        assert "shared-voice" not in {v["id"] for v in voices}

    _on_every_worker(gateway, "GET", "/v1/audio/voices?all=true", gone)


def _metric(gateway: GatewayProcess, name: str, **labels: str) -> float:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def test_metrics_count_the_requests_of_every_worker(gateway: GatewayProcess) -> None:
    before = _metric(gateway, "tts_speech_requests_total", outcome="ok", format="pcm")
    since = gateway.log_path.stat().st_size
    requests = 8
    for _ in range(requests):
        response = httpx.post(
            f"{gateway.url}/v1/audio/speech",
            json={"model": "tts-1", "voice": "alloy", "input": "Counted.", "response_format": "pcm"},
            timeout=60,
        )
        assert response.status_code == 200
    # Whichever worker answers the scrape, it reports the requests of all of them.
    for _ in range(6):
        assert _metric(gateway, "tts_speech_requests_total", outcome="ok", format="pcm") == before + requests
    assert _metric(gateway, "tts_speech_in_flight") == 0
    assert len(set(_answered_by(gateway, "POST", "/v1/audio/speech", since))) >= 1


def test_a_killed_worker_is_replaced(gateway: GatewayProcess) -> None:
    victim = min(_workers(gateway))
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while len(_workers(gateway) - {victim}) < WORKERS:
        assert time.monotonic() < deadline, gateway.log_tail()
        time.sleep(0.2)
    for _ in range(10):
        response = httpx.post(
            f"{gateway.url}/v1/audio/speech",
            json={"model": "tts-1", "voice": "alloy", "input": "Still here.", "response_format": "wav"},
            timeout=60,
        )
        assert response.status_code == 200
    assert _metric(gateway, "tts_speech_in_flight") == 0


def test_the_parent_restarts_a_killed_triton_for_every_worker(gateway: GatewayProcess, workdir: Path) -> None:
    workers = _workers(gateway)
    os.kill(tritonserver_pid(workdir / "embedded"), signal.SIGKILL)
    gateway.wait_for("/health", 503, within=10)
    # Each worker sees Triton back on its own (its next check, or a /health it answers).
    since = gateway.log_path.stat().st_size
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline, gateway.log_tail()
        httpx.get(f"{gateway.url}/health", timeout=10)
        log = gateway.log_path.read_bytes()[since:].decode(errors="replace")
        last = {m[1]: m[4] for m in _ACCESS_LINE.finditer(log) if m[3] == "/health"}
        if len(last) >= WORKERS and set(last.values()) == {"200"}:
            break
        time.sleep(0.1)

    def speaks() -> None:
        response = httpx.post(
            f"{gateway.url}/v1/audio/speech",
            json={"model": "tts-1", "voice": "alloy", "input": "Back again.", "response_format": "wav"},
            timeout=60,
        )
        assert response.status_code == 200, response.text

    _on_every_worker(gateway, "POST", "/v1/audio/speech", speaks)
    assert _workers(gateway) == workers, "the workers were not restarted"
    # Counted by the parent, reported by whichever worker answers.
    for _ in range(4):
        assert _metric(gateway, "tts_embedded_triton_restarts_total") == 1


def test_sigterm_ends_workers_triton_and_the_metrics_directory(gateway: GatewayProcess, workdir: Path) -> None:
    metrics_dir = Path(_environment(min(_workers(gateway)))["PROMETHEUS_MULTIPROC_DIR"])
    assert metrics_dir.is_dir()
    gateway.send_signal(signal.SIGTERM)
    assert gateway.wait(timeout=60) == 0
    assert processes_under(workdir / "embedded") == []
    assert not metrics_dir.exists()


def _environment(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").partition("=")[::2] for e in entries if b"=" in e)
