"""Triton adapter for the CosyVoice2 orchestrator: contract tensors in, ``waveform`` out.

The logic is :class:`tts_backends.cosyvoice2.pipeline.CosyVoice2Pipeline`; this file reads
the config, converts tensors and maps errors. Deployed as ``cosyvoice2`` (one response)
and ``cosyvoice2_stream`` (decoupled: one response per chunk, then the final flag).
"""

from __future__ import annotations

import json
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

from tts_backends import contract
from tts_backends.cosyvoice2 import vocab
from tts_backends.cosyvoice2.pipeline import CosyVoice2Pipeline, PipelineSettings
from tts_backends.cosyvoice2.triton_stages import StageModels, TritonStages
from tts_backends.request_parsing import ContractError, parse_speech_request

SAMPLE_RATE = 24_000


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config["parameters"].items()}
        if int(params[contract.PARAM_SAMPLE_RATE]) != SAMPLE_RATE:
            raise ValueError(f"CosyVoice2 produces {SAMPLE_RATE} Hz; config says {params['sample_rate']}")
        self._name = args["model_name"]
        self._inputs = [spec["name"] for spec in config["input"]]
        tokenizer = AutoTokenizer.from_pretrained(params["llm_dir"])
        vocab.check_tokenizer_layout(tokenizer)
        stages = TritonStages(
            StageModels(
                llm=params["llm_model"],
                audio_tokenizer=params["audio_tokenizer_model"],
                speaker_embedding=params["speaker_embedding_model"],
                token2wav=params["token2wav_model"],
            )
        )
        self._pipeline = CosyVoice2Pipeline(stages, tokenizer, PipelineSettings.from_parameters(params))
        self._stopping = threading.Event()
        self._pool: ThreadPoolExecutor | None = None
        if pb_utils.using_decoupled_model_transaction_policy(config):
            # Streams run on threads so that one long request does not hold up the next;
            # the models they call do the heavy work in their own processes.
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=self._name)

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if self._pool is None:
            return [self._answer(request) for request in requests]
        for request in requests:
            self._pool.submit(self._stream, request, request.get_response_sender())
        return None

    def finalize(self) -> None:
        if self._pool is not None:
            self._stopping.set()
            self._pool.shutdown(wait=True)

    def _answer(self, request: Any) -> Any:
        try:
            chunks = list(self._synthesize(request, request.is_cancelled))
        except Exception as exc:
            return pb_utils.InferenceResponse(error=self._error(exc))
        if request.is_cancelled():
            return pb_utils.InferenceResponse(error=pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED))
        waveform = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
        return pb_utils.InferenceResponse([pb_utils.Tensor(contract.WAVEFORM, waveform)])

    def _stream(self, request: Any, sender: Any) -> None:
        def cancelled() -> bool:
            return self._stopping.is_set() or sender.is_cancelled()

        try:
            for chunk in self._synthesize(request, cancelled):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(contract.WAVEFORM, chunk)]))
        except Exception as exc:
            sender.send(pb_utils.InferenceResponse(error=self._error(exc)))
        finally:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _synthesize(self, request: Any, cancelled: Callable[[], bool]) -> Any:
        tensors = {}
        for name in self._inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                tensors[name] = tensor.as_numpy()
        speech = parse_speech_request(tensors)
        return self._pipeline.synthesize(speech, streaming=self._pool is not None, is_cancelled=cancelled)

    def _error(self, exc: Exception) -> Any:
        if isinstance(exc, ContractError):
            return pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
        pb_utils.Logger.log_error(f"{self._name}: synthesis failed\n{traceback.format_exc()}")
        return pb_utils.TritonError(f"model {self._name} failed; see the server log", pb_utils.TritonError.INTERNAL)
