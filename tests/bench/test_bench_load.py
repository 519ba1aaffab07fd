"""The benchmark's direct target follows the gateway's schedule, against the real fixture model."""

from __future__ import annotations

import asyncio

import pytest
import tritonclient.grpc.aio as grpcclient

from benchmarks.bench_load import DirectTarget
from benchmarks.bench_texts import BenchText
from tests.bench.conftest import STREAM_FIRST_CHUNK_DELAY_MS
from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.models import contract

pytestmark = pytest.mark.triton

SENTENCE = {contract.TARGET_TEXT: "Hello there.", contract.VOICE: "tone"}
TEXT = BenchText("two", "en", "Hello there. Hello there.")


def _target(client: grpcclient.InferenceServerClient, sentences: list[dict[str, str]]) -> DirectTarget:
    return DirectTarget(
        client,
        "bench_fixture_stream",
        {TEXT.name: sentences},
        streaming=True,
        sample_rate=24_000,
        parallelism=2,
        timeout=30,
    )


async def test_the_second_sentence_waits_for_the_first_audio(bench_triton: EmbeddedTriton) -> None:
    client = grpcclient.InferenceServerClient(bench_triton.grpc_url)
    try:
        sample = await _target(client, [SENTENCE, SENTENCE]).request(TEXT)
    finally:
        await client.close()
    assert sample.error is None
    assert sample.audio_seconds == pytest.approx(2.0)
    assert sample.first_byte is not None
    assert sample.first_byte >= STREAM_FIRST_CHUNK_DELAY_MS / 1000
    # Sent together, both sentences would be done after one first-chunk delay; in turn, after two.
    assert sample.total >= 2 * STREAM_FIRST_CHUNK_DELAY_MS / 1000


async def test_a_failed_first_sentence_ends_the_request(bench_triton: EmbeddedTriton) -> None:
    client = grpcclient.InferenceServerClient(bench_triton.grpc_url)
    try:
        rejected = {**SENTENCE, contract.VOICE: "joe"}
        sample = await asyncio.wait_for(_target(client, [rejected, SENTENCE]).request(TEXT), timeout=20)
    finally:
        await client.close()
    assert sample.error is not None
    assert "unknown voice" in sample.error
