"""Triton dies while responses stream and no other server can take over.

Each response started is aborted, so its client sees an error rather than a short file that looks
whole; the gateway stays up, and recovers when Triton is back.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.audio_checks import assert_speech, decode
from tests.e2e.gateway_process import GatewayProcess, crash, free_ports, processes_under
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = pytest.mark.triton

LONG_TEXT = " ".join(f"Sentence number {n} keeps the stream going for a while." for n in range(60))
SHORT = {"model": "tts-1", "voice": "alloy", "input": "A short one."}


@pytest.fixture()
def doomed(cpu_repository: Path, tmp_path: Path) -> Iterator[tuple[EmbeddedTriton, GatewayProcess]]:
    """A Triton of its own (the test kills it; fixed ports, so it can come back) and a gateway in front of it."""
    ports = free_ports(3)
    triton = EmbeddedTriton(cpu_repository, workdir=tmp_path / "triton", ports=(ports[0], ports[1], ports[2]))
    triton.start()
    gateway = GatewayProcess(
        tmp_path / "gateway.log",
        {
            "TTS_TRITON_URL": triton.grpc_url,
            "TTS_VOICES_DIR": str(tmp_path / "voices"),
            # How long a broken stream waits for its server to come back before it is aborted.
            "TTS_BACKEND_CHUNK_TIMEOUT": "3",
        },
    )
    gateway.start()
    try:
        yield triton, gateway
    finally:
        gateway.stop()
        triton.stop(grace=1.0)


def _assert_no_model_process_left(triton: EmbeddedTriton) -> None:
    """Stopping a server that crashed also ends its Python backend processes."""
    triton.stop(grace=1.0)
    deadline = time.monotonic() + 5  # SIGKILLed processes take a moment to leave /proc
    while processes_under(triton.workdir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_under(triton.workdir) == []


def test_sse_stream_ends_with_an_error_event_and_a_dropped_connection(
    doomed: tuple[EmbeddedTriton, GatewayProcess],
) -> None:
    triton, gateway = doomed
    events = []
    body = {"model": "tts-1", "voice": "alloy", "input": LONG_TEXT, "response_format": "pcm", "stream_format": "sse"}
    with httpx.stream("POST", f"{gateway.url}/v1/audio/speech", json=body, timeout=60) as response:
        assert response.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) == 1:
                    crash(triton)
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error"
    assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
    assert events[-1]["error"]["type"] == "server_error"
    assert not any(e["type"] == "speech.audio.done" for e in events)
    assert "speech response aborted at sentence" in gateway.log_tail(200)
    # The gateway is up and says the backend is gone.
    assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 503
    _assert_no_model_process_left(triton)


def test_audio_stream_is_aborted_not_ended(doomed: tuple[EmbeddedTriton, GatewayProcess]) -> None:
    triton, gateway = doomed
    received = bytearray()
    body = {"model": "tts-1", "voice": "alloy", "input": LONG_TEXT, "response_format": "wav"}
    with httpx.stream("POST", f"{gateway.url}/v1/audio/speech", json=body, timeout=60) as response:
        assert response.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            for piece in response.iter_bytes():
                if not received:
                    crash(triton)
                received += piece
    # What arrived is the start of the speech, but the client knows it is not all of it.
    audio = decode(bytes(received), "wav")
    assert audio.sample_rate == 24_000
    assert 0.5 < audio.duration < 120.0
    log = gateway.log_tail(200)
    assert re.search(r"speech response aborted at sentence \d+ of 60: the Triton server is unavailable", log), log
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    assert 'tts_speech_requests_total{format="wav",model="piper",outcome="aborted"} 1.0' in metrics
    speech = httpx.post(f"{gateway.url}/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": "Hi."})
    assert speech.status_code == 503
    assert speech.json()["error"]["code"] == "backend_unavailable"
    _assert_no_model_process_left(triton)


@dataclass
class Outcome:
    """How one response ended: its status and body, or the transport error that cut it."""

    status: int
    body: bytes
    error: str | None = None


async def long_stream(client: httpx.AsyncClient, body: dict[str, str], started: asyncio.Event) -> Outcome:
    async with client.stream("POST", "/v1/audio/speech", json=body) as response:
        received = bytearray()
        try:
            async for piece in response.aiter_raw():
                received += piece
                started.set()
        except httpx.TransportError as exc:
            return Outcome(response.status_code, bytes(received), repr(exc))
    return Outcome(response.status_code, bytes(received))


async def short_requests(client: httpx.AsyncClient, stop: asyncio.Event) -> list[Outcome]:
    """Short requests one after the other until ``stop``, through the crash."""
    outcomes = []
    while not stop.is_set():
        async with client.stream("POST", "/v1/audio/speech", json={**SHORT, "response_format": "wav"}) as response:
            try:
                outcomes.append(Outcome(response.status_code, await response.aread()))
            except httpx.TransportError as exc:
                outcomes.append(Outcome(response.status_code, b"", repr(exc)))
    return outcomes


async def requests_through_a_crash(gateway: GatewayProcess, triton: EmbeddedTriton) -> list[Outcome]:
    """Two long wav streams, one long SSE stream and a run of short requests; Triton dies under them all."""
    long_bodies = [
        {"model": "tts-1", "voice": "alloy", "input": LONG_TEXT, "response_format": "wav"},
        {"model": "tts-1", "voice": "nova", "input": LONG_TEXT, "response_format": "wav"},
        {"model": "tts-1", "voice": "alloy", "input": LONG_TEXT, "response_format": "pcm", "stream_format": "sse"},
    ]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        started = [asyncio.Event() for _ in long_bodies]
        longs = [asyncio.create_task(long_stream(client, b, e)) for b, e in zip(long_bodies, started, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 30)
        stop = asyncio.Event()
        shorts = asyncio.create_task(short_requests(client, stop))
        await asyncio.sleep(0.5)
        crash(triton)
        await asyncio.sleep(1.0)
        stop.set()
        # None may hang: every response ends within seconds of the crash (its wait for a server included).
        *ended, short_outcomes = await asyncio.wait_for(asyncio.gather(*longs, shorts), 15)
    return [*ended, *short_outcomes]


def test_concurrent_requests_are_aborted_and_the_gateway_recovers(
    doomed: tuple[EmbeddedTriton, GatewayProcess],
) -> None:
    triton, gateway = doomed
    wav_a, wav_b, sse, *shorts = asyncio.run(requests_through_a_crash(gateway, triton))
    for stream in (wav_a, wav_b):
        assert stream.status == 200
        assert stream.error is not None and "RemoteProtocolError" in stream.error
        audio = decode(stream.body, "wav")
        assert audio.sample_rate == 24_000
        assert 0.5 < audio.duration < 120.0
    assert sse.status == 200
    assert sse.error is not None and "RemoteProtocolError" in sse.error
    events = [json.loads(line.removeprefix("data: ")) for line in sse.body.decode().splitlines() if line]
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error"
    assert shorts, "short requests ran through the crash"
    for short in shorts:
        if short.status == 200 and short.error is None:
            assert decode(short.body, "wav").duration > 0.5
        elif short.status == 200:
            assert short.error is not None and "RemoteProtocolError" in short.error, short.error
        else:
            assert short.status == 503, short.body
            assert json.loads(short.body)["error"]["code"] == "backend_unavailable"
    assert shorts[-1].status == 503, "requests after the crash are refused"
    # Every response is accounted for, and the gateway is still there.
    assert "tts_speech_in_flight 0.0" in httpx.get(f"{gateway.url}/metrics", timeout=5).text
    assert httpx.get(f"{gateway.url}/health", timeout=5).status_code == 503
    triton.start()
    gateway.wait_for("/health", 200, within=5.0)
    response = httpx.post(f"{gateway.url}/v1/audio/speech", json={**SHORT, "response_format": "wav"}, timeout=30)
    assert response.status_code == 200
    audio = decode(response.content, "wav")
    assert_speech(audio, expected_seconds=audio.duration)
