"""Triton adapter for the CAM++ ONNX model: 16 kHz reference -> 192-d speaker embedding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils

from tts_gateway.allocator import keep_tensors_in_heap
from tts_gateway.models import contract
from tts_gateway.models.cosyvoice2 import tensors
from tts_gateway.models.cosyvoice2.model.frontend import SpeakerEmbedder
from tts_gateway.models.triton_logging import enable_stack_dumps


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        enable_stack_dumps()
        keep_tensors_in_heap()
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        providers = contract.parse_list(params["providers"])
        self._embedder = SpeakerEmbedder(Path(params["model_dir"]) / params["onnx_file"], list(providers))

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                wav = tensors.parse_reference_inputs(_inputs(request))
                embedding = self._embedder.embed(wav)
            except ValueError as exc:
                responses.append(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG))
                )
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(tensors.SPEAKER_EMBEDDING_OUTPUT, embedding)]))
        return responses


def _inputs(request: Any) -> dict[str, Any]:
    return {
        name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in tensors.REFERENCE_INPUT_DTYPES
    }
