"""Triton adapter for Piper: contract tensors in, ``waveform`` out; the logic is in tts_backends."""

from __future__ import annotations

import json
import threading
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from numpy.typing import NDArray

from tts_backends import contract
from tts_backends.piper import PiperEngine
from tts_backends.request_parsing import ContractError, parse_speech_request


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config["parameters"].items()}
        self._name = args["model_name"]
        self._inputs = [spec["name"] for spec in config["input"]]
        self._engine = PiperEngine(
            Path(params["voice_model"]) if params["voice_model"] else None,
            Path(params["voice_config"]) if params["voice_config"] else None,
        )
        declared = int(params[contract.PARAM_SAMPLE_RATE])
        if self._engine.sample_rate != declared:
            raise ValueError(f"the voice runs at {self._engine.sample_rate} Hz, config says {declared}")
        self._stopping = threading.Event()
        self._pool: ThreadPoolExecutor | None = None
        if pb_utils.using_decoupled_model_transaction_policy(config):
            workers = int(params["stream_workers"])
            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self._name)

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if self._pool is None:
            return [self._answer(request) for request in requests]
        # Streams run on the pool so that one long text does not hold up the requests behind it.
        for request in requests:
            self._pool.submit(self._stream, request, request.get_response_sender())
        return None

    def finalize(self) -> None:
        if self._pool is not None:
            # Running and queued streams stop at their next sentence, each with a final response.
            self._stopping.set()
            self._pool.shutdown(wait=True)

    def _answer(self, request: Any) -> Any:
        try:
            chunks = list(self._synthesize(request))
        except Exception as exc:
            return pb_utils.InferenceResponse(error=self._error(exc))
        if request.is_cancelled():
            return pb_utils.InferenceResponse(error=pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED))
        waveform = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
        return pb_utils.InferenceResponse([pb_utils.Tensor(contract.WAVEFORM, waveform)])

    def _stream(self, request: Any, sender: Any) -> None:
        try:
            for chunk in self._synthesize(request):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(contract.WAVEFORM, chunk)]))
        except Exception as exc:
            sender.send(pb_utils.InferenceResponse(error=self._error(exc)))
        finally:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _synthesize(self, request: Any) -> Iterator[NDArray[np.float32]]:
        """One chunk per sentence; each sentence is synthesised only if the request still stands."""
        tensors = {}
        for name in self._inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                tensors[name] = tensor.as_numpy()
        speech = parse_speech_request(tensors)
        chunks = self._engine.synthesize(speech.target_text, speed=speech.speed)
        while not self._interrupted(request):
            chunk = next(chunks, None)
            if chunk is None:
                return
            yield chunk

    def _interrupted(self, request: Any) -> bool:
        """True once the client cancelled; raises _Unloading once the model is being unloaded."""
        if self._stopping.is_set():
            raise _Unloading
        if request.is_cancelled():
            pb_utils.Logger.log_info(f"{self._name}: request {request.request_id()!r} cancelled")
            return True
        return False

    def _error(self, exc: Exception) -> Any:
        if isinstance(exc, ContractError):
            return pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
        if isinstance(exc, _Unloading):
            return pb_utils.TritonError(f"model {self._name} is unloading", pb_utils.TritonError.UNAVAILABLE)
        pb_utils.Logger.log_error(f"{self._name}: synthesis failed\n{traceback.format_exc()}")
        return pb_utils.TritonError(f"model {self._name} failed; see the server log", pb_utils.TritonError.INTERNAL)


class _Unloading(Exception):
    """The model is being unloaded: stop synthesising."""
