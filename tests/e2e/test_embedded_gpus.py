"""One embedded Triton per GPU: each pinned to its GPU under its own MPS daemon, supervised, pooled.

No GPU here: the CPU profile stands in for a GPU profile (``TTS_EMBEDDED_GPUS=0,1`` asks for two
servers whatever the profile), and the MPS control program is the recording stand-in. What is
real: the gateway process, both tritonservers and their environments, the pool spreading requests
over them, a server killed and restarted while the other serves.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.audio_checks import assert_speech, decode
from tests.e2e.gateway_process import GatewayProcess, processes_under, tritonserver_pid
from tests.unit.test_cuda_mps import devices, stand_in

pytestmark = pytest.mark.triton

GPUS = ("0", "1")


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in raw if b"=" in entry)


def backend_calls(url: str) -> dict[str, float]:
    """``tts_triton_backend_calls_total`` of successful calls, by backend address."""
    calls: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        match = re.match(r'tts_triton_backend_calls_total\{backend="([^"]+)",outcome="ok"\} (\S+)', line)
        if match:
            calls[match[1]] = float(match[2])
    return calls


def speak(client: OpenAI, text: str) -> None:
    audio = decode(
        client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format="wav").content, "wav"
    )
    assert_speech(audio, expected_seconds=audio.duration)


def test_one_supervised_server_per_gpu_behind_one_pool(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    stand_in(bin_dir)
    workdir = tmp_path / "embedded"
    gateway = GatewayProcess(
        tmp_path / "gateway.log",
        {
            "TTS_EMBEDDED_WORKDIR": str(workdir),
            "TTS_EMBEDDED_GPUS": ",".join(GPUS),
            "TTS_EMBEDDED_CUDA_MPS": "on",
            "TTS_VOICES_DIR": str(tmp_path / "voices"),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "CUDA_VISIBLE_DEVICES": ",".join(GPUS),
        },
    )
    gateway.start(timeout=240)
    try:
        health = httpx.get(f"{gateway.url}/health", timeout=10).json()
        assert [backend["ready"] for backend in health["backends"]] == [True, True], health
        # Each server sees its GPU alone, under a daemon of its own pinned to that GPU (no nvidia-smi here
        # to turn the ids into UUIDs).
        assert sorted(line for line in devices(bin_dir) if line.endswith("-d")) == ["0 -d", "1 -d"]
        pids = {gpu: tritonserver_pid(workdir / f"gpu-{gpu}") for gpu in GPUS}
        for gpu, pid in pids.items():
            env = environ(pid)
            assert env["CUDA_VISIBLE_DEVICES"] == gpu
            assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(workdir / f"gpu-{gpu}" / "mps" / "pipe")

        client = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        for index in range(6):
            speak(client, f"Request number {index} goes to whichever server has less to do.")
        calls = backend_calls(gateway.url)
        assert len(calls) == 2 and all(count >= 1 for count in calls.values()), calls

        # One server dies: the other answers at once, and the first comes back on its address.
        os.kill(pids["0"], signal.SIGKILL)
        speak(client, "The second server speaks while the first one is restarted.")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            health = httpx.get(f"{gateway.url}/health", timeout=10).json()
            if (
                all(backend["ready"] for backend in health["backends"])
                and "restarts_total 1.0" in httpx.get(f"{gateway.url}/metrics", timeout=5).text
            ):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the killed server was not replaced: {health}\n{gateway.log_tail()}")
        assert tritonserver_pid(workdir / "gpu-0") != pids["0"]
        assert tritonserver_pid(workdir / "gpu-1") == pids["1"]
        speak(client, "Both servers are back.")
    finally:
        gateway.stop()
    deadline = time.monotonic() + 10
    while processes_under(workdir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_under(workdir), "every tritonserver stops with the gateway"
    assert sum(line.endswith(" ") for line in devices(bin_dir)) >= 2, "each daemon is asked to quit"
