"""The benchmark fixture under a real tritonserver: the configured duration, chunking and first-chunk delay."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.bench.conftest import STREAM_FIRST_CHUNK_DELAY_MS
from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.gateway.errors import InvalidRequestError
from tts_gateway.gateway.triton.client import TritonClient
from tts_gateway.models import contract

pytestmark = pytest.mark.triton

REQUEST = {contract.TARGET_TEXT: "Hello there.", contract.VOICE: "tone"}


async def test_offline_answers_the_configured_duration(bench_triton: EmbeddedTriton) -> None:
    client = TritonClient(bench_triton.grpc_url, timeout=30)
    try:
        audio = await client.infer("bench_fixture", REQUEST, request_id="offline")
    finally:
        await client.close()
    assert audio.size == 24_000
    assert np.sqrt(np.mean(audio**2)) > 0.1


async def test_stream_sends_the_configured_chunks_after_the_delay(bench_triton: EmbeddedTriton) -> None:
    client = TritonClient(bench_triton.grpc_url, timeout=30)
    arrivals: list[float] = []
    sizes: list[int] = []
    try:
        started = time.monotonic()
        async for chunk in client.stream("bench_fixture_stream", REQUEST, "stream"):
            arrivals.append(time.monotonic() - started)
            sizes.append(chunk.size)
            assert np.abs(chunk).max() > 0.2
    finally:
        await client.close()
    assert sizes == [6_000] * 4
    assert arrivals[0] >= STREAM_FIRST_CHUNK_DELAY_MS / 1000


async def test_a_voice_of_another_model_is_rejected(bench_triton: EmbeddedTriton) -> None:
    client = TritonClient(bench_triton.grpc_url, timeout=30)
    try:
        with pytest.raises(InvalidRequestError, match="unknown voice"):
            await client.infer("bench_fixture", {**REQUEST, contract.VOICE: "joe"}, request_id="voice")
    finally:
        await client.close()
