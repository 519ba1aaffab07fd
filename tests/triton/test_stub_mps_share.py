"""A model's ``mps_active_thread_percentage`` reaches its own stub process's environment before the model loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.models.mps_share import VARIABLE

pytestmark = pytest.mark.triton

MODEL = f"""
import os

import numpy as np
import triton_python_backend_utils as pb_utils

from tts_gateway.models.triton_model import TritonModel


class TritonPythonModel(TritonModel):
    def setup(self, params):
        # What the model would load CUDA with.
        self.seen = os.environ.get("{VARIABLE}", "-1")

    def execute(self, requests):
        value = np.array([float(self.seen)], np.float32)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", value)]) for _ in requests]
"""


def write_model(repository: Path, name: str, share: str | None) -> None:
    (repository / name / "1").mkdir(parents=True)
    value = f'value: {{ string_value: "{share}" }}'
    parameter = "" if share is None else f'parameters {{ key: "mps_active_thread_percentage", {value} }}\n'
    (repository / name / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "x", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "y", data_type: TYPE_FP32, dims: [ 1 ] } ]\n' + parameter
    )
    (repository / name / "1" / "model.py").write_text(MODEL)


def seen(server: EmbeddedTriton, model: str) -> float:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        x = grpcclient.InferInput("x", [1], "FP32")
        x.set_data_from_numpy(np.zeros(1, np.float32))
        y = client.infer(model, [x]).as_numpy("y")
    assert y is not None
    return float(y[0])


def test_each_model_process_gets_its_own_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    models = tmp_path / "models"
    write_model(models, "held", "80")
    write_model(models, "whole", "100")
    write_model(models, "unset", None)
    with EmbeddedTriton(models, workdir=tmp_path / "work") as server:
        assert (seen(server, "held"), seen(server, "whole"), seen(server, "unset")) == (80.0, 100.0, -1.0)
        log = server.log_path.read_text(errors="replace")
    assert "kernels held to 80 % of the GPU's multiprocessors under CUDA MPS" in log
    assert "comes too late" not in log
