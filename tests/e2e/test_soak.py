"""Soak: rounds of 200 concurrent mixed requests against the embedded CPU backend, on loopback.

Bounded in time and count (3 rounds). Every answer must be deliberate: audio that decodes,
a 4xx for the requests built to be wrong, a 429 where the admission queue is full; no other
5xx. Between rounds, once idle, the gateway must be back where it started: no slot held, no
stray event-loop tasks, no file descriptors gained, memory flat after the first round (which
pays for the allocator's and the codecs' first use).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.audio_checks import decode
from tests.e2e.gateway_process import GatewayProcess, rss_bytes
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = pytest.mark.triton

CONCURRENCY = 200
ROUNDS = 3
SLOTS = 8
QUEUED = 32
# Growth of resident memory allowed from the end of round 1 to the end of the last round.
RSS_GROWTH_LIMIT = 24 * 1024 * 1024
TEXTS = (
    "Soak test.",
    "A short sentence, then another one. And a third to finish.",
    "Numbers like 42 and 7 are read out too.",
)


@dataclass(frozen=True)
class Call:
    """One request of the mix and what a correct answer to it is."""

    method: str
    path: str
    body: dict[str, Any] | None = None
    audio_format: str | None = None  # decode the 200 body as this format
    expected: frozenset[int] = frozenset({200})


def _mix(rng: random.Random) -> list[Call]:
    calls = []
    for index in range(CONCURRENCY):
        kind = index % 10
        if kind < 6:
            fmt = rng.choice(["mp3", "opus", "aac", "flac", "wav", "pcm"])
            body = {"model": "tts-1", "voice": rng.choice(["alloy", "joe"]), "input": rng.choice(TEXTS)}
            body |= {"response_format": fmt, "speed": rng.choice([1.0, 1.0, 1.25])}
            calls.append(Call("POST", "/v1/audio/speech", body, fmt, frozenset({200, 429})))
        elif kind == 6:
            body = {"model": "tts-1", "voice": "alloy", "input": rng.choice(TEXTS), "stream_format": "sse"}
            calls.append(Call("POST", "/v1/audio/speech", body, None, frozenset({200, 429})))
        elif kind == 7:
            calls.append(Call("GET", rng.choice(["/v1/audio/voices", "/v1/models", "/v1/audio/models", "/health"])))
        elif kind == 8:
            wrong = rng.choice([{"voice": "nobody"}, {"model": "no-such-model"}, {"speed": 9}, {"input": ""}])
            body = {"model": "tts-1", "voice": "alloy", "input": "Wrong.", **wrong}
            calls.append(Call("POST", "/v1/audio/speech", body, None, frozenset({400, 404})))
        else:
            calls.append(Call("GET", "/metrics"))
    rng.shuffle(calls)
    return calls


async def _run(client: httpx.AsyncClient, call: Call) -> tuple[Call, httpx.Response]:
    response = await client.request(call.method, call.path, json=call.body)
    return call, response


def _check(call: Call, response: httpx.Response) -> None:
    assert response.status_code in call.expected, (call, response.status_code, response.text[:300])
    if response.status_code == 429:
        assert int(response.headers["retry-after"]) >= 1
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    elif call.audio_format is not None:
        audio = decode(response.content, call.audio_format)
        assert audio.sample_rate == 24_000 and audio.duration > 0.3 and audio.rms > 0.01
    elif call.body is not None and call.body.get("stream_format") == "sse":
        assert response.text.rstrip().endswith("}") and '"speech.audio.done"' in response.text


def _gauges(gateway: GatewayProcess) -> dict[str, float]:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


async def _settled(gateway: GatewayProcess) -> dict[str, float]:
    """Metrics once the last responses have been wound down (their tasks end just after the bytes)."""
    for _ in range(50):
        gauges = _gauges(gateway)
        if gauges["tts_speech_slots_in_use"] == 0 and gauges["tts_speech_in_flight"] == 0:
            await asyncio.sleep(0.5)
            return _gauges(gateway)
        await asyncio.sleep(0.2)
    raise AssertionError(f"the gateway did not settle: {gauges}")


@pytest.fixture()
def soak_gateway(cpu_triton: EmbeddedTriton, tmp_path: Path) -> Iterator[GatewayProcess]:
    env = {
        "TTS_TRITON_URL": cpu_triton.grpc_url,
        "TTS_VOICES_DIR": str(tmp_path / "voices"),
        "TTS_MAX_CONCURRENT_SPEECH": str(SLOTS),
        "TTS_MAX_QUEUED_SPEECH": str(QUEUED),
        "TTS_QUEUE_TIMEOUT": "60",
    }
    process = GatewayProcess(tmp_path / "gateway.log", env)
    process.start()
    yield process
    process.stop()


async def test_soak_200_concurrent_mixed_requests(soak_gateway: GatewayProcess) -> None:
    rng = random.Random(20261121)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    baseline = await _settled(soak_gateway)
    after_first_round: dict[str, float] = {}
    rss_after_first = 0
    statuses: Counter[int] = Counter()
    async with httpx.AsyncClient(base_url=soak_gateway.url, limits=limits, timeout=120) as client:
        for round_index in range(ROUNDS):
            results = await asyncio.gather(*(_run(client, call) for call in _mix(rng)))
            for call, response in results:
                _check(call, response)
                statuses[response.status_code] += 1
            settled = await _settled(soak_gateway)
            assert settled["tts_speech_queued"] == 0
            # Open sockets beyond the baseline are the client's keep-alive connections.
            assert settled["process_open_fds"] <= baseline["process_open_fds"] + CONCURRENCY + 8
            if round_index == 0:
                after_first_round, rss_after_first = settled, rss_bytes(soak_gateway.pid)
            else:
                assert settled["tts_event_loop_tasks"] <= after_first_round["tts_event_loop_tasks"] + 2

    assert rss_bytes(soak_gateway.pid) - rss_after_first <= RSS_GROWTH_LIMIT
    # With 8 slots and 32 queue places for ~140 speech requests at once, some were turned away.
    assert statuses[429] > 0 and statuses[200] > 0
    assert not [code for code in statuses if code >= 500]
    # Connections closed: every socket the rounds opened is gone, and so are their tasks.
    final = await _settled(soak_gateway)
    assert final["process_open_fds"] <= baseline["process_open_fds"] + 2
    assert final["tts_event_loop_tasks"] <= baseline["tts_event_loop_tasks"] + 2
