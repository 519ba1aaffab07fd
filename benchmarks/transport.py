"""Gateway-to-Triton transport for streamed audio: gRPC stream vs HTTP ``generate_stream``.

Starts the embedded Triton (cpu profile), sends the same requests to the decoupled
``piper_stream`` model both ways, and prints first-chunk latency, total time and the
bytes that crossed the socket per second of audio.

    python -m benchmarks.transport [--requests 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.gateway.triton.client import TritonClient
from tts_gateway.models.model_repository import render_repository
from tts_gateway.paths import TRITON_REPOSITORY

TEXT = "Transport matters for streaming. Each chunk is a second or two of audio. Which wire carries it best?"
MODEL = "piper_stream"
SAMPLE_RATE = 22_050
REPO = TRITON_REPOSITORY


async def via_grpc(client: TritonClient) -> tuple[float, float, int, int]:
    started = time.perf_counter()
    first = 0.0
    samples = 0
    async for chunk in client.stream(MODEL, {"target_text": TEXT}, request_id="bench"):
        first = first or time.perf_counter() - started
        samples += chunk.size
    # Binary tensors: 4 bytes per float32 sample plus small framing.
    return first, time.perf_counter() - started, samples, samples * 4


async def via_http(http: httpx.AsyncClient, url: str) -> tuple[float, float, int, int]:
    started = time.perf_counter()
    first = 0.0
    samples = 0
    wire = 0
    async with http.stream("POST", f"{url}/v2/models/{MODEL}/generate_stream", json={"target_text": TEXT}) as response:
        response.raise_for_status()
        async for line in _lines(response.aiter_bytes()):
            wire += len(line)
            if line.startswith(b"data:"):
                first = first or time.perf_counter() - started
                samples += len(_json_waveform(line[5:]))
    return first, time.perf_counter() - started, samples, wire


async def _lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line


def _json_waveform(payload: bytes) -> list[Any]:
    waveform: list[Any] = json.loads(payload)["waveform"]
    return waveform


def _report(name: str, runs: list[tuple[float, float, int, int]]) -> str:
    first = statistics.median(r[0] for r in runs) * 1000
    total = statistics.median(r[1] for r in runs) * 1000
    audio_seconds = runs[0][2] / SAMPLE_RATE
    wire_per_second = statistics.median(r[3] for r in runs) / audio_seconds / 1024
    return f"| {name} | {first:.1f} | {total:.1f} | {wire_per_second:.0f} |"


async def main(requests: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "repo"
        render_repository(REPO, "cpu", repository)
        server = EmbeddedTriton(repository, workdir=Path(tmp))
        server.start()
        try:
            client = TritonClient(server.grpc_url, timeout=60)
            async with httpx.AsyncClient(timeout=60) as http:
                await via_grpc(client)
                await via_http(http, server.http_url)
                grpc_runs, http_runs = [], []
                for _ in range(requests):
                    grpc_runs.append(await via_grpc(client))
                    http_runs.append(await via_http(http, server.http_url))
            await client.close()
        finally:
            server.stop()
    assert np.isclose(grpc_runs[0][2], http_runs[0][2], rtol=0.2), "both paths must carry the same audio"
    print(f"{requests} sequential requests, {grpc_runs[0][2] / SAMPLE_RATE:.1f} s of audio each, medians")
    print("| transport | first chunk ms | total ms | KiB on the wire per audio second |")
    print("|---|---|---|---|")
    print(_report("gRPC ModelStreamInfer (binary)", grpc_runs))
    print(_report("HTTP generate_stream (JSON)", http_runs))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20)
    asyncio.run(main(parser.parse_args().requests))
