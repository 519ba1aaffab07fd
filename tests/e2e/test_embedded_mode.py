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
from tts_gateway.paths import REFERENCE_VOICES, TRITON_REPOSITORY

pytestmark = pytest.mark.triton


def test_serve_starts_and_stops_embedded_triton(tmp_path: Path) -> None:
    executable = shutil.which("tts-gateway")
    assert executable, "the console script is installed with the package"
    port = free_port()
    workdir = tmp_path / "embedded"
    # Every path setting as a user writes it, relative to where the gateway starts (Triton runs elsewhere).
    (tmp_path / "templates").symlink_to(TRITON_REPOSITORY)
    (tmp_path / "refs").mkdir()
    for suffix in (".wav", ".txt"):
        shutil.copy(REFERENCE_VOICES / f"lumen{suffix}", tmp_path / "refs" / f"porch{suffix}")
    env = {
        **os.environ,
        "TTS_EMBEDDED_WORKDIR": "embedded",
        "TTS_VOICES_DIR": "voices",
        "TTS_REF_AUDIOS_DIR": "refs",
        "TTS_TRITON_REPOSITORY": "templates",
        "TTS_MODELS_ROOT": "models",
    }
    env.pop("TTS_TRITON_URL", None)
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen(
            [executable, "serve", "--port", str(port)], env=env, stdout=log, stderr=log, cwd=tmp_path
        )
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
        listed = httpx.get(f"{url}/v1/audio/voices?all=true").json()["voices"]
        assert "porch" in {voice["id"] for voice in listed}
        upload = httpx.post(
            f"{url}/v1/audio/voices",
            data={"name": "stoop", "transcript": (tmp_path / "refs" / "porch.txt").read_text()},
            files={"audio_sample": ("stoop.wav", (tmp_path / "refs" / "porch.wav").read_bytes(), "audio/wav")},
            timeout=60,
        )
        assert upload.status_code == 201, upload.text
        assert (tmp_path / "voices" / f"{upload.json()['id']}.wav").is_file()
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
