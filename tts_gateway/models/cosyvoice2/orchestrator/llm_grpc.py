"""The LLM stage over the gRPC endpoint of the Triton server the orchestrator runs in.

Why not a decoupled BLS request: Triton 2.51's Python backend stub can deadlock when several
threads of one model read decoupled BLS streams (found with ``benchmarks/llm_stream_soak.py``,
confirmed by the stub's native stacks). A thread waking in the response iterator holds the
iterator's lock while it waits for the GIL; the stub's response thread holds the iterator map's
lock while it waits for that iterator's lock; and a thread opening a new stream holds the GIL
while it waits for the map's lock. Every stream of the process then stops for good. The gRPC
client takes none of those locks, and a stream left early is cancelled in the server, so the LLM
drops the request at its next step (2.51's BLS stream has no cancel).

One streaming call per generation on one shared channel, made with the service stubs tritonclient
ships: the call carries its single request (the request side closes at once, so no thread waits on
it) and its responses are read on the caller's thread. ``InferenceServerClient.stop_stream`` was not
used because, cancelling, it leaves gRPC's request-reading thread blocked for good: one thread
leaked per cancelled stream (8,800 after 38,400 streams in the soak, until the process stalled).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Sequence
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor

from tts_gateway.models import contract
from tts_gateway.models.cosyvoice2 import tensors
from tts_gateway.models.cosyvoice2.orchestrator.pipeline import LLMRequest, TextPiece
from tts_gateway.models.request_parsing import ContractError, DependencyUnavailableError

_DTYPES = {**tensors.LLM_INPUT_DTYPES, **tensors.TEXT_STREAM_INPUT_DTYPES}


class LLMStageError(RuntimeError):
    """The LLM model answered with an error that is not the caller's."""


def own_grpc_url() -> str:
    """Where this server serves gRPC: set by whoever started it, else Triton's default port."""
    return os.environ.get(contract.OWN_GRPC_URL_ENV) or "127.0.0.1:8001"


class TritonLLMStreams:
    """:meth:`generate` of the pipeline's ``Stages`` for an LLM model with the TensorRT-LLM backend's tensors."""

    def __init__(self, url: str, model: str) -> None:
        self._model = model
        # Never through an HTTP proxy from the environment: the server is this machine (or this pod).
        self._channel = grpc.insecure_channel(url, options=[("grpc.enable_http_proxy", 0)])
        self._service = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def generate(self, request: LLMRequest, is_cancelled: Callable[[], bool]) -> Generator[Sequence[int], None, None]:
        """LLM ids in pieces as the server streams them; closing this early cancels the request in the server."""
        call = self._service.ModelStreamInfer(iter([_infer_request(self._model, request)]))
        ended = False
        try:
            for answer in call:
                if answer.error_message:
                    ended = True  # a decoupled model's error is its last response
                    raise _stage_error(self._model, answer.error_message)
                ended = answer.infer_response.parameters["triton_final_response"].bool_param
                result = InferResult(answer.infer_response)
                output_ids = result.as_numpy("output_ids")
                if output_ids is not None:
                    yield tensors.parse_llm_outputs(output_ids, result.as_numpy("sequence_length"))
                if ended:
                    return
        except grpc.RpcError as exc:
            ended = True
            raise _transport_error(self._model, exc) from exc
        finally:
            if ended:
                # The server closes the call once its one request is answered; a cancel meeting that
                # completion can crash Triton 2.51's server, so it is only read to its end.
                _read_to_end(call)
            else:
                call.cancel()

    def send_text(self, piece: TextPiece) -> None:
        """Pass a piece of text (or its end, or a cancel) to an open text stream; returns once it is taken."""
        message = service_pb2.ModelInferRequest(model_name=self._model, id=piece.stream_id)
        for name, array in tensors.text_piece_inputs(piece).items():
            message.inputs.add(name=name, datatype=tensors.TEXT_STREAM_INPUT_DTYPES[name], shape=list(array.shape))
            message.raw_input_contents.append(_raw(array))
        try:
            for answer in self._service.ModelStreamInfer(iter([message])):
                if answer.error_message:
                    raise _stage_error(self._model, answer.error_message)
        except grpc.RpcError as exc:
            raise _transport_error(self._model, exc) from exc


def _raw(array: Any) -> bytes:
    """A tensor's bytes as Triton's raw contents want them (strings length-prefixed)."""
    if array.dtype == np.object_:
        return bytes(serialize_byte_tensor(array).item())
    return np.ascontiguousarray(array).tobytes()


def _read_to_end(call: Any) -> None:
    try:
        for _ in call:
            pass
    except grpc.RpcError:
        pass


def _infer_request(model: str, request: LLMRequest) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name=model, id=request.request_id)
    message.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, array in tensors.llm_inputs(request).items():
        message.inputs.add(name=name, datatype=_DTYPES[name], shape=list(array.shape))
        message.raw_input_contents.append(_raw(array))
    for name in tensors.LLM_OUTPUT_DTYPES:
        message.outputs.add(name=name)
    return message


def _stage_error(model: str, message: str) -> Exception:
    """The caller's fault (led by ``[INVALID_ARG]``, see the LLM model) or the model's failure.

    Over a gRPC stream an error is a message only: the TensorRT-LLM backend's invalid arguments,
    which carry no such lead, become the model's failures here (500, not 400).
    """
    if message.startswith(contract.INVALID_ARG_PREFIX):
        return ContractError(message.removeprefix(contract.INVALID_ARG_PREFIX).strip())
    return LLMStageError(f"{model}: {message}")


def _transport_error(model: str, exc: grpc.RpcError) -> Exception:
    """The server gone or going away (503), or a failure of the call itself."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    message = f"{model} over gRPC: {code}: {exc.details() if isinstance(exc, grpc.Call) else exc}"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
        return DependencyUnavailableError(message)
    return LLMStageError(message)
