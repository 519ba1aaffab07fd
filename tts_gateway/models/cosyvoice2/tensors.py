"""The numpy tensors CosyVoice2's Triton models exchange, by name, in one place.

The orchestrator builds requests with the ``*_inputs`` functions and the serving side
reads them with the ``parse_*`` functions, so both ends share one definition; the
template tests check these names and dtypes against every ``config.pbtxt``.

LLM tensors follow NVIDIA's TensorRT-LLM backend (``max_batch_size > 0``: every tensor
has a leading batch dimension of one), which ``llm_torch`` serves as well.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from tts_gateway.models.cosyvoice2.orchestrator.pipeline import LLMRequest, TextPiece, Token2WavRequest
from tts_gateway.models.request_parsing import ContractError, optional_float, optional_int, scalar

# Triton dtype of each tensor as the client API spells it (config.pbtxt: TYPE_ prefix, STRING for BYTES).
LLM_INPUT_DTYPES: Final[dict[str, str]] = {
    "input_ids": "INT32",
    "input_lengths": "INT32",
    "request_output_len": "INT32",
    "min_length": "INT32",
    "end_id": "INT32",
    "pad_id": "INT32",
    "streaming": "BOOL",
    "runtime_top_k": "INT32",
    "runtime_top_p": "FP32",
    "temperature": "FP32",
    "repetition_penalty": "FP32",
    "random_seed": "UINT64",
}
LLM_OUTPUT_DTYPES: Final[dict[str, str]] = {"output_ids": "INT32", "sequence_length": "INT32"}
# A text stream on ``llm_torch`` (not a TensorRT-LLM input): ``text_stream_id`` on an ordinary request
# (whose prompt holds no target text) opens the stream; a request with the id but no ``input_ids``
# appends ``text_input_ids`` to it, ends its text (``text_end``) or cancels it (``text_cancel``), and
# is answered at once.
TEXT_STREAM_INPUT_DTYPES: Final[dict[str, str]] = {
    "text_stream_id": "BYTES",
    "text_input_ids": "INT32",
    "text_end": "BOOL",
    "text_cancel": "BOOL",
}

TOKEN2WAV_INPUT_DTYPES: Final[dict[str, str]] = {
    "session_id": "BYTES",
    "target_speech_tokens": "INT32",
    "prompt_speech_tokens": "INT32",
    "prompt_speech_feat": "FP32",
    "prompt_spk_embedding": "FP32",
    "token_offset": "INT32",
    "finalize": "BOOL",
    "speed": "FP32",
}
REFERENCE_INPUT_DTYPES: Final[dict[str, str]] = {"reference_wav": "FP32", "reference_wav_len": "INT32"}
AUDIO_TOKENS_OUTPUT: Final = "prompt_speech_tokens"
SPEAKER_EMBEDDING_OUTPUT: Final = "prompt_spk_embedding"
WAVEFORM_OUTPUT: Final = "waveform"


class TensorError(ContractError):
    """A request's tensors are missing, misshapen or out of range."""


def llm_inputs(request: LLMRequest) -> dict[str, NDArray[Any]]:
    """The TensorRT-LLM backend's inputs for ``request`` (batch of one)."""
    ids = np.asarray(request.input_ids, dtype=np.int32)[None, :]
    tensors: dict[str, NDArray[Any]] = {
        "input_ids": ids,
        "input_lengths": _scalar(ids.shape[1], np.int32),
        "request_output_len": _scalar(request.max_new_tokens, np.int32),
        "min_length": _scalar(request.min_new_tokens, np.int32),
        "streaming": _scalar(request.streaming, np.bool_),
        "runtime_top_k": _scalar(request.top_k, np.int32),
        "runtime_top_p": _scalar(request.top_p, np.float32),
        "temperature": _scalar(request.temperature, np.float32),
        "repetition_penalty": _scalar(request.repetition_penalty, np.float32),
    }
    if request.end_id is not None:
        tensors["end_id"] = _scalar(request.end_id, np.int32)
        tensors["pad_id"] = _scalar(request.end_id, np.int32)
    if request.seed is not None:
        tensors["random_seed"] = _scalar(request.seed, np.uint64)
    if request.text_stream_id:
        tensors["text_stream_id"] = np.array([[request.text_stream_id.encode()]], dtype=np.object_)
    return tensors


def text_piece_inputs(piece: TextPiece) -> dict[str, NDArray[Any]]:
    return {
        "text_stream_id": np.array([[piece.stream_id.encode()]], dtype=np.object_),
        "text_input_ids": np.asarray(piece.ids, dtype=np.int32).reshape(1, -1),
        "text_end": _scalar(piece.end, np.bool_),
        "text_cancel": _scalar(piece.cancel, np.bool_),
    }


def text_stream_id(tensors: Mapping[str, NDArray[Any]]) -> str | None:
    """The request's ``text_stream_id``, or None when it has none."""
    array = tensors.get("text_stream_id")
    if array is None:
        return None
    if array.size != 1:
        raise TensorError("'text_stream_id' must hold one string")
    value = array.reshape(-1)[0]
    stream_id = value.decode() if isinstance(value, bytes) else str(value)
    if not stream_id:
        raise TensorError("'text_stream_id' is empty")
    return stream_id


def parse_text_piece(tensors: Mapping[str, NDArray[Any]], stream_id: str) -> TextPiece:
    ids = tensors.get("text_input_ids")
    end = scalar(tensors, "text_end")
    cancel = scalar(tensors, "text_cancel")
    if ids is None and end is None and cancel is None:
        raise TensorError("a text stream's request needs 'text_input_ids', 'text_end' or 'text_cancel'")
    return TextPiece(
        stream_id=stream_id,
        ids=() if ids is None else tuple(int(i) for i in ids.reshape(-1)),
        end=bool(end),
        cancel=bool(cancel),
    )


def parse_llm_inputs(tensors: Mapping[str, NDArray[Any]]) -> LLMRequest:
    """Read a TensorRT-LLM-style request; absent sampling inputs mean "off", as in that backend."""
    ids = _required(tensors, "input_ids")
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise TensorError(f"'input_ids' must have shape [1, n] (one request per call), got {ids.shape}")
    length = optional_int(tensors, "input_lengths")
    if length is None or not 0 < length <= ids.shape[1]:
        raise TensorError(f"'input_lengths' must be in [1, {ids.shape[1]}], got {length}")
    max_new = optional_int(tensors, "request_output_len")
    if max_new is None or max_new < 1:
        raise TensorError(f"'request_output_len' must be at least 1, got {max_new}")
    min_new = optional_int(tensors, "min_length") or 0
    top_k = optional_int(tensors, "runtime_top_k") or 0
    top_p = optional_float(tensors, "runtime_top_p")
    temperature = optional_float(tensors, "temperature")
    penalty = optional_float(tensors, "repetition_penalty")
    streaming = scalar(tensors, "streaming")
    if top_k < 0:
        raise TensorError(f"'runtime_top_k' must not be negative, got {top_k}")
    if top_p is not None and not 0.0 <= top_p <= 1.0:
        raise TensorError(f"'runtime_top_p' must be in [0, 1], got {top_p}")
    if temperature is not None and temperature <= 0.0:
        raise TensorError(f"'temperature' must be positive, got {temperature}")
    if penalty is not None and penalty <= 0.0:
        raise TensorError(f"'repetition_penalty' must be positive, got {penalty}")
    return LLMRequest(
        input_ids=ids[0, :length].astype(np.int64).tolist(),
        max_new_tokens=max_new,
        min_new_tokens=min(max(0, min_new), max_new),
        end_id=optional_int(tensors, "end_id"),
        temperature=1.0 if temperature is None else temperature,
        top_p=top_p or 1.0,
        top_k=top_k,
        repetition_penalty=1.0 if penalty is None else penalty,
        seed=optional_int(tensors, "random_seed"),
        streaming=bool(streaming) if streaming is not None else False,
    )


def llm_outputs(ids: Sequence[int]) -> dict[str, NDArray[np.int32]]:
    """One LLM response carrying ``ids`` (batch 1, beam 1)."""
    return {
        "output_ids": np.asarray(ids, dtype=np.int32).reshape(1, 1, -1),
        "sequence_length": np.array([[len(ids)]], dtype=np.int32),
    }


def parse_llm_outputs(output_ids: NDArray[Any], sequence_length: NDArray[Any]) -> list[int]:
    """The generated ids of one LLM response (first request, first beam)."""
    ids = np.asarray(output_ids).reshape(-1) if output_ids.ndim < 3 else output_ids[0, 0]
    length = int(np.asarray(sequence_length).reshape(-1)[0])
    return [int(i) for i in ids[:length]]


def token2wav_inputs(request: Token2WavRequest) -> dict[str, NDArray[Any]]:
    """token2wav's inputs for ``request``, each with the leading batch dimension of one its dynamic batching needs."""
    prompt = request.prompt
    tensors: dict[str, NDArray[Any]] = {
        "session_id": np.array([[request.session_id.encode()]], dtype=np.object_),
        "target_speech_tokens": np.asarray(request.speech_tokens, dtype=np.int32).reshape(1, -1),
        "prompt_speech_tokens": np.asarray(prompt.speech_tokens, dtype=np.int32).reshape(1, -1),
        "prompt_speech_feat": np.asarray(prompt.feats, dtype=np.float32).reshape(1, -1, 80),
        "prompt_spk_embedding": np.asarray(prompt.embedding, dtype=np.float32).reshape(1, -1),
        "speed": np.array([[request.speed]], dtype=np.float32),
    }
    if request.token_offset is not None:
        tensors["token_offset"] = np.array([[request.token_offset]], dtype=np.int32)
        tensors["finalize"] = np.array([[request.finalize]], dtype=np.bool_)
    return tensors


@dataclass(frozen=True, eq=False)
class Token2WavCall:
    """A parsed token2wav request; ``token_offset`` is None for an offline (one-shot) call."""

    session_id: str
    speech_tokens: NDArray[np.int64]
    prompt_speech_tokens: NDArray[np.int64]
    prompt_feat: NDArray[np.float32]
    embedding: NDArray[np.float32]
    token_offset: int | None
    finalize: bool
    speed: float


def parse_token2wav_inputs(tensors: Mapping[str, NDArray[Any]]) -> Token2WavCall:
    session = scalar(tensors, "session_id")
    if isinstance(session, bytes):
        session = session.decode("utf-8", errors="strict")
    if not isinstance(session, str) or not session:
        raise TensorError("'session_id' must be a non-empty string")
    tokens = _required(tensors, "target_speech_tokens").reshape(-1).astype(np.int64)
    offset = optional_int(tensors, "token_offset")
    finalize = scalar(tensors, "finalize")
    if (offset is None) != (finalize is None):
        raise TensorError("'token_offset' and 'finalize' come together (streaming) or not at all")
    if offset is not None and not 0 <= offset <= tokens.size:
        raise TensorError(f"'token_offset' must be in [0, {tokens.size}], got {offset}")
    speed = optional_float(tensors, "speed")
    if speed is not None and speed <= 0.0:
        raise TensorError(f"'speed' must be positive, got {speed}")
    feat = _required(tensors, "prompt_speech_feat").astype(np.float32)
    if feat.ndim == 3 and feat.shape[0] == 1:
        feat = feat[0]
    if feat.ndim != 2 or feat.shape[1] != 80:
        raise TensorError(f"'prompt_speech_feat' must have shape [frames, 80], got {feat.shape}")
    return Token2WavCall(
        session_id=session,
        speech_tokens=tokens,
        prompt_speech_tokens=_required(tensors, "prompt_speech_tokens").reshape(-1).astype(np.int64),
        prompt_feat=feat,
        embedding=_required(tensors, "prompt_spk_embedding").reshape(-1).astype(np.float32),
        token_offset=offset,
        finalize=True if finalize is None else bool(finalize),
        speed=1.0 if speed is None else speed,
    )


def reference_inputs(wav: NDArray[np.float32]) -> dict[str, NDArray[Any]]:
    """Inputs of ``audio_tokenizer`` and ``speaker_embedding`` for one 16 kHz recording."""
    samples = np.ascontiguousarray(wav, dtype=np.float32).reshape(-1)
    return {"reference_wav": samples, "reference_wav_len": np.array([samples.size], dtype=np.int32)}


def parse_reference_inputs(tensors: Mapping[str, NDArray[Any]]) -> NDArray[np.float32]:
    wav = _required(tensors, "reference_wav").reshape(-1)
    length = optional_int(tensors, "reference_wav_len")
    if length is None or not 0 < length <= wav.size:
        raise TensorError(f"'reference_wav_len' must be in [1, {wav.size}], got {length}")
    return np.ascontiguousarray(wav[:length], dtype=np.float32)


def _scalar(value: object, dtype: type[np.generic]) -> NDArray[Any]:
    return np.array([[value]], dtype=dtype)


def _required(tensors: Mapping[str, NDArray[Any]], name: str) -> NDArray[Any]:
    array = tensors.get(name)
    if array is None:
        raise TensorError(f"input '{name}' is required")
    return np.asarray(array)
