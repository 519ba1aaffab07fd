"""Triton adapter for the CosyVoice2 speech LLM on PyTorch, speaking the TensorRT-LLM backend's tensors.

Decoupled: with ``streaming`` one response per generated id, otherwise one response with
all of them; then the final flag. Each request generates on its own thread, so requests
overlap; a cancelled request stops at its next token.
"""

from __future__ import annotations

import json
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils

from tts_backends.cosyvoice2 import tensors, vocab
from tts_backends.cosyvoice2.llm import SamplingParams, TorchSpeechLLM


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config["parameters"].items()}
        self._name = args["model_name"]
        self._llm = TorchSpeechLLM(Path(params["llm_dir"]), device=params["device"], dtype=params["dtype"])
        self._stopping = threading.Event()
        workers = int(params["max_concurrency"])
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self._name)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            self._pool.submit(self._generate, request, request.get_response_sender())

    def finalize(self) -> None:
        self._stopping.set()
        self._pool.shutdown(wait=True)

    def _generate(self, request: Any, sender: Any) -> None:
        try:
            arrays = {}
            for name in tensors.LLM_INPUT_DTYPES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    arrays[name] = tensor.as_numpy()
            call = tensors.parse_llm_inputs(arrays)
            sampling = SamplingParams(
                temperature=call.temperature,
                top_p=call.top_p,
                top_k=call.top_k,
                repetition_penalty=call.repetition_penalty,
                seed=call.seed,
            )
            stops = set(vocab.STOP_IDS)
            if call.end_id is not None and vocab.id_to_speech_token(call.end_id) is None:
                stops.add(call.end_id)
            ids = self._llm.generate(
                call.input_ids,
                sampling,
                max_new_tokens=call.max_new_tokens,
                min_new_tokens=call.min_new_tokens,
                stop_ids=sorted(stops),
            )
            produced = []
            for token in ids:
                if self._stopping.is_set() or sender.is_cancelled():
                    return
                if call.streaming:
                    sender.send(_response([token]))
                else:
                    produced.append(token)
            if not call.streaming:
                sender.send(_response(produced))
        except ValueError as exc:
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG))
            )
        except Exception:
            pb_utils.Logger.log_error(f"{self._name}: generation failed\n{traceback.format_exc()}")
            error = pb_utils.TritonError(
                f"model {self._name} failed; see the server log", pb_utils.TritonError.INTERNAL
            )
            sender.send(pb_utils.InferenceResponse(error=error))
        finally:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _response(ids: list[int]) -> Any:
    return pb_utils.InferenceResponse(
        [pb_utils.Tensor(name, array) for name, array in tensors.llm_outputs(ids).items()]
    )
