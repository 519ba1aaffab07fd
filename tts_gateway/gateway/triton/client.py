"""Async, binary access to Triton over gRPC for the speech contract.

One gRPC channel serves every request: offline calls use ``ModelInfer``, streaming
calls open a ``ModelStreamInfer`` stream per request whose responses are the audio
chunks of a decoupled model, and so do a text-streaming session's requests (its audio, and
each piece of its text). Tensors travel as raw bytes, never JSON lists.
Every speech call is bounded by ``timeout``; a stream is also given up when its next response
takes longer than ``chunk_timeout``, so a stalled model is noticed within seconds. A session
lasts as long as its client sends text: its caller bounds its waits.
Cancelling the async iterator of :meth:`TritonClient.stream` cancels the gRPC call,
which Triton forwards to the model (``request.is_cancelled()``).

tritonclient's exceptions are translated here, once, into gateway errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from numpy.typing import NDArray
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from tts_gateway.gateway.errors import (
    GatewayError,
    InvalidRequestError,
    ModelUnavailableError,
    RateLimitError,
    ServerTimeoutError,
    ServerUnavailableError,
    SynthesisError,
)
from tts_gateway.models import contract

logger = logging.getLogger(__name__)

# Passing channel arguments replaces tritonclient's, so its message-size limits are repeated here.
# gRPC's reconnect backoff grows to 2 minutes by default: after Triton restarts the gateway
# would stay unavailable for up to that long. Capped, it reconnects within about a second.
# Each stream's receive window is fixed at 1 MiB (BDP probing off): audio arrives far below what
# that carries even across a WAN, and what a slow client has not read stays bounded in Triton
# rather than in the gateway (probing grew the window to several MiB per stream under load).
_CHANNEL_ARGS = [
    ("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
    ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 1 << 20),
]
# Triton's sequence batcher refusing a request of a sequence it does not hold (never started, ended,
# or released after its idle time).
_SEQUENCE_NOT_HELD: Final = "must specify the START flag on the first request of the sequence"
# ...and an opening request of a sequence that waited longer than its timeout for a place.
_NO_PLACE: Final = "timeout of the corresponding sequence has been expired"
_UNAVAILABLE_STATUSES = ("StatusCode.UNAVAILABLE", "StatusCode.CANCELLED", "StatusCode.UNKNOWN")


@dataclass(frozen=True)
class TritonModelConfig:
    """What the gateway needs to know of one deployed model."""

    name: str
    inputs: frozenset[str]
    decoupled: bool
    parameters: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SequenceFlags:
    """A request's place in a Triton sequence (its correlation id and flags).

    A text-streaming model keeps each session in one of its instances; Triton's sequence batcher
    sends every request of a sequence to the instance its first request went to, so a session's
    requests carry its id as the correlation id, the opening request ``start`` and the session's
    last request ``end`` (which frees the sequence's slot in the batcher).
    """

    id: str
    start: bool = False
    end: bool = False


def translate_error(exc: InferenceServerException | grpc.RpcError, model: str) -> GatewayError:
    """Map a tritonclient or raw gRPC error to the gateway error a client should see.

    tritonclient wraps most failures, but a stream whose connection breaks raises gRPC's own error.
    """
    if isinstance(exc, InferenceServerException):
        status = str(exc.status() or "")
        message = exc.message() or str(exc)
    else:
        # grpc.aio's errors carry a status too, but are not grpc.Call objects.
        call = exc if isinstance(exc, grpc.Call | grpc.aio.AioRpcError) else None
        status = str(call.code()) if call is not None else ""
        message = (call.details() if call is not None else None) or str(exc)
    # Errors of decoupled models arrive as a message only; the contract models lead it with their code.
    code, _, rest = message.partition("] ") if message.startswith("[") else ("", "", message)
    if _NO_PLACE in message:
        return RateLimitError(
            f"model {model!r} holds as many sessions as it can; none ended in time to make room", retry_after=5
        )
    if _SEQUENCE_NOT_HELD in message:
        return InvalidRequestError(
            f"model {model!r} has no open session for this request: never opened, ended, or idle too long",
            code="no_open_session",
        )
    if status == "StatusCode.INVALID_ARGUMENT" or code == "[INVALID_ARG":
        return InvalidRequestError(f"model {model!r} rejected the request: {rest}", code="backend_rejected")
    if code == "[UNAVAILABLE":
        return ModelUnavailableError(f"model {model!r} is unavailable: {rest}")
    if status == "StatusCode.DEADLINE_EXCEEDED" or "Deadline Exceeded" in message:
        return ServerTimeoutError(f"model {model!r} did not answer in time")
    if status in _UNAVAILABLE_STATUSES or "failed to connect" in message.lower():
        return ServerUnavailableError("the Triton server is unavailable")
    return SynthesisError(f"model {model!r} failed: {message}")


def build_inputs(values: Mapping[str, Any]) -> list[InferInput]:
    """Turn contract input values into binary gRPC tensors (see ``tts_gateway.models.contract``)."""
    tensors: list[InferInput] = []
    for name, value in values.items():
        dtype = contract.INPUT_DTYPES[name]
        array: NDArray[Any]
        if dtype == "BYTES":
            array = np.array([str(value).encode("utf-8")], dtype=np.object_)
        elif isinstance(value, np.ndarray):
            array = np.ascontiguousarray(value, dtype=_NUMPY_DTYPES[dtype])
        else:
            array = np.array([value], dtype=_NUMPY_DTYPES[dtype])
        tensor = InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


_NUMPY_DTYPES: dict[str, type[np.generic]] = {
    "BOOL": np.bool_,
    "FP32": np.float32,
    "INT32": np.int32,
    "INT64": np.int64,
}


_PROBE_TIMEOUT_S: Final = 2.0


class Readiness(enum.Enum):
    """What one readiness probe learned of a server."""

    READY = "ready"
    NOT_READY = "not ready"
    """It answered that it is not ready, or refused the connection (not running)."""
    SILENT = "no answer in time"
    """Busy (a CPU server converting speech can keep its gRPC threads waiting past the probe's timeout) or hung:
    one probe cannot tell which."""


class TritonClient:
    def __init__(self, url: str, *, timeout: float, chunk_timeout: float | None = None) -> None:
        self.url = url
        self._timeout = timeout
        self._chunk_timeout = chunk_timeout
        self._client = grpcclient.InferenceServerClient(url, channel_args=_CHANNEL_ARGS)

    async def close(self) -> None:
        await self._client.close()

    async def readiness(self) -> Readiness:
        """Probe the server once (:class:`Readiness`)."""
        try:
            ready = await self._client.is_server_ready(client_timeout=_PROBE_TIMEOUT_S)
        except InferenceServerException as exc:
            timed_out = isinstance(translate_error(exc, "<readiness>"), ServerTimeoutError)
            return Readiness.SILENT if timed_out else Readiness.NOT_READY
        return Readiness.READY if ready else Readiness.NOT_READY

    async def model_configs(self) -> list[TritonModelConfig]:
        """Configs of every READY model in the repository."""
        try:
            index = await self._client.get_model_repository_index(as_json=True, client_timeout=5.0)
            names = [m["name"] for m in index.get("models", []) if m.get("state") == "READY"]
            configs = await asyncio.gather(
                *(self._client.get_model_config(n, as_json=True, client_timeout=5.0) for n in names)
            )
        except InferenceServerException as exc:
            raise translate_error(exc, "<repository>") from exc
        return [_parse_config(c["config"]) for c in configs]

    async def infer(self, model: str, values: Mapping[str, Any], request_id: str) -> NDArray[np.float32]:
        """One offline call; returns the whole waveform."""
        try:
            result = await self._client.infer(
                model,
                build_inputs(values),
                request_id=request_id,
                outputs=[grpcclient.InferRequestedOutput(contract.WAVEFORM)],
                client_timeout=self._timeout,
            )
        except (InferenceServerException, grpc.RpcError) as exc:
            raise translate_error(exc, model) from exc
        return _waveform(result)

    async def stream(
        self, model: str, values: Mapping[str, Any], request_id: str
    ) -> AsyncGenerator[NDArray[np.float32], None]:
        """Chunks of a decoupled model, in order; leaving the iterator early cancels the request."""
        responses = self._responses(
            self._request(model, values, request_id), self._timeout, self._chunk_timeout, until_final=False
        )
        async with contextlib.aclosing(responses):
            async for chunk in responses:
                if chunk.size:
                    yield chunk

    def session_audio(
        self, model: str, values: Mapping[str, Any], request_id: str, session: str, place_wait_s: float
    ) -> AsyncGenerator[NDArray[np.float32], None]:
        """The audio of the text-streaming session that ``values`` open: every response's waveform, the
        first (empty: the session is open) included, until the last. No time limit: a session waits for
        its text as long as its client takes to send it. Leaving the iterator early cancels the session's
        request. ``session`` starts the Triton sequence that routes the session's requests (see
        :class:`SequenceFlags`); the request waits at most ``place_wait_s`` for a place in it."""
        sequence = SequenceFlags(session, start=True)
        request = self._request(model, values, request_id, sequence)
        # Triton's request timeout, in microseconds, bounds its wait in the sequence batcher's backlog.
        request["timeout"] = round(place_wait_s * 1e6)
        return self._responses(request, None, None, until_final=True)

    async def session_call(
        self, model: str, values: Mapping[str, Any], request_id: str, session: str, *, last: bool = False
    ) -> None:
        """One request to an open session (a piece of its text, its end, its close) on a stream of its
        own; returns once the model has answered it. The caller bounds the wait. ``last`` ends the
        session's Triton sequence: no request of the session may follow."""
        calls = self._responses(
            self._request(model, values, request_id, SequenceFlags(session, end=last)), None, None, until_final=False
        )
        async with contextlib.aclosing(calls) as responses:
            async for _ in responses:
                pass

    @staticmethod
    def _request(
        model: str, values: Mapping[str, Any], request_id: str, sequence: SequenceFlags | None = None
    ) -> dict[str, Any]:
        """One request of a gRPC stream, as ``stream_infer`` takes it."""
        request: dict[str, Any] = {"model_name": model, "inputs": build_inputs(values), "request_id": request_id}
        if sequence is not None:
            request |= {"sequence_id": sequence.id, "sequence_start": sequence.start, "sequence_end": sequence.end}
        return request

    async def _responses(
        self,
        request: Mapping[str, Any],
        stream_timeout: float | None,
        chunk_timeout: float | None,
        *,
        until_final: bool,
    ) -> AsyncGenerator[NDArray[np.float32], None]:
        """The waveform of every response to ``request`` (:meth:`_request`) on a stream of its own, until
        the stream ends (or, ``until_final``, at the response flagged final: a session's reader is done
        there); ``chunk_timeout`` bounds the wait for each response."""
        model = str(request["model_name"])

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield dict(request)

        responses = self._client.stream_infer(one_request(), stream_timeout=stream_timeout)
        finished = False
        try:
            while True:
                try:
                    async with asyncio.timeout(chunk_timeout):
                        result, error = await anext(responses)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise ServerTimeoutError(f"model {model!r} sent nothing for {chunk_timeout:g} s") from None
                if error is not None:
                    raise translate_error(error, model)
                yield _waveform(result)
                if until_final:
                    final = result.get_response().parameters.get("triton_final_response")
                    if final is not None and final.bool_param:
                        break
            finished = True
        except (InferenceServerException, grpc.RpcError) as exc:
            raise translate_error(exc, model) from exc
        finally:
            if not finished:
                responses.cancel()


def _waveform(result: Any) -> NDArray[np.float32]:
    data = result.as_numpy(contract.WAVEFORM)
    if data is None:
        return np.zeros(0, dtype=np.float32)
    return np.asarray(data, dtype=np.float32).reshape(-1)


def _parse_config(config: Mapping[str, Any]) -> TritonModelConfig:
    parameters = {key: str(value.get("string_value", "")) for key, value in config.get("parameters", {}).items()}
    policy = config.get("model_transaction_policy", {})
    return TritonModelConfig(
        name=str(config["name"]),
        inputs=frozenset(str(i["name"]) for i in config.get("input", [])),
        decoupled=bool(policy.get("decoupled", False)),
        parameters=parameters,
    )
