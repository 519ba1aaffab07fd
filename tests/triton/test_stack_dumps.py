"""A model stub told ``kill -USR1`` writes its threads' Python stacks to the server's log, and serves on."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.gateway_process import cmdline, model_processes
from tests.fixtures.scripted_triton import start_scripted_triton
from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.models.triton_logging import STACK_DUMP_SIGNAL

pytestmark = pytest.mark.triton


def _stubs_of(workdir: Path, model: str) -> list[int]:
    """Process ids of the Python backend stubs serving ``model`` of the Triton under ``workdir``."""
    return [pid for pid in model_processes(workdir) if f"/{model}/".encode() in cmdline(pid)]


def test_a_stub_dumps_its_threads_stacks_into_the_server_log_and_keeps_serving(tmp_path: Path) -> None:
    server: EmbeddedTriton = start_scripted_triton(tmp_path)
    try:
        stubs = _stubs_of(tmp_path, "scripted_stream")
        assert stubs, "no stub process of scripted_stream found"
        before = server.log_path.read_text(errors="replace")
        assert "Current thread" not in before
        for pid in stubs:
            os.kill(pid, STACK_DUMP_SIGNAL)
        deadline = time.monotonic() + 10
        while "Current thread" not in server.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, "no stack dump in the server's log"
            time.sleep(0.1)
        # Without the handler the signal's default action would have ended the stub: it is the same
        # process, and its model still answers.
        response = httpx.get(f"{server.http_url}/v2/models/scripted_stream/ready", timeout=10)
        assert response.status_code == 200
        assert _stubs_of(tmp_path, "scripted_stream") == stubs
    finally:
        server.stop(grace=2.0)
