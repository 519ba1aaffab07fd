"""Idle HTTP connections stay open as long as TTS_KEEP_ALIVE says, in one process and in several.

A client that reuses an idle connection the gateway is closing at that moment gets a reset instead of
an answer. At uvicorn's default of 5 s, the GPU benchmark's aiohttp client (which keeps idle connections
15 s) lost 1-16 requests of a pass at once in four of eleven runs, likely so. The gateway keeps idle
connections longer than common clients keep theirs.
"""

from __future__ import annotations

import http.client
import socket
import time
from pathlib import Path

import pytest

from tests.e2e.gateway_process import GatewayProcess, free_port


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end has closed ``sock`` (it reads end of file), without consuming anything."""
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    finally:
        sock.settimeout(timeout)


@pytest.mark.parametrize("workers", [1, 2])
def test_an_idle_connection_is_closed_after_the_keep_alive_and_not_before(tmp_path: Path, workers: int) -> None:
    # No Triton behind it: /health answers 503, a whole response all the same.
    env = {"TTS_TRITON_URL": f"127.0.0.1:{free_port()}", "TTS_KEEP_ALIVE": "2", "TTS_WORKERS": str(workers)}
    gateway = GatewayProcess(tmp_path / "gateway.log", env)
    try:
        gateway.start(expect_healthy=False)
        connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=5)
        connection.request("GET", "/health")
        assert connection.getresponse().read()
        sock = connection.sock
        assert sock is not None
        time.sleep(0.5)
        assert not _closed_by_peer(sock), "closed before the keep-alive ran out"
        # Still usable: a second request on the same connection.
        connection.request("GET", "/health")
        assert connection.getresponse().read()
        assert connection.sock is sock
        answered = time.monotonic()
        while not _closed_by_peer(sock):
            assert time.monotonic() - answered < 4, "an idle connection was kept past its keep-alive (2 s)"
            time.sleep(0.05)
        assert time.monotonic() - answered >= 1.5
        connection.close()
    finally:
        gateway.stop()
