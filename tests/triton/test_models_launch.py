"""``tts-models launch`` where no ``tritonserver`` is installed: the nvidia-pytriton wheel's server runs the profile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.e2e.gateway_process import free_ports, processes_under
from tts_gateway.models import contract
from tts_gateway.paths import TRITON_REPOSITORY

pytestmark = pytest.mark.triton

TTS_MODELS = Path(sys.executable).with_name("tts-models")


def _environment_without_tritonserver() -> dict[str, str]:
    """This environment's ``bin`` and the system's, with no ``tritonserver`` (as outside the NGC image)."""
    path = os.pathsep.join((str(Path(sys.executable).parent), "/usr/bin", "/bin"))
    assert not any((Path(entry) / "tritonserver").exists() for entry in path.split(os.pathsep))
    return {**os.environ, "PATH": path}


def test_launch_serves_the_cpu_profile_with_the_wheels_server_and_stops_on_sigterm(tmp_path: Path) -> None:
    grpc, http, metrics = free_ports(3)
    # As a user types it, in a fresh directory: the paths relative to it, the server running in another.
    (tmp_path / "templates").symlink_to(TRITON_REPOSITORY)
    command = [str(TTS_MODELS), "launch", "--profile", "cpu", "--repo", "repo", "--source", "templates"]
    command += ["--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics)]
    log = tmp_path / "launch.log"
    with log.open("wb") as out:
        launch = subprocess.Popen(
            command, env=_environment_without_tritonserver(), stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path
        )
    try:
        deadline = time.monotonic() + 180
        while not _ready(f"http://127.0.0.1:{http}/v2/health/ready"):
            assert launch.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        text = httpclient.InferInput(contract.TARGET_TEXT, [1], "BYTES")
        text.set_data_from_numpy(np.array([b"Hello from the launched server."], dtype=object))
        waveform = client.infer("piper", [text]).as_numpy(contract.WAVEFORM)
        assert waveform is not None and waveform.size > 22050 // 2
        assert float(np.sqrt(np.mean(np.square(waveform)))) > 0.01
        assert client.is_model_ready("piper_stream")
    finally:
        launch.send_signal(signal.SIGTERM)
        returncode = launch.wait(timeout=60)
    assert returncode == 0, log.read_text()
    # The server and its model processes went with it.
    assert processes_under(tmp_path / "repo.server") == []


def test_launch_refuses_a_profile_the_wheels_server_cannot_run_before_doing_anything(tmp_path: Path) -> None:
    command = [str(TTS_MODELS), "launch", "--profile", "gpu-trtllm", "--repo", str(tmp_path / "repo"), "--prepare"]
    command += ["--models-root", str(tmp_path / "models")]
    result = subprocess.run(
        command, env=_environment_without_tritonserver(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "'tensorrtllm' backend" in result.stderr and "NGC Triton image" in result.stderr
    # Nothing downloaded, rendered or started.
    assert list(tmp_path.iterdir()) == []


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False
