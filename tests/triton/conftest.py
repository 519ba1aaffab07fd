"""A real Triton server from the nvidia-pytriton wheel, serving the rendered ``cpu`` profile."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.embedded_triton import EmbeddedTriton
from tts_backends.model_repository import render_repository

SOURCE_ROOT = Path(__file__).resolve().parents[2] / "triton_repo"


@pytest.fixture(scope="session")
def cpu_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("cpu_profile") / "models"
    render_repository(SOURCE_ROOT, "cpu", dest)
    return dest


@pytest.fixture(scope="session")
def cpu_triton(cpu_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    server = EmbeddedTriton(cpu_repository, workdir=tmp_path_factory.mktemp("cpu_triton"))
    server.start()
    yield server
    # A clean shutdown takes about 3 s. After a cancelled gRPC stream, tritonserver 2.51
    # sometimes never finishes unloading the streaming model; stop() then kills it.
    server.stop(grace=5.0)
