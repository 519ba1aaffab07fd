"""The bench profile on a real Triton, with a short fixture tone, for the benchmark tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.models.model_repository import render_repository
from tts_gateway.paths import TRITON_REPOSITORY

ROOT = Path(__file__).resolve().parents[2]

FIXTURE_VALUES = {"audio_seconds": "1.0", "chunk_seconds": "0.25"}
STREAM_FIRST_CHUNK_DELAY_MS = 100


@pytest.fixture(scope="session")
def bench_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    root = tmp_path_factory.mktemp("bench_profile")
    overrides = {
        "bench_fixture": FIXTURE_VALUES,
        "bench_fixture_stream": {**FIXTURE_VALUES, "first_chunk_delay_ms": str(STREAM_FIRST_CHUNK_DELAY_MS)},
    }
    render_repository(TRITON_REPOSITORY, "bench", root / "models", overrides)
    server = EmbeddedTriton(root / "models", workdir=root)
    server.start()
    yield server
    server.stop(grace=5.0)
