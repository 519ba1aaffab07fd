"""Clients that leave early or read slowly cost the backend nothing beyond what they have received."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.gateway_process import (
    GatewayProcess,
    SlowReader,
    cpu_seconds,
    model_processes,
    rss_bytes,
    stream_requests_seen,
)
from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.models.model_repository import parse_overrides, render_repository
from tts_gateway.paths import TRITON_REPOSITORY

pytestmark = pytest.mark.triton

SENTENCES = 60
LONG_TEXT = " ".join(f"Sentence number {n} keeps the stream going for a while." for n in range(SENTENCES))
ROOT = Path(__file__).resolve().parents[2]
# The tone deployment: each sentence is TONE_SECONDS of audio in CHUNK-second chunks (27.5 MiB of float32),
# all of it ready at once.
TONE_SECONDS, CHUNK = 300, 0.5
# What one response may hold: TTS_SYNTHESIS_PARALLELISM (2) sentences, each with up to 32 chunks queued
# (speech/service.py's _SENTENCE_QUEUE_CHUNKS: 2 x 32 x 0.5 s x 24 kHz x 4 bytes = 3 MiB) and what gRPC has
# received for it but not handed over (triton/client.py's fixed 1 MiB window per stream); uvicorn stops
# at 64 KiB of unsent output. Measured: 20-25 MiB more for four slow readers, also with both cores busy
# (with gRPC's BDP probing the windows grew under load: 50-80 MiB, once 112); unbounded buffering took
# 187 MiB more in the first four seconds, and grows with the audio (4 x 2 x 27.5 MiB here).
RSS_BOUND = 48 * 2**20
# Piper's streaming model runs in its own stub process; idle, it uses (almost) no CPU.
IDLE_CPU_SECONDS = 0.05


@dataclass(frozen=True)
class BackendActivity:
    """What the Triton behind the gateway has done so far."""

    requests: int  # piper_stream requests finished, successful or not
    model_cpu: float  # CPU seconds of the Python backend stubs


def backend_activity(triton: EmbeddedTriton) -> BackendActivity:
    return BackendActivity(stream_requests_seen(triton.grpc_url), cpu_seconds(model_processes(triton.workdir)))


def wait_until_idle(triton: EmbeddedTriton, within: float) -> BackendActivity:
    """The activity once a full second passes in which the model neither finishes a request nor computes."""
    deadline = time.monotonic() + within
    before = backend_activity(triton)
    while True:
        time.sleep(1.0)
        after = backend_activity(triton)
        if after.requests == before.requests and after.model_cpu - before.model_cpu < IDLE_CPU_SECONDS:
            return after
        assert time.monotonic() < deadline, f"the model kept working: {before} -> {after}"
        before = after


def in_flight(gateway: GatewayProcess) -> float:
    """The gateway's count of speech responses being produced (``tts_speech_in_flight``)."""
    for line in httpx.get(f"{gateway.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("tts_speech_in_flight "):
            return float(line.split()[1])
    raise AssertionError("tts_speech_in_flight is missing from /metrics")


def test_disconnect_stops_the_backend_work(gateway: GatewayProcess, cpu_triton: EmbeddedTriton) -> None:
    start = wait_until_idle(cpu_triton, within=15)
    body = {"model": "tts-1", "voice": "alloy", "input": LONG_TEXT, "response_format": "pcm"}
    with httpx.stream("POST", f"{gateway.url}/v1/audio/speech", json=body, timeout=30) as response:
        assert response.status_code == 200
        first = next(response.iter_raw())
        assert first
    # Leaving the block closed the connection after the first chunk of the first sentence.
    end = wait_until_idle(cpu_triton, within=5)
    # The gateway keeps a few sentences in flight (TTS_SYNTHESIS_PARALLELISM=2); nothing past them
    # reached Triton, nor did the model go on synthesising once the client had left.
    assert end.requests - start.requests <= 4, f"{end.requests - start.requests} of {SENTENCES} sentences synthesised"
    assert end.model_cpu - start.model_cpu < 3.0
    assert in_flight(gateway) == 0


def test_disconnect_from_an_sse_stream_stops_the_backend_work(
    gateway: GatewayProcess, cpu_triton: EmbeddedTriton
) -> None:
    start = wait_until_idle(cpu_triton, within=15)
    body = {"model": "tts-1", "voice": "alloy", "input": LONG_TEXT, "response_format": "mp3", "stream_format": "sse"}
    with httpx.stream("POST", f"{gateway.url}/v1/audio/speech", json=body, timeout=30) as response:
        lines = response.iter_lines()
        event = next(line for line in lines if line.startswith("data: "))
        assert json.loads(event.removeprefix("data: "))["type"] == "speech.audio.delta"
    end = wait_until_idle(cpu_triton, within=5)
    assert end.requests - start.requests <= 4
    assert in_flight(gateway) == 0


@pytest.fixture(scope="module")
def tone_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway before the benchmark fixture: every sentence is minutes of tone, made at once.

    Its audio is ready far faster than any client reads it, which Piper's is not on a small
    machine: whatever the gateway buffered for a slow reader would show at once in its memory.
    """
    root = tmp_path_factory.mktemp("tone")
    overrides = [f"bench_fixture_stream.audio_seconds={TONE_SECONDS}", f"bench_fixture_stream.chunk_seconds={CHUNK}"]
    render_repository(TRITON_REPOSITORY, "bench", root / "models", parse_overrides(overrides))
    with EmbeddedTriton(root / "models", workdir=root / "triton") as triton:
        gateway = GatewayProcess(
            root / "gateway.log", {"TTS_TRITON_URL": triton.grpc_url, "TTS_VOICES_DIR": str(root / "voices")}
        )
        gateway.start()
        try:
            yield gateway
        finally:
            gateway.stop()


def slow_readers(gateway: GatewayProcess, clients: int, seconds: float) -> int:
    """Peak gateway RSS while ``clients`` read a long response at a third of its pace for ``seconds``."""
    body = {"model": "bench_fixture", "voice": "tone", "input": "One. Two. Three.", "response_format": "pcm"}
    readers = [SlowReader(gateway.port, body, rate=16_000) for _ in range(clients)]  # the audio is 48 kB/s
    for reader in readers:
        reader.start()
    peak = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            peak = max(peak, rss_bytes(gateway.pid))
            time.sleep(0.1)
        assert in_flight(gateway) == clients
    finally:
        for reader in readers:
            reader.leave()
    assert all(reader.status_line == b"HTTP/1.1 200 OK" for reader in readers)
    assert all(reader.received > 0 for reader in readers)
    # Once the clients are gone, so are their responses.
    deadline = time.monotonic() + 5.0
    while in_flight(gateway) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert in_flight(gateway) == 0
    return peak


def test_slow_readers_do_not_grow_the_gateways_memory(tone_gateway: GatewayProcess) -> None:
    # Warm up: the first responses allocate what every response needs (encoder, buffers, threads).
    slow_readers(tone_gateway, clients=1, seconds=1.0)
    baseline = rss_bytes(tone_gateway.pid)
    # Twice: what the first readers held was released, so the next ones reuse it rather than add to it.
    for _ in range(2):
        peak = slow_readers(tone_gateway, clients=4, seconds=4.0)
        assert peak - baseline < RSS_BOUND, f"{(peak - baseline) / 2**20:.0f} MiB more for 4 slow readers"
