"""docker-compose.disaggregated.yml: the LLM on its own GPU under trtllm-serve, the rest in Triton on another.

As in ``test_docker.py``: no Docker engine here, so ``docker-compose config`` validates the file
and the tests check what the stack relies on.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tts_gateway.models.model_repository import load_profiles
from tts_gateway.paths import TRITON_REPOSITORY

pytestmark = pytest.mark.cosyvoice

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = "docker-compose.disaggregated.yml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / COMPOSE_FILE).read_text(encoding="utf-8"))


def _gpus(service: dict[str, Any]) -> list[str]:
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    return list(device["device_ids"])


def test_compose_file_validates() -> None:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (.ci/run installs it)")
    result = subprocess.run(
        ["docker-compose", "-f", COMPOSE_FILE, "config", "-q"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_llm_and_triton_each_have_their_own_gpu(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert _gpus(services["llm"]) == ["${LLM_GPU:-0}"]
    assert _gpus(services["triton"]) == ["${TOKEN2WAV_GPU:-1}"]


def test_llm_is_trtllm_serve_on_the_downloaded_hf_directory(compose: dict[str, Any]) -> None:
    llm = compose["services"]["llm"]
    assert llm["image"].startswith("${TRTLLM_IMAGE:-nvcr.io/nvidia/tensorrt-llm/release:")
    command = llm["command"]
    assert command[:2] == ["trtllm-serve", "/models/cosyvoice2_llm"]
    assert command[command.index("--port") + 1] == "8000"
    assert "models:/models:ro" in llm["volumes"]
    assert "http://localhost:8000/health" in llm["healthcheck"]["test"]
    # The weights are in the volume once Triton's launch --prepare has downloaded them.
    assert llm["depends_on"]["triton"]["condition"] == "service_healthy"


def test_triton_profile_points_the_orchestrator_at_the_llm_service(compose: dict[str, Any]) -> None:
    triton = compose["services"]["triton"]
    assert triton["command"] == ["--profile", "gpu-llm-server"]
    llm_command = compose["services"]["llm"]["command"]
    for model in load_profiles(TRITON_REPOSITORY)["gpu-llm-server"].models:
        if model.source != "cosyvoice2":
            continue
        assert model.values["llm_urls"] == "http://llm:8000/v1"
        assert model.values["llm_api"] == "vllm"
        # trtllm-serve requires the request's model field; it serves the directory it was given.
        assert model.values["llm_served_model"] == llm_command[1]
        assert model.values["llm_dir"] == llm_command[1]


def test_gateway_waits_for_both_servers(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    assert gateway["environment"]["TTS_TRITON_URL"] == "triton:8001"
    assert {name: dep["condition"] for name, dep in gateway["depends_on"].items()} == {
        "triton": "service_healthy",
        "llm": "service_healthy",
    }
