"""The gateway's Triton client against the real server: audio, and errors with the right status."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.fixtures.scripted_triton import SAMPLE_RATE, TONE_SECONDS
from tests.fixtures.silent_server import silent_server
from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.gateway.errors import InvalidRequestError, ServerTimeoutError, ServerUnavailableError
from tts_gateway.gateway.triton.client import Readiness, TritonClient
from tts_gateway.models import contract

pytestmark = pytest.mark.triton


async def test_offline_and_stream_carry_the_same_kind_of_audio(cpu_triton: EmbeddedTriton) -> None:
    client = TritonClient(cpu_triton.grpc_url, timeout=60)
    try:
        whole = await client.infer("piper", {contract.TARGET_TEXT: "One. Two."}, request_id="a")
        chunks = [c async for c in client.stream("piper_stream", {contract.TARGET_TEXT: "One. Two."}, "b")]
    finally:
        await client.close()
    assert whole.size > 22_050 // 2
    assert len(chunks) == 2
    assert abs(sum(c.size for c in chunks) - whole.size) < 0.3 * whole.size


@pytest.mark.parametrize("model", ["piper", "piper_stream"])
async def test_rejections_are_invalid_requests_offline_and_streamed(cpu_triton: EmbeddedTriton, model: str) -> None:
    client = TritonClient(cpu_triton.grpc_url, timeout=60)
    try:
        with pytest.raises(InvalidRequestError, match="'target_text' is empty") as info:
            if model.endswith(contract.STREAM_SUFFIX):
                [c async for c in client.stream(model, {contract.TARGET_TEXT: "   "}, "c")]
            else:
                await client.infer(model, {contract.TARGET_TEXT: "   "}, request_id="c")
    finally:
        await client.close()
    assert "[INVALID_ARG]" not in info.value.message


async def test_readiness_tells_a_ready_server_from_one_that_does_not_answer(cpu_triton: EmbeddedTriton) -> None:
    async with silent_server() as silent:
        clients = [TritonClient(cpu_triton.grpc_url, timeout=5), TritonClient(silent, timeout=5)]
        try:
            assert [await client.readiness() for client in clients] == [Readiness.READY, Readiness.SILENT]
        finally:
            for client in clients:
                await client.close()


async def test_a_server_that_is_not_there_is_unavailable() -> None:
    from tests.e2e.gateway_process import free_port

    client = TritonClient(f"127.0.0.1:{free_port()}", timeout=5)
    try:
        assert await client.readiness() is Readiness.NOT_READY
        with pytest.raises(ServerUnavailableError):
            await client.infer("piper", {contract.TARGET_TEXT: "hi"}, request_id="d")
    finally:
        await client.close()


async def test_a_stalled_stream_is_given_up_after_the_chunk_timeout(scripted_triton: EmbeddedTriton) -> None:
    client = TritonClient(scripted_triton.grpc_url, timeout=60, chunk_timeout=1.0)
    chunks = []
    started = time.monotonic()
    try:
        with pytest.raises(ServerTimeoutError, match="sent nothing for 1 s"):
            async for chunk in client.stream("scripted_stream", {contract.TARGET_TEXT: "tone*2 hang"}, "stalled"):
                chunks.append(chunk.size)
    finally:
        await client.close()
    elapsed = time.monotonic() - started
    assert chunks == [int(TONE_SECONDS * SAMPLE_RATE)] * 2
    assert 2 * TONE_SECONDS + 1.0 <= elapsed < 2 * TONE_SECONDS + 2.0
    # Giving up cancels the request at Triton: the model stops waiting.
    deadline = time.monotonic() + 5
    while "scripted_stream: request 'stalled' cancelled" not in scripted_triton.log_path.read_text():
        assert time.monotonic() < deadline, "the stalled request was not cancelled at Triton"
        await asyncio.sleep(0.1)


async def test_the_chunk_timeout_bounds_each_gap_not_the_whole_stream(scripted_triton: EmbeddedTriton) -> None:
    client = TritonClient(scripted_triton.grpc_url, timeout=60, chunk_timeout=1.5)
    started = time.monotonic()
    try:
        # Gaps of 1.25 s, 2.75 s in all.
        script = {contract.TARGET_TEXT: "tone wait tone wait tone"}
        chunks = [c.size async for c in client.stream("scripted_stream", script, "paced")]
    finally:
        await client.close()
    assert len(chunks) == 3
    assert time.monotonic() - started > 2.5
