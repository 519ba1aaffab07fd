"""Triton adapter for token2wav (flow + HiFT): speech tokens -> 24 kHz audio, batched across requests.

Offline calls omit ``token_offset``/``finalize``. Streaming calls carry them and keep the
request's vocoder state under ``session_id``; a finalising call without tokens abandons
the session (its stream was cancelled).

Triton's dynamic batcher hands ``execute`` every call that queued while the previous batch
ran; :meth:`Token2Wav.convert` converts them together, streams' first chunks first, and each
call is answered (through its response sender) as soon as its audio exists, so that a stream's
first chunk does not wait for the longer calls of its batch. Streaming state lives in this process,
so every profile deploys exactly one instance: with two, Triton would send a session's chunks
to either process.
"""

from __future__ import annotations

import json
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from tts_backends.cosyvoice2 import tensors
from tts_backends.cosyvoice2.frontend import VoicePrompt
from tts_backends.cosyvoice2.gpu_turns import GpuTurns
from tts_backends.cosyvoice2.token2wav import Conversion, Token2Wav
from tts_backends.stage_trace import StageTrace

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
            graph_rows=int(params["graph_rows"]),
            graph_frames=int(params["graph_frames"]),
            prefix_cache_mb=int(params["prefix_cache_mb"]),
            prefix_frames=int(params["prefix_frames"]),
            hift_graph_rows=int(params["hift_graph_rows"]),
            hift_graph_hops=[int(hop) for hop in params["hift_graph_hops"].split(",") if hop.strip()],
        )
        self._trace = StageTrace.from_env("token2wav")
        # Marks first chunks on the GPU, so that the LLM's process leaves it to them (gpu_turns.py).
        gpu = torch.device(device)
        self._turns = GpuTurns.of_server(gpu.index or 0) if gpu.type == "cuda" else None
        self._turn_slot = int(args.get("model_instance_device_id", 0) or 0)
        self._token2wav.sync_timing = self._trace.enabled

    def execute(self, requests: list[Any]) -> None:
        """Answers every request through its response sender, each as soon as its audio exists."""
        started = time.monotonic()
        senders = [request.get_response_sender() for request in requests]

        def answer(index: int, response: Any) -> None:
            try:
                senders[index].send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:
                pb_utils.Logger.log_error(f"{self._name}: sending a response failed\n{traceback.format_exc()}")

        calls: list[tuple[int, Conversion]] = []
        for index, request in enumerate(requests):
            try:
                call = tensors.parse_token2wav_inputs(_arrays(request))
                if call.token_offset is not None and call.speed != 1.0:
                    raise tensors.TensorError("speed is applied offline only; stream at speed 1.0")
            except tensors.TensorError as exc:
                answer(index, _error(str(exc), pb_utils.TritonError.INVALID_ARG))
                continue
            if call.token_offset is not None and call.finalize and call.speech_tokens.size == 0:
                self._token2wav.release(call.session_id)
                answer(index, _waveform(np.zeros(0, dtype=np.float32)))
                continue
            prompt = VoicePrompt(
                speech_tokens=call.prompt_speech_tokens, feats=call.prompt_feat, embedding=call.embedding
            )
            conversion = Conversion(
                call.session_id, call.speech_tokens, prompt, call.token_offset, call.finalize, call.speed
            )
            calls.append((index, conversion))
        if not calls:
            return None
        answered: set[int] = set()

        def on_result(position: int, result: np.ndarray | Exception) -> None:
            index, call = calls[position]
            if isinstance(result, ValueError):
                answer(index, _error(str(result), pb_utils.TritonError.INVALID_ARG))
            elif isinstance(result, Exception):
                answer(index, _error(f"model {self._name} failed: {result}", pb_utils.TritonError.INTERNAL))
            else:
                answer(index, _waveform(result))
            answered.add(position)
            if not isinstance(result, Exception):
                self._record(call, started, rows=len(calls))

        first_chunk = any(call.token_offset == 0 for _, call in calls)
        holding = self._turns.hold(self._turn_slot) if self._turns is not None and first_chunk else nullcontext()
        try:
            with holding:
                self._token2wav.convert([call for _, call in calls], on_result)
        except Exception:
            pb_utils.Logger.log_error(f"{self._name}: conversion failed\n{traceback.format_exc()}")
            failure = f"model {self._name} failed; see the server log"
            for position, (index, _) in enumerate(calls):
                if position not in answered:
                    answer(index, _error(failure, pb_utils.TritonError.INTERNAL))
        return None

    def finalize(self) -> None:
        # Whichever of the two processes ends last leaves no file behind (removing is idempotent).
        if self._turns is not None:
            self._turns.remove()

    def _record(self, call: Conversion, started: float, *, rows: int) -> None:
        """Trace one answered call: its group's flow and HiFT time (``last_timing`` holds that group's)."""
        if not self._trace.enabled:
            return
        timing = self._token2wav.last_timing
        self._trace.record(
            call.session_id,
            offset=-1 if call.token_offset is None else call.token_offset,
            started=started,
            ended=time.monotonic(),
            rows=rows,
            group_rows=timing.get("rows", 0.0),
            flow_s=timing.get("flow_s", 0.0),
            hift_s=timing.get("hift_s", 0.0),
        )


def _arrays(request: Any) -> dict[str, Any]:
    arrays = {}
    for name in tensors.TOKEN2WAV_INPUT_DTYPES:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy()
    return arrays


def _waveform(samples: np.ndarray) -> Any:
    return pb_utils.InferenceResponse([pb_utils.Tensor(tensors.WAVEFORM_OUTPUT, samples.reshape(1, -1))])


def _error(message: str, code: Any) -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
