"""Two real Triton servers behind one gateway: load shared, one killed mid-load costs no request."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.gateway_process import GatewayProcess, crash, stream_requests_seen
from tests.fixtures.scripted_triton import TONE_SECONDS, ScriptedPair, scripted_pair

pytestmark = pytest.mark.triton

# Four paced tones: a 1 s stream whose first audio comes after 0.25 s.
SPEECH = {"model": "scripted", "voice": "beeper", "input": "tone*4", "response_format": "pcm"}
WHOLE_BYTES = round(4 * TONE_SECONDS * 24_000) * 2
CLIENTS = 6


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[ScriptedPair]:
    with scripted_pair(tmp_path) as started:
        yield started


@dataclass
class Load:
    """``CLIENTS`` clients sending ``SPEECH`` back to back until stopped; every answer is kept."""

    url: str
    results: list[tuple[int, int]] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def client(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                try:
                    response = http.post(f"{self.url}/v1/audio/speech", json=SPEECH)
                except httpx.HTTPError as exc:
                    self.errors.append(exc)
                    continue
                self.results.append((response.status_code, len(response.content)))

    def stop(self) -> None:
        self._stop.set()


def backends(gateway: GatewayProcess) -> dict[str, bool]:
    health = httpx.get(f"{gateway.url}/health", timeout=10).json()
    return {b["address"]: b["ready"] for b in health["backends"]}


def wait_until(condition: Callable[[], bool], within: float) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def test_load_is_shared_and_a_killed_backend_costs_no_request(pair: ScriptedPair) -> None:
    first, second = pair.tritons
    gateway = pair.gateway
    assert backends(gateway) == {first.grpc_url: True, second.grpc_url: True}
    load = Load(gateway.url)
    with ThreadPoolExecutor(CLIENTS) as pool:
        for _ in range(CLIENTS):
            pool.submit(load.client)
        try:
            wait_until(lambda: len(load.results) >= 12, within=60)
            seen = [stream_requests_seen(t.grpc_url, "scripted_stream") for t in (first, second)]
            assert all(count > 0 for count in seen), f"both backends take requests: {seen}"
            crash(second)
            done_at_crash = len(load.results)
            wait_until(lambda: len(load.results) >= done_at_crash + 18, within=60)
        finally:
            load.stop()
    assert not load.errors
    statuses = [status for status, _ in load.results]
    assert statuses == [200] * len(statuses), "a request that had not started streaming must not fail"
    # Requests streaming from the killed server resume on the other, repeating what they had sent of
    # their sentence (no seed); the rest are exactly whole. None is short.
    assert all(WHOLE_BYTES <= size < 2 * WHOLE_BYTES for _, size in load.results)
    assert sum(size == WHOLE_BYTES for _, size in load.results) >= len(load.results) - CLIENTS
    assert backends(gateway) == {first.grpc_url: True, second.grpc_url: False}
    assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200

    second.start()
    wait_until(lambda: backends(gateway)[second.grpc_url], within=10)
    before = stream_requests_seen(second.grpc_url, "scripted_stream")
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda _: httpx.post(f"{gateway.url}/v1/audio/speech", json=SPEECH, timeout=30), range(8))
        )
    assert [a.status_code for a in answers] == [200] * 8
    assert stream_requests_seen(second.grpc_url, "scripted_stream") > before, "the restarted backend rejoins"

    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    for triton in (first, second):
        assert f'tts_triton_server_up{{server="{triton.grpc_url}"}} 1.0' in metrics
        assert f'tts_triton_backend_up{{backend="{triton.grpc_url}"}} 1.0' in metrics
        assert f'tts_triton_server_calls_total{{outcome="ok",server="{triton.grpc_url}"}}' in metrics
        assert f'tts_triton_backend_calls_total{{backend="{triton.grpc_url}",outcome="ok"}}' in metrics


def test_request_fails_over_before_its_first_byte(pair: ScriptedPair) -> None:
    first, second = pair.tritons
    gateway = pair.gateway
    crash(first)
    # The gateway has not noticed yet (it checks every 2 s): calls sent to the dead server are retried.
    answers = [httpx.post(f"{gateway.url}/v1/audio/speech", json=SPEECH, timeout=30) for _ in range(4)]
    assert [(a.status_code, len(a.content)) for a in answers] == [(200, WHOLE_BYTES)] * 4
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert "tts_triton_server_retries_total 1.0" in metrics
    assert "tts_triton_backend_retries_total 1.0" in metrics
    assert f'tts_triton_server_calls_total{{outcome="failed",server="{first.grpc_url}"}} 1.0' in metrics
    assert f'tts_triton_backend_calls_total{{backend="{first.grpc_url}",outcome="failed"}} 1.0' in metrics
    crash(second)
    down = httpx.post(f"{gateway.url}/v1/audio/speech", json=SPEECH, timeout=30)
    assert down.status_code == 503
    assert down.json()["error"]["code"] == "backend_unavailable"
    assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 503


def test_a_model_that_reports_itself_unavailable_leaves_its_backend_in_rotation(pair: ScriptedPair) -> None:
    """An LLM server down behind the orchestrator is the model's outage, not its Triton's."""
    first, second = pair.tritons
    gateway = pair.gateway
    for _ in range(2):
        answer = httpx.post(f"{gateway.url}/v1/audio/speech", json={**SPEECH, "input": "unavailable"}, timeout=30)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "backend_unavailable"
    # Each was sent to both backends in turn (one try, one retry elsewhere), and neither backend was
    # taken out for it: the next request is served at once (/health, which re-checks, is asked last).
    assert httpx.post(f"{gateway.url}/v1/audio/speech", json=SPEECH, timeout=30).status_code == 200
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert "tts_triton_server_retries_total 2.0" in metrics
    assert "tts_triton_backend_retries_total 2.0" in metrics
    for triton in (first, second):
        assert f'tts_triton_server_up{{server="{triton.grpc_url}"}} 1.0' in metrics
        assert f'tts_triton_backend_up{{backend="{triton.grpc_url}"}} 1.0' in metrics
    assert backends(gateway) == {first.grpc_url: True, second.grpc_url: True}


def test_a_call_is_counted_at_its_backend_until_the_client_leaves(pair: ScriptedPair) -> None:
    gateway = pair.gateway

    def outstanding() -> dict[str, int]:
        health = httpx.get(f"{gateway.url}/health", timeout=10).json()
        return {b["address"]: b["outstanding"] for b in health["backends"]}

    with httpx.stream("POST", f"{gateway.url}/v1/audio/speech", json={**SPEECH, "input": "tone*40"}) as response:
        chunks = response.iter_bytes()  # kept: a dropped iterator closes the connection
        next(chunks)
        busy = outstanding()
        assert sorted(busy.values()) == [0, 1]
    (address,) = [a for a, count in busy.items() if count == 1]
    wait_until(lambda: sum(outstanding().values()) == 0, within=10)
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert f'tts_triton_server_calls_total{{outcome="cancelled",server="{address}"}} 1.0' in metrics
    assert f'tts_triton_backend_calls_total{{backend="{address}",outcome="cancelled"}} 1.0' in metrics
