"""Dockerfile and docker-compose.yml: compose's own validation, then what the stack relies on.

There is no Docker engine here, so nothing is built or run; ``docker-compose config``
(installed by ``.ci/run``) validates the compose file against the compose schema.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tts_gateway.tools import model_prep

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.cosyvoice


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text(encoding="utf-8")


def test_compose_file_validates() -> None:
    command = ["docker-compose"] if shutil.which("docker-compose") else None
    if command is None:
        pytest.skip("docker-compose is not installed (.ci/run installs it)")
    result = subprocess.run([*command, "config", "-q"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_triton_service_reserves_a_gpu_and_reports_readiness(compose: dict[str, Any]) -> None:
    triton = compose["services"]["triton"]
    assert triton["build"]["target"] == "triton"
    (device,) = triton["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["count"] == 1
    assert triton["shm_size"]
    assert "http://localhost:8000/v2/health/ready" in triton["healthcheck"]["test"]
    assert "models:/models" in triton["volumes"]
    assert "models" in compose["volumes"]


def test_gateway_waits_for_triton_and_reaches_its_grpc_port(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    assert gateway["build"]["target"] == "gateway"
    assert gateway["depends_on"]["triton"]["condition"] == "service_healthy"
    assert gateway["environment"]["TTS_TRITON_URL"] == "triton:8001"
    assert any(v.startswith("voices:") for v in gateway["volumes"])
    assert any(str(port).endswith(":8080") for port in gateway["ports"])


def test_triton_image_is_pinned_and_its_entrypoint_is_a_valid_launch(dockerfile: str) -> None:
    images = re.findall(r"^ARG TRITON_IMAGE=(\S+)$", dockerfile, flags=re.M)
    assert images == ["nvcr.io/nvidia/tritonserver:25.06-trtllm-python-py3"]
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile, flags=re.M).group(1))  # type: ignore[union-attr]
    command = json.loads(re.search(r"^CMD (\[.*\])$", dockerfile, flags=re.M).group(1))  # type: ignore[union-attr]
    # `tts-models` is the package's console script for model_prep.main.
    assert entrypoint[0] == "tts-models"
    args = model_prep.parser().parse_args(entrypoint[1:] + command)
    assert args.command == "launch" and args.prepare
    assert args.profile == "gpu-trtllm"
    assert args.models_root == Path("/models")


def test_copied_paths_exist_and_requirements_are_pinned(dockerfile: str) -> None:
    for source in re.findall(r"^COPY (\S+) ", dockerfile, flags=re.M):
        assert (ROOT / source).exists(), source
    lines = (ROOT / "docker" / "triton-requirements.txt").read_text().splitlines()
    requirements = [line for line in lines if line and not line.startswith("#")]
    assert requirements and all(re.fullmatch(r"[A-Za-z0-9_.-]+(\[[a-z,]+\])?==[0-9][\w.]*", r) for r in requirements)
    assert not any(r.lower().startswith(("torch==", "transformers==")) for r in requirements)
