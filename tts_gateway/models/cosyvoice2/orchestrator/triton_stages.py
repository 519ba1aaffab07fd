"""The pipeline's :class:`~tts_gateway.models.cosyvoice2.orchestrator.pipeline.Stages`, served by other Triton models.

Imported only inside Triton's Python backend (it needs ``triton_python_backend_utils``). Every
stage but the LLM is a BLS request to the model the orchestrator's config names; the LLM's tokens
stream from an :class:`LLMSource`: the LLM model of this server over gRPC
(:mod:`tts_gateway.models.cosyvoice2.orchestrator.llm_grpc`, which says why not BLS) or LLM servers of their own
(:mod:`tts_gateway.models.cosyvoice2.orchestrator.llm_server_client`). The tensors are built and read by
:mod:`tts_gateway.models.cosyvoice2.tensors`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import triton_python_backend_utils as pb_utils
from numpy.typing import NDArray

from tts_gateway.models.cosyvoice2 import tensors
from tts_gateway.models.cosyvoice2.model.frontend import VoicePrompt, build_voice_prompt
from tts_gateway.models.cosyvoice2.orchestrator.pipeline import LLMRequest, TextPiece, Token2WavRequest
from tts_gateway.models.request_parsing import ContractError


class StageError(RuntimeError):
    """A model behind the orchestrator failed."""


class LLMSource(Protocol):
    def generate(self, request: LLMRequest, is_cancelled: Callable[[], bool]) -> Generator[Sequence[int], None, None]:
        """Generated LLM ids, in pieces as they arrive; closing the iterator abandons the rest."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class StageModels:
    """Names of the deployed models the orchestrator calls over BLS."""

    audio_tokenizer: str
    speaker_embedding: str
    token2wav: str


class TritonStages:
    """Every stage as a BLS request, but the LLM's, which streams from ``llm``."""

    def __init__(
        self, models: StageModels, llm: LLMSource, *, text_streams: Callable[[TextPiece], None] | None = None
    ) -> None:
        """``text_streams`` passes text to the LLM's text streams (None: the LLM has none)."""
        self._models = models
        self._llm = llm
        self._text_streams = text_streams

    def send_text(self, piece: TextPiece) -> None:
        if self._text_streams is None:
            raise ContractError("this deployment's LLM serves no text streams")
        self._text_streams(piece)

    def voice_prompt(self, reference_wav: NDArray[np.float32]) -> VoicePrompt:
        try:
            return build_voice_prompt(reference_wav, _RemoteTokenizer(self), _RemoteEmbedder(self))  # type: ignore[arg-type]
        except ValueError as exc:
            # Too short or too long a recording: the caller's to fix.
            raise ContractError(f"reference_wav: {exc}") from exc

    def generate(self, request: LLMRequest, is_cancelled: Callable[[], bool]) -> Generator[Sequence[int], None, None]:
        return self._llm.generate(request, is_cancelled)

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
