"""The supervisor over a real tritonserver: failed restarts back off, and the server comes back when it can."""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fixtures.scripted_triton import REPOSITORY
from tts_gateway.gateway.embedded.server import EmbeddedTriton, EmbeddedTritonError
from tts_gateway.gateway.embedded.supervisor import TritonSupervisor
from tts_gateway.models.model_repository import render_repository

pytestmark = pytest.mark.triton

NEXT_TRY = re.compile(r"restarting the embedded Triton failed; next try in (\S+) s")


def _wait(condition: Callable[[], bool], within: float) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.1)


def test_failed_restarts_back_off_up_to_the_cap_and_recovery_follows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    models = tmp_path / "models"
    render_repository(REPOSITORY, "scripted", models)
    config = models / "scripted" / "config.pbtxt"
    server = EmbeddedTriton(models, workdir=tmp_path / "work")
    restarts: list[float] = []
    supervisor = TritonSupervisor(
        server,
        on_restart=lambda: restarts.append(time.monotonic()),
        check_interval=0.2,
        backoff_initial=0.25,
        backoff_max=1.0,
    )
    supervisor.start()
    try:
        address = server.grpc_url
        good = config.read_text()
        config.write_text("this is not a model config")  # every start now fails
        with caplog.at_level(logging.INFO, logger="tts_gateway.gateway.embedded.supervisor"):
            first = server.pid
            assert first is not None
            os.kill(first, signal.SIGKILL)
            _wait(lambda: len(NEXT_TRY.findall(caplog.text)) >= 4, within=120)
            assert [float(d) for d in NEXT_TRY.findall(caplog.text)[:4]] == [0.5, 1.0, 1.0, 1.0]
            assert "embedded Triton exited with status -9; restarting it. Its log ends:" in caplog.text
            config.write_text(good)
            _wait(lambda: "embedded Triton restarted" in caplog.text, within=60)
        assert server.answers()
        assert server.grpc_url == address, "the restarted server listens where the first did"
        assert server.pid != first
        assert len(restarts) == 1, "one failure, one restart, however many tries it took"
    finally:
        supervisor.stop()
    assert not server.is_running()


def test_a_first_start_that_fails_is_raised(tmp_path: Path) -> None:
    supervisor = TritonSupervisor(EmbeddedTriton(tmp_path / "missing", workdir=tmp_path, startup_timeout=30))
    with pytest.raises(EmbeddedTritonError, match="tritonserver exited"):
        supervisor.start()
    supervisor.stop()
