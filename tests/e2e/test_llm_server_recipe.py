"""The recipe for CosyVoice2 on CPU with its LLM on ``transformers serve``, run as a user types it.

Each step is the documented shell command, run by ``bash`` in an empty directory with the
environment's ``bin`` first on ``PATH`` (an activated virtual environment): a checkpoint written
under ``models``, ``transformers serve`` on its LLM directory, the gateway's embedded server on
the ``cosyvoice2-cpu-llm-server`` profile moved under ``models``. Only the ports differ from the
documented ones, so that the test does not collide with anything listening on them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.audio_checks import decode
from tests.e2e.gateway_process import free_ports

pytestmark = [pytest.mark.triton, pytest.mark.cosyvoice]

SAMPLES_PER_TOKEN = 960
LLM_PORT = 8000
GATEWAY_PORT = 8080
# The recipe's commands, with the ports they document.
WRITE_CHECKPOINT = "tts-models tiny --models-root models"
START_LLM_SERVER = "transformers serve models/cosyvoice2_llm --device cpu --dtype float32 --port 8000"
START_GATEWAY = (
    "TTS_EMBEDDED_PROFILE=cosyvoice2-cpu-llm-server TTS_MODELS_ROOT=models"
    " TTS_LLM_URLS=http://localhost:8000/v1 tts-gateway serve --port 8080"
)


def _with_ports(command: str, llm_port: int, gateway_port: int) -> str:
    return (
        command.replace(f":{LLM_PORT}", f":{llm_port}")
        .replace(f"--port {LLM_PORT}", f"--port {llm_port}")
        .replace(f"--port {GATEWAY_PORT}", f"--port {gateway_port}")
    )


def _shell(command: str, cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    # Settings the recipe does not set come from nowhere else either.
    for key in [key for key in env if key.startswith("TTS_")]:
        del env[key]
    with log.open("ab") as out:
        return subprocess.Popen(
            ["bash", "-c", command], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_until_up(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not up after {timeout} s:\n{log.read_text(errors='replace')[-4000:]}")


def _stop(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The gateway's URL and the directory the commands ran in."""
    work = tmp_path_factory.mktemp("recipe")
    llm_port, gateway_port = free_ports(2)
    log = work / "recipe.log"
    written = _shell(WRITE_CHECKPOINT, work, log)
    assert written.wait(timeout=300) == 0, log.read_text(errors="replace")
    llm = _shell(_with_ports(START_LLM_SERVER, llm_port, gateway_port), work, work / "llm.log")
    gateway = None
    try:
        _wait_until_up(f"http://localhost:{llm_port}/health", llm, work / "llm.log", timeout=180)
        gateway = _shell(_with_ports(START_GATEWAY, llm_port, gateway_port), work, work / "gateway.log")
        url = f"http://127.0.0.1:{gateway_port}"
        _wait_until_up(f"{url}/health", gateway, work / "gateway.log", timeout=400)
        yield url, work
    finally:
        if gateway is not None:
            _stop(gateway)
        _stop(llm)


def test_the_documented_commands_serve_cloned_speech(recipe: tuple[str, Path]) -> None:
    gateway_url, work = recipe
    client = OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=300)
    response = client.audio.speech.create(model="tts-1", voice="alloy", input="Hello world", response_format="pcm")
    audio = decode(response.content, "pcm")
    # Whole speech tokens of the tiny checkpoint's flow, and not silence.
    assert audio.samples.size > 0 and audio.samples.size % SAMPLES_PER_TOKEN == 0
    assert audio.rms > 0.0
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input="Hello world", response_format="pcm"
    ) as streamed:
        pieces = list(streamed.iter_bytes())
    assert decode(b"".join(pieces), "pcm").rms > 0.0
    # The speech tokens came from the LLM server (the profile deploys no LLM of its own).
    assert "/v1/completions" in (work / "llm.log").read_text(errors="replace")
