"""Triton adapter for token2wav (flow + HiFT): speech tokens of one request -> 24 kHz audio.

Offline calls omit ``token_offset``/``finalize``. Streaming calls carry them and keep the
request's vocoder state under ``session_id``; a finalising call without tokens abandons
the session (its stream was cancelled).

Streaming state lives in this process, so every profile deploys exactly one instance:
with two, Triton would send a session's chunks to either process. Without batching
Triton hands an instance one request per ``execute``, so requests run one at a time here.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from tts_backends.cosyvoice2 import tensors
from tts_backends.cosyvoice2.frontend import VoicePrompt
from tts_backends.cosyvoice2.token2wav import Token2Wav

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config["parameters"].items()}
        self._name = args["model_name"]
        device = params["device"]
        if device == "cuda" and args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        self._token2wav = Token2Wav.from_model_dir(
            Path(params["model_dir"]),
            device=device,
            dtype=_DTYPES[params["dtype"]],
            n_timesteps=int(params["n_timesteps"]),
        )

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._answer(request) for request in requests]

    def _answer(self, request: Any) -> Any:
        try:
            arrays = {}
            for name in tensors.TOKEN2WAV_INPUT_DTYPES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    arrays[name] = tensor.as_numpy()
            waveform = self._convert(tensors.parse_token2wav_inputs(arrays))
        except tensors.TensorError as exc:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG))
        except Exception:
            pb_utils.Logger.log_error(f"{self._name}: conversion failed\n{traceback.format_exc()}")
            error = pb_utils.TritonError(
                f"model {self._name} failed; see the server log", pb_utils.TritonError.INTERNAL
            )
            return pb_utils.InferenceResponse(error=error)
        return pb_utils.InferenceResponse([pb_utils.Tensor(tensors.WAVEFORM_OUTPUT, waveform)])

    def _convert(self, call: tensors.Token2WavCall) -> np.ndarray:
        if call.token_offset is not None and call.finalize and call.speech_tokens.size == 0:
            self._token2wav.release(call.session_id)
            return np.zeros(0, dtype=np.float32)
        prompt = VoicePrompt(speech_tokens=call.prompt_speech_tokens, feats=call.prompt_feat, embedding=call.embedding)
        if call.token_offset is None:
            return self._token2wav.offline(call.speech_tokens, prompt, speed=call.speed)
        if call.speed != 1.0:
            raise tensors.TensorError("speed is applied offline only; stream at speed 1.0")
        return self._token2wav.stream_chunk(
            call.session_id, call.speech_tokens, prompt, call.token_offset, call.finalize
        )
