"""The LLM stage over the gRPC endpoint of the Triton server the orchestrator runs in.

Why not a decoupled BLS request: Triton 2.51's Python backend stub can deadlock when several
threads of one model read decoupled BLS streams (found with ``benchmarks/bls_stream_soak.py``,
confirmed by the stub's native stacks). A thread waking in the response iterator holds the
iterator's lock while it waits for the GIL; the stub's response thread holds the iterator map's
lock while it waits for that iterator's lock; and a thread opening a new stream holds the GIL
while it waits for the map's lock. Every stream of the process then stops for good, which is how
one GPU benchmark run hung. The gRPC client takes none of those locks, and a stream left early
is cancelled in the server, so the LLM drops the request at its next step (BLS streams could not
be cancelled before Triton 24.11).

One gRPC stream per generation, on a client taken from a pool (a channel and its connection are
reused; a stream's handler thread is not).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tts_backends import contract
from tts_backends.cosyvoice2 import tensors
from tts_backends.cosyvoice2.pipeline import LLMRequest
from tts_backends.request_parsing import BackendUnavailableError, ContractError


class LLMStageError(RuntimeError):
    """The LLM model answered with an error that is not the caller's."""


def own_grpc_url() -> str:
    """Where this server serves gRPC: set by whoever started it, else Triton's default port."""
    return os.environ.get(contract.OWN_GRPC_URL_ENV) or "127.0.0.1:8001"


class TritonLLMStreams:
    """:meth:`generate` of the pipeline's ``Stages`` for an LLM model with the TensorRT-LLM backend's tensors."""

    def __init__(self, url: str, model: str, *, max_idle: int) -> None:
        self._url = url
        self._model = model
        self._max_idle = max_idle
        self._idle: list[grpcclient.InferenceServerClient] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for client in idle:
            client.close()

    def generate(self, request: LLMRequest, is_cancelled: Callable[[], bool]) -> Generator[Sequence[int], None, None]:
        """LLM ids in pieces as the server streams them; closing this cancels the request in the server."""
        client = self._lease()
        answers: queue.SimpleQueue[tuple[Any, InferenceServerException | None]] = queue.SimpleQueue()
        finished = False
        try:
            client.start_stream(callback=lambda result, error: answers.put((result, error)))
            client.async_stream_infer(
                self._model,
                _inputs(tensors.llm_inputs(request)),
                request_id=request.request_id,
                outputs=[grpcclient.InferRequestedOutput(name) for name in tensors.LLM_OUTPUT_DTYPES],
                enable_empty_final_response=True,
            )
            while not finished:
                result, error = answers.get()
                if error is not None:
                    raise _stage_error(self._model, error)
                finished = result.get_response().parameters["triton_final_response"].bool_param
                output_ids = result.as_numpy("output_ids")
                if output_ids is not None:
                    yield tensors.parse_llm_outputs(output_ids, result.as_numpy("sequence_length"))
        finally:
            self._give_back(client, cancel=not finished)

    def _lease(self) -> grpcclient.InferenceServerClient:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return grpcclient.InferenceServerClient(self._url)

    def _give_back(self, client: grpcclient.InferenceServerClient, *, cancel: bool) -> None:
        """End the stream (cancelling its request if it has not finished) and keep the client for the next one."""
        try:
            client.stop_stream(cancel_requests=cancel)
        except InferenceServerException:
            client.close()
            return
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append(client)
                return
        client.close()


def _inputs(arrays: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), tensors.LLM_INPUT_DTYPES[name])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _stage_error(model: str, error: InferenceServerException) -> Exception:
    """The caller's fault (``[INVALID_ARG]``, see the LLM model), the server's absence, or the model's failure."""
    message = error.message() or str(error)
    if message.startswith(contract.INVALID_ARG_PREFIX):
        return ContractError(message.removeprefix(contract.INVALID_ARG_PREFIX).strip())
    if str(error.status()) == "StatusCode.UNAVAILABLE" or "failed to connect" in message.lower():
        return BackendUnavailableError(f"{model} over gRPC: {message}")
    return LLMStageError(f"{model}: {message}")
