"""SIGTERM: the gateway stops taking connections, drains what is in flight within TTS_SHUTDOWN_GRACE,
stops its embedded Triton and exits 0, leaving no process behind."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.audio_checks import assert_speech, decode
from tests.e2e.gateway_process import GatewayProcess, SlowReader, processes_under

pytestmark = pytest.mark.triton

PARAGRAPH = (
    "A request in flight when the gateway is told to stop still gets all of its audio. "
    "The gateway finishes every sentence of it first. Only then does it stop the speech server and exit."
)


def embedded_gateway(tmp_path: Path, grace: int, **settings: str) -> Iterator[GatewayProcess]:
    """A gateway that starts its own Triton, in ``tmp_path / "embedded"``."""
    env = {
        "TTS_EMBEDDED_WORKDIR": str(tmp_path / "embedded"),
        "TTS_VOICES_DIR": str(tmp_path / "voices"),
        "TTS_SHUTDOWN_GRACE": str(grace),
        "TTS_TRITON_URL": "",
        **settings,
    }
    gateway = GatewayProcess(tmp_path / "gateway.log", env)
    gateway.start(timeout=180)
    yield gateway
    gateway.stop()


@pytest.fixture()
def piper_gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    """The embedded default (Piper), with a grace period long enough for any request here."""
    yield from embedded_gateway(tmp_path, grace=30)


@pytest.fixture()
def tone_gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    """The benchmark fixture embedded, every sentence 10 minutes of tone, and a 1 s grace period."""
    overrides = '["bench_fixture_stream.audio_seconds=600"]'
    yield from embedded_gateway(tmp_path, grace=1, TTS_EMBEDDED_PROFILE="bench", TTS_EMBEDDED_OVERRIDES=overrides)


class Download(threading.Thread):
    """One streamed speech request; ``started`` is set when the first bytes arrive."""

    def __init__(self, gateway: GatewayProcess, text: str) -> None:
        super().__init__(daemon=True)
        self.started = threading.Event()
        self.body = bytearray()
        self.status = 0
        self.error: Exception | None = None
        self._url = f"{gateway.url}/v1/audio/speech"
        self._text = text

    def run(self) -> None:
        request = {"model": "tts-1", "voice": "alloy", "input": self._text, "response_format": "wav"}
        try:
            with httpx.stream("POST", self._url, json=request, timeout=60) as response:
                self.status = response.status_code
                for piece in response.iter_raw():
                    self.body += piece
                    self.started.set()
        except httpx.HTTPError as exc:
            self.error = exc
        finally:
            self.started.set()


def refuses_connections(gateway: GatewayProcess) -> bool:
    try:
        socket.create_connection(("127.0.0.1", gateway.port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def assert_nothing_left(workdir: Path) -> None:
    deadline = time.monotonic() + 5  # killed processes take a moment to leave /proc
    while processes_under(workdir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_under(workdir) == [], "tritonserver and its model processes must end with the gateway"


def test_sigterm_drains_the_request_in_flight(piper_gateway: GatewayProcess, tmp_path: Path) -> None:
    gateway = piper_gateway
    reference = httpx.post(
        f"{gateway.url}/v1/audio/speech",
        json={"model": "tts-1", "voice": "alloy", "input": PARAGRAPH, "response_format": "wav"},
        timeout=60,
    )
    expected = decode(reference.content, "wav").duration
    download = Download(gateway, PARAGRAPH)
    download.start()
    assert download.started.wait(30)
    gateway.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    deadline = signalled + 2
    while not refuses_connections(gateway):
        assert time.monotonic() < deadline, "the gateway still accepts connections after SIGTERM"
        time.sleep(0.05)
    download.join(30)
    assert not download.is_alive()
    assert download.error is None, download.error
    assert download.status == 200
    assert_speech(decode(bytes(download.body), "wav"), expected_seconds=expected)
    assert gateway.wait(timeout=30) == 0, gateway.log_tail()
    assert "Application shutdown complete" in gateway.log_tail(50)
    assert_nothing_left(tmp_path / "embedded")


def test_grace_period_cuts_a_long_request(tone_gateway: GatewayProcess, tmp_path: Path) -> None:
    gateway = tone_gateway
    body = {"model": "bench_fixture", "voice": "tone", "input": "One. Two.", "response_format": "pcm"}
    # Twenty minutes of audio, read at a third of its pace: without the grace limit, over an hour.
    reader = SlowReader(gateway.port, body, rate=16_000)
    reader.start()
    deadline = time.monotonic() + 10
    while not reader.received:
        assert time.monotonic() < deadline, "no audio arrived"
        time.sleep(0.05)
    gateway.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    status = gateway.wait(timeout=30)
    took = time.monotonic() - signalled
    # 1 s of grace, then the embedded Triton's stop (about 3 s, 5 s at most), then the exit.
    assert took < 1 + 7, f"exit took {took:.1f} s with a 1 s grace period:\n{gateway.log_tail()}"
    assert status == 0, gateway.log_tail()
    assert "Cancel 1 running task(s), timeout graceful shutdown exceeded" in gateway.log_tail(100)
    # The connection is closed: what the socket buffers still hold ends with the end of the stream.
    reader.hurry()
    reader.join(10)
    assert not reader.is_alive(), "the client must not be left waiting"
    reader.leave()
    assert_nothing_left(tmp_path / "embedded")
