"""Real Triton servers shared by the whole test session, started only when a test asks for one."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.models.model_repository import render_repository
from tts_gateway.paths import TRITON_REPOSITORY

if TYPE_CHECKING:
    from tts_gateway.models.cosyvoice2.checkpoints.tiny_checkpoint import TinyCheckpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cpu_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("cpu_profile") / "models"
    render_repository(TRITON_REPOSITORY, "cpu", dest)
    return dest


@pytest.fixture(scope="session")
def cpu_triton(cpu_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    """The embedded default: Piper, offline and streaming."""
    server = EmbeddedTriton(cpu_repository, workdir=tmp_path_factory.mktemp("cpu_triton"))
    server.start()
    yield server
    # A clean shutdown takes about 3 s. After a cancelled gRPC stream, tritonserver 2.51
    # sometimes never finishes unloading the streaming model; stop() then kills it.
    server.stop(grace=5.0)


@dataclass(frozen=True)
class CosyVoiceServer:
    triton: EmbeddedTriton
    tiny: TinyCheckpoint


@pytest.fixture(scope="session")
def cosyvoice_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CosyVoiceServer]:
    """The cosyvoice2-cpu profile over a tiny random-weight checkpoint in the real format."""
    # Imported here: torch and the scripts are only needed by the tests that use this server.
    from tts_gateway.models.cosyvoice2.checkpoints.tiny_checkpoint import write_tiny_checkpoint
    from tts_gateway.tools import model_prep

    root = tmp_path_factory.mktemp("cosyvoice2")
    tiny = write_tiny_checkpoint(root / "models")
    repository = root / "repository"
    code = model_prep.main(
        [
            "render",
            "--profile",
            "cosyvoice2-cpu",
            "--dest",
            str(repository),
            "--models-root",
            str(root / "models"),
            # Two CPU cores: one orchestrator process per deployment is plenty.
            "--set",
            "cosyvoice2.instance_count=1",
            "--set",
            "cosyvoice2_stream.instance_count=1",
        ]
    )
    assert code == 0
    triton = EmbeddedTriton(repository, workdir=root, startup_timeout=300.0)
    triton.start()
    try:
        yield CosyVoiceServer(triton, tiny)
    finally:
        triton.stop(grace=5.0)
