"""Turn the input tensors of one contract request into a validated :class:`SynthesisRequest`.

Every contract ``model.py`` converts its Triton tensors to numpy and calls
:func:`parse_synthesis_request`; a :class:`ContractError` becomes an ``INVALID_ARG``
error for the caller. Triton has already checked names, dtypes and shapes against
``config.pbtxt``; this module checks what Triton cannot: values, ranges and the
relations between inputs. It stays free of ``triton_python_backend_utils`` so it
is unit-tested on its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from tts_gateway.models import contract

# Same range as the OpenAI speech API's ``speed``.
SPEED_MIN: Final = 0.25
SPEED_MAX: Final = 4.0
# Upper bound of the usual LLM sampling range; 0 would divide the logits by zero.
TEMPERATURE_MAX: Final = 2.0
SEED_MAX: Final = 2**63 - 1


class ContractError(ValueError):
    """Bad request input; model.py turns it into a TritonError (INVALID_ARG)."""


class DependencyUnavailableError(RuntimeError):
    """A server the model relies on is down or overloaded; model.py turns it into UNAVAILABLE (a 503)."""


@dataclass(frozen=True, eq=False)
class SynthesisRequest:
    """One validated speech request; optional inputs the caller left out are ``None``."""

    target_text: str
    reference_wav: NDArray[np.float32] | None
    """Already cut to ``reference_wav_len`` samples."""
    reference_text: str | None
    speed: float = 1.0
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    voice: str | None = None
    """One of the model's ``builtin_voices``; checking which is the model's job."""
    instructions: str | None = None
    """How to speak, for models that take instructions; blank means none."""
    request_id: str = ""
    """The server's id of the request (not a tensor: Triton's request id), for logs and traces."""


def parse_synthesis_request(tensors: Mapping[str, NDArray[Any]]) -> SynthesisRequest:
    """Validate the contract inputs present in ``tensors`` (input name -> numpy array)."""
    target_text = optional_text(tensors, contract.TARGET_TEXT)
    if target_text is None:
        raise ContractError(f"input '{contract.TARGET_TEXT}' is required")
    if not target_text.strip():
        raise ContractError(f"input '{contract.TARGET_TEXT}' is empty")

    reference_wav = _reference_wav(tensors)
    reference_text = optional_text(tensors, contract.REFERENCE_TEXT)
    if reference_text is not None and not reference_text.strip():
        reference_text = None
    if reference_text is not None and reference_wav is None:
        raise ContractError(
            f"input '{contract.REFERENCE_TEXT}' needs '{contract.REFERENCE_WAV}': "
            "a transcript without its recording means nothing"
        )

    speed = optional_float(tensors, contract.SPEED)
    if speed is not None and not SPEED_MIN <= speed <= SPEED_MAX:
        raise ContractError(f"'{contract.SPEED}' must be in [{SPEED_MIN}, {SPEED_MAX}], got {speed}")

    seed = optional_int(tensors, contract.SEED)
    if seed is not None and not 0 <= seed <= SEED_MAX:
        raise ContractError(f"'{contract.SEED}' must be in [0, 2**63 - 1], got {seed}")

    temperature = optional_float(tensors, contract.TEMPERATURE)
    if temperature is not None and not 0.0 < temperature <= TEMPERATURE_MAX:
        raise ContractError(f"'{contract.TEMPERATURE}' must be in (0, {TEMPERATURE_MAX}], got {temperature}")

    top_p = optional_float(tensors, contract.TOP_P)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ContractError(f"'{contract.TOP_P}' must be in (0, 1], got {top_p}")

    top_k = optional_int(tensors, contract.TOP_K)
    if top_k is not None and top_k < 1:
        raise ContractError(f"'{contract.TOP_K}' must be at least 1, got {top_k}")

    voice = optional_text(tensors, contract.VOICE)
    if voice is not None and not voice.strip():
        raise ContractError(f"input '{contract.VOICE}' is empty")

    instructions = optional_text(tensors, contract.INSTRUCTIONS)
    if instructions is not None:
        instructions = instructions.strip() or None

    return SynthesisRequest(
        target_text=target_text,
        reference_wav=reference_wav,
        reference_text=reference_text,
        speed=1.0 if speed is None else speed,
        seed=seed,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        voice=voice,
        instructions=instructions,
    )


def scalar(tensors: Mapping[str, NDArray[Any]], name: str) -> Any:
    """The one element of a ``[1]`` input, or ``None`` when the input is absent."""
    array = tensors.get(name)
    if array is None:
        return None
    if array.size != 1:
        raise ContractError(f"input '{name}' must hold exactly one element, got shape {array.shape}")
    return array.reshape(-1)[0]


def optional_text(tensors: Mapping[str, NDArray[Any]], name: str) -> str | None:
    value = scalar(tensors, name)
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, bytes):
        raise ContractError(f"input '{name}' must be BYTES, got {type(value).__name__}")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ContractError(f"input '{name}' is not valid UTF-8: {exc}") from exc


def optional_float(tensors: Mapping[str, NDArray[Any]], name: str) -> float | None:
    value = scalar(tensors, name)
    if value is None:
        return None
    if not isinstance(value, float | np.floating):
        raise ContractError(f"input '{name}' must be a float, got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise ContractError(f"input '{name}' must be finite, got {result}")
    return result


def optional_int(tensors: Mapping[str, NDArray[Any]], name: str) -> int | None:
    value = scalar(tensors, name)
    if value is None:
        return None
    if not isinstance(value, np.integer | int) or isinstance(value, bool | np.bool_):
        raise ContractError(f"input '{name}' must be an integer, got {type(value).__name__}")
    return int(value)


def _reference_wav(tensors: Mapping[str, NDArray[Any]]) -> NDArray[np.float32] | None:
    wav = tensors.get(contract.REFERENCE_WAV)
    length = optional_int(tensors, contract.REFERENCE_WAV_LEN)
    if wav is None:
        if length is not None:
            raise ContractError(f"'{contract.REFERENCE_WAV_LEN}' given without '{contract.REFERENCE_WAV}'")
        return None
    if wav.ndim != 1:
        raise ContractError(f"'{contract.REFERENCE_WAV}' must be one-dimensional, got shape {wav.shape}")
    if not np.issubdtype(wav.dtype, np.floating):
        raise ContractError(f"'{contract.REFERENCE_WAV}' must be FP32, got {wav.dtype}")
    if length is None:
        length = wav.shape[0]
    if not 0 < length <= wav.shape[0]:
        raise ContractError(
            f"'{contract.REFERENCE_WAV_LEN}' must be in [1, {wav.shape[0]}] (the samples sent), got {length}"
        )
    samples = np.asarray(wav[:length], dtype=np.float32)
    if not np.isfinite(samples).all():
        raise ContractError(f"'{contract.REFERENCE_WAV}' contains NaN or infinite samples")
    return samples
