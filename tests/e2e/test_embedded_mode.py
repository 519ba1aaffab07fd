"""The main job as users run it: `tts-gateway serve` with no Triton URL starts its own Triton."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.audio_checks import assert_speech, decode
from tests.e2e.gateway_process import free_port, processes_under

pytestmark = pytest.mark.triton


def test_serve_starts_and_stops_embedded_triton(tmp_path: Path) -> None:
    executable = shutil.which("tts-gateway")
    assert executable, "the console script is installed with the package"
    port = free_port()
    workdir = tmp_path / "embedded"
    env = {
        **os.environ,
        "TTS_EMBEDDED_WORKDIR": str(workdir),
        "TTS_VOICES_DIR": str(tmp_path / "voices"),
    }
    env.pop("TTS_TRITON_URL", None)
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen([executable, "serve", "--port", str(port)], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        else:
            pytest.fail("embedded gateway never became healthy:\n" + (tmp_path / "serve.log").read_text())
        assert processes_under(workdir), "the embedded tritonserver runs from the configured workdir"
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        text = "The embedded server speaks on a fresh machine."
        audio = decode(client.audio.speech.create(model="tts-1", voice="alloy", input=text).content, "mp3")
        assert_speech(audio, expected_seconds=audio.duration)
        assert 1.5 < audio.duration < 6.0
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    # uvicorn re-raises the signal it handled once shutdown is complete.
    assert process.returncode in (0, -signal.SIGTERM), (tmp_path / "serve.log").read_text()
    assert "Application shutdown complete" in (tmp_path / "serve.log").read_text()
    deadline = time.monotonic() + 10
    while processes_under(workdir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_under(workdir), "tritonserver must stop with the gateway"
