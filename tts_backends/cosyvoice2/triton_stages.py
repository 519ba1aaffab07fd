"""The pipeline's :class:`~tts_backends.cosyvoice2.pipeline.Stages`, served by other Triton models.

Imported only inside Triton's Python backend (it needs ``triton_python_backend_utils``):
each stage is a BLS request to the model the orchestrator's config names, but for the LLM
when it runs on its own server (:mod:`tts_backends.cosyvoice2.llm_server`). The tensors
are built and read by :mod:`tts_backends.cosyvoice2.tensors`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import triton_python_backend_utils as pb_utils
from numpy.typing import NDArray

from tts_backends.cosyvoice2 import tensors
from tts_backends.cosyvoice2.frontend import VoicePrompt, build_voice_prompt
from tts_backends.cosyvoice2.pipeline import LLMRequest, Token2WavRequest
from tts_backends.request_parsing import ContractError

if TYPE_CHECKING:
    # Only a type here: the light Python 3.12 test environment has no httpx.
    from tts_backends.cosyvoice2.llm_server import LLMServerClient


class StageError(RuntimeError):
    """A model behind the orchestrator failed."""


@dataclass(frozen=True)
class StageModels:
    """Names of the deployed models the orchestrator calls."""

    llm: str
    audio_tokenizer: str
    speaker_embedding: str
    token2wav: str


class TritonStages:
    """Every stage as a BLS request, except the LLM when an :class:`LLMServerClient` is given."""

    def __init__(self, models: StageModels, llm_server: LLMServerClient | None = None) -> None:
        self._models = models
        self._llm_server = llm_server
        self._streams = _FinishedStreams()

    def voice_prompt(self, reference_wav: NDArray[np.float32]) -> VoicePrompt:
        try:
            return build_voice_prompt(reference_wav, _RemoteTokenizer(self), _RemoteEmbedder(self))  # type: ignore[arg-type]
        except ValueError as exc:
            # Too short or too long a recording: the caller's to fix.
            raise ContractError(f"reference_wav: {exc}") from exc

    def generate(self, request: LLMRequest, is_cancelled: Callable[[], bool]) -> Generator[Sequence[int], None, None]:
        if self._llm_server is not None:
            return self._llm_server.generate(request, is_cancelled)
        return self._generate_in_triton(request, is_cancelled)

    def _generate_in_triton(
        self, request: LLMRequest, is_cancelled: Callable[[], bool]
    ) -> Generator[Sequence[int], None, None]:
        inference = pb_utils.InferenceRequest(
            model_name=self._models.llm,
            inputs=_tensors(tensors.llm_inputs(request)),
            requested_output_names=list(tensors.LLM_OUTPUT_DTYPES),
            request_id=request.request_id,
        )
        responses = inference.exec(decoupled=True)
        try:
            for response in responses:
                _check(response, self._models.llm)
                output_ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
                if output_ids is None:
                    # The empty response that carries only the final flag.
                    continue
                lengths = pb_utils.get_output_tensor_by_name(response, "sequence_length")
                yield tensors.parse_llm_outputs(output_ids.as_numpy(), lengths.as_numpy())
        finally:
            # Python backends from 24.10 on can cancel a streaming BLS request; older ones
            # let the LLM run to its length limit unobserved.
            cancel = getattr(responses, "cancel", None)
            if cancel is not None:
                cancel()
            self._streams.let_go(responses, is_cancelled)

    def token2wav(self, request: Token2WavRequest) -> NDArray[np.float32]:
        outputs = self._call(self._models.token2wav, tensors.token2wav_inputs(request), tensors.WAVEFORM_OUTPUT)
        return outputs.reshape(-1).astype(np.float32, copy=False)

    def release(self, session_id: str) -> None:
        """A finalising call without tokens: token2wav drops the session's state."""
        empty = np.zeros((1, 0), dtype=np.int32)
        inputs = {
            "session_id": np.array([[session_id.encode()]], dtype=np.object_),
            "target_speech_tokens": empty,
            "prompt_speech_tokens": empty,
            "prompt_speech_feat": np.zeros((1, 0, 80), dtype=np.float32),
            "prompt_spk_embedding": np.zeros((1, 0), dtype=np.float32),
            "token_offset": np.zeros((1, 1), dtype=np.int32),
            "finalize": np.ones((1, 1), dtype=np.bool_),
        }
        self._call(self._models.token2wav, inputs, tensors.WAVEFORM_OUTPUT)

    def speech_tokens(self, wav: NDArray[np.float32]) -> NDArray[np.int64]:
        out = self._call(self._models.audio_tokenizer, tensors.reference_inputs(wav), tensors.AUDIO_TOKENS_OUTPUT)
        return out.reshape(-1).astype(np.int64)

    def speaker_embedding(self, wav: NDArray[np.float32]) -> NDArray[np.float32]:
        out = self._call(
            self._models.speaker_embedding, tensors.reference_inputs(wav), tensors.SPEAKER_EMBEDDING_OUTPUT
        )
        return out.reshape(-1).astype(np.float32)

    def _call(self, model: str, inputs: Mapping[str, NDArray[Any]], output: str) -> NDArray[Any]:
        response = pb_utils.InferenceRequest(
            model_name=model, inputs=_tensors(inputs), requested_output_names=[output]
        ).exec()
        _check(response, model)
        return np.asarray(pb_utils.get_output_tensor_by_name(response, output).as_numpy())


class _FinishedStreams:
    """Keeps decoupled BLS response streams until the stub has dropped its own reference.

    The Python backend stub also holds every stream in a map and removes a finished one from
    its stub-to-parent thread, which does not take the GIL. When that removal drops the last
    reference, the responses' NumPy arrays are freed without a Python thread state: Python
    3.12 segfaults there (earlier versions race on the allocator). That thread serves a FIFO
    queue which ``request.is_cancelled()`` also goes through, so a query answered after a
    stream finished proves the stub let go of it: the last reference is then dropped here,
    under the GIL. A ``True`` answer may come from a cache without the round trip, or from the
    orchestrator having stopped reading the stream (its check then asks nothing); such streams
    wait for the next query that does make it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[tuple[int, Any]] = []
        self._count = 0

    def let_go(self, responses: Any, is_cancelled: Callable[[], bool]) -> None:
        with self._lock:
            self._count += 1
            mark = self._count
            self._held.append((mark, responses))
        if is_cancelled():
            return
        with self._lock:
            self._held = [(number, stream) for number, stream in self._held if number > mark]


class _RemoteTokenizer:
    """``AudioTokenizer``'s interface over the ``audio_tokenizer`` model."""

    def __init__(self, stages: TritonStages) -> None:
        self._stages = stages

    def tokenize(self, wav16k: NDArray[np.float32]) -> NDArray[np.int64]:
        return self._stages.speech_tokens(wav16k)


class _RemoteEmbedder:
    """``SpeakerEmbedder``'s interface over the ``speaker_embedding`` model."""

    def __init__(self, stages: TritonStages) -> None:
        self._stages = stages

    def embed(self, wav16k: NDArray[np.float32]) -> NDArray[np.float32]:
        return self._stages.speaker_embedding(wav16k)


def _tensors(arrays: Mapping[str, NDArray[Any]]) -> list[Any]:
    return [pb_utils.Tensor(name, array) for name, array in arrays.items()]


def _check(response: Any, model: str) -> None:
    if not response.has_error():
        return
    error = response.error()
    if error.code() == pb_utils.TritonError.INVALID_ARG:
        raise ContractError(error.message())
    raise StageError(f"{model}: {error.message()}")
