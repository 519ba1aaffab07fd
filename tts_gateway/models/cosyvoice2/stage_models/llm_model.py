"""The CosyVoice2 speech LLM's Triton model on PyTorch, speaking the TensorRT-LLM backend's tensors.

Imported only inside Triton (it needs ``triton_python_backend_utils``); ``triton_repo/llm_torch/1/model.py``
loads the LLM from its parameters, this class serves it.

Decoupled: with ``streaming`` one response per generated id (the ids that queued while the
request's outbox lane was busy share one), otherwise one response with all of them; then the
final flag. Requests are decoded together by the continuous-batching
engine (``tts_gateway/models/cosyvoice2/engines/llm_engine.py``); ``execute`` only parses and submits.
Responses leave through outbox threads (each request's in order) and cancellations are
noticed by a watcher, so the engine's thread never waits on the server. A cancelled request
stops at the engine's next step.
"""

from __future__ import annotations

import threading
import traceback
from typing import Any

import torch
import triton_python_backend_utils as pb_utils

from tts_gateway.models import contract
from tts_gateway.models.cosyvoice2 import tensors
from tts_gateway.models.cosyvoice2.engines.gpu_turns import GpuTurns, YieldToFirstChunks
from tts_gateway.models.cosyvoice2.engines.llm import SamplingParams, TorchSpeechLLM
from tts_gateway.models.cosyvoice2.engines.llm_engine import GenerationHandle, TextStreamHandle
from tts_gateway.models.cosyvoice2.model import vocab
from tts_gateway.models.cosyvoice2.orchestrator.pipeline import LLMRequest
from tts_gateway.models.cosyvoice2.stage_models.llm_responses import CancellationWatch, Outbox, TokenStream
from tts_gateway.models.cosyvoice2.stage_models.llm_text_streams import OpenTextStreams
from tts_gateway.models.stage_trace import StageTrace
from tts_gateway.models.triton_model import TritonModel


class LLMModel(TritonModel):
    """Subclasses implement :meth:`load`."""

    def load(self, params: dict[str, str], gate: YieldToFirstChunks | None) -> TorchSpeechLLM:
        """The LLM from the config's string parameters; ``gate`` (if any) lets first chunks go first on its GPU."""
        raise NotImplementedError

    def setup(self, params: dict[str, str]) -> None:
        # On a GPU shared with token2wav, a first chunk being converted goes before decoding ahead.
        device = torch.device(params["device"])
        yield_rows = int(params["yield_max_rows"])
        self._turns = GpuTurns.of_server(device.index or 0) if device.type == "cuda" and yield_rows > 0 else None
        self._llm = self.load(
            params,
            None
            if self._turns is None
            else YieldToFirstChunks(self._turns, max_rows=yield_rows, after_tokens=int(params["yield_after_tokens"])),
        )
        # Every piece of a text stream must reach the instance that holds it.
        self._text_streams = OpenTextStreams(self._llm.engine, single_instance=self.instances <= 1)
        self.outbox = Outbox(self.name)
        # Text pieces are answered on a lane of their own: behind the streams' tokens, a piece's answer (which
        # its session waits for before the next piece) waited for many sessions' tokens to be sent.
        self._acks = Outbox(f"{self.name}-acks", lanes=1)
        self.watch = CancellationWatch(self.name)
        self.trace = StageTrace.from_env("llm")

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                arrays = self.arrays(request, (*tensors.LLM_INPUT_DTYPES, *tensors.TEXT_STREAM_INPUT_DTYPES))
                stream_id = tensors.text_stream_id(arrays)
                if stream_id is not None and "input_ids" not in arrays:
                    piece = tensors.parse_text_piece(arrays, stream_id)
                    self._text_streams.add_text(piece)
                    self._acks.put(0, lambda s=sender: _ack(s))
                    continue
                call = tensors.parse_llm_inputs(arrays)
                if stream_id is None:
                    sink = _Sink(self, sender, request.request_id(), streaming=call.streaming)
                    handle: GenerationHandle = self._llm.submit(self._generation(call), sink)
                else:
                    sink = _Sink(self, sender, request.request_id(), streaming=True, text_stream_id=stream_id)
                    handle = self._text_streams.open(stream_id, self._generation(call), sink)
            except ValueError as exc:
                # Led by its code: over a gRPC stream a decoupled model's error is a message only.
                error = pb_utils.TritonError(f"{contract.INVALID_ARG_PREFIX} {exc}", pb_utils.TritonError.INVALID_ARG)
                self.outbox.put(self.outbox.next_lane(), lambda s=sender, e=error: _fail(s, e))
                continue
            sink.attach(handle, request.is_cancelled)

    def finalize(self) -> None:
        self._llm.close()
        self.watch.close()
        self.outbox.close()
        self._acks.close()
        if self._turns is not None:
            self._turns.remove()

    def _generation(self, call: LLMRequest) -> Any:
        stops = set(vocab.STOP_IDS)
        if call.end_id is not None and vocab.id_to_speech_token(call.end_id) is None:
            stops.add(call.end_id)
        sampling = SamplingParams(
            temperature=call.temperature,
            top_p=call.top_p,
            top_k=call.top_k,
            repetition_penalty=call.repetition_penalty,
            seed=call.seed,
        )
        return self._llm.request(
            call.input_ids,
            sampling,
            max_new_tokens=call.max_new_tokens,
            min_new_tokens=call.min_new_tokens,
            stop_ids=sorted(stops),
        )


class _Sink:
    """Turns the engine's tokens into responses: one per token when streaming, else one at the end."""

    def __init__(
        self, model: LLMModel, sender: Any, request_id: str, *, streaming: bool, text_stream_id: str = ""
    ) -> None:
        self._model = model
        self._text_stream_id = text_stream_id
        self._sender = sender
        self._request_id = request_id
        self._streaming = streaming
        self._lane = model.outbox.next_lane()
        self._stream = (
            TokenStream(model.outbox, self._lane, lambda ids: sender.send(_response(ids))) if streaming else None
        )
        self._tokens: list[int] = []
        self._lock = threading.Lock()
        self._handle: GenerationHandle | None = None
        self._done = False

    def attach(self, handle: GenerationHandle, is_cancelled: Any) -> None:
        """Watch the submitted request for cancellation, unless the engine already finished it."""
        with self._lock:
            self._handle = handle
            if self._done:
                self._record(handle)
            else:
                self._model.watch.watch(handle, is_cancelled)

    def _record(self, handle: GenerationHandle) -> None:
        self._model.trace.record(
            self._request_id,
            submitted=handle.submitted,
            admitted=handle.admitted,
            prompt_tokens=len(handle.request.input_ids),
            first_token=handle.first_token,
            last_token=handle.last_token,
            tokens=handle.produced,
            steps=handle.steps,
            step_s=handle.step_s,
            wait_s=handle.wait_s,
            periods=handle.periods,
            period_s=handle.period_s,
            token_times=handle.token_times,
            waits=[list(wait) for wait in handle.waits] if isinstance(handle, TextStreamHandle) else [],
        )

    def token(self, token_id: int) -> None:
        if self._stream is not None:
            self._stream.push(token_id)
        else:
            self._tokens.append(token_id)

    def finished(self, error: BaseException | None) -> None:
        model = self._model
        if self._text_stream_id:
            model._text_streams.ended(self._text_stream_id)
        with self._lock:
            self._done = True
            handle = self._handle
            if handle is not None:
                self._record(handle)

        def unwatch() -> None:
            # On the outbox lane, before the final response: the watcher must not ask about the
            # request once that is sent (the engine's thread does not wait for the watcher).
            if handle is not None:
                model.watch.forget(handle)

        if error is not None:
            pb_utils.Logger.log_error(f"{model.name}: generation failed\n{''.join(traceback.format_exception(error))}")
            failure = pb_utils.TritonError(
                f"model {model.name} failed; see the server log", pb_utils.TritonError.INTERNAL
            )

            def fail() -> None:
                unwatch()
                _fail(self._sender, failure)

            model.outbox.put(self._lane, fail)
            return
        produced = self._tokens

        def send() -> None:
            unwatch()
            if not self._streaming and not (handle is not None and handle.cancelled):
                self._sender.send(_response(produced))
            self._sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        model.outbox.put(self._lane, send)


def _ack(sender: Any) -> None:
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _fail(sender: Any, error: Any) -> None:
    sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _response(ids: list[int]) -> Any:
    return pb_utils.InferenceResponse(
        [pb_utils.Tensor(name, array) for name, array in tensors.llm_outputs(ids).items()]
    )
