"""A request for speech: the body of the OpenAI-compatible ``POST /v1/audio/speech``, which every API
(ElevenLabs', the text-stream WebSocket, Wyoming) also turns its requests into.

Text that reaches a speech model (``input``, ``instructions``, and the transcripts
of uploaded voices) is cleaned here, at the edge: control characters other than
tab, line feed and carriage return (C0, DEL and C1: NUL, escape sequences, form
feeds, ...) have no spoken form and break native text front ends, so each is
replaced by a space (which keeps the words around it apart). Lone UTF-16
surrogates (``"\\ud800"`` in JSON) are not text and are rejected. Numbers are
strict: ``true`` or ``"1.5"`` is not a speed, and neither is NaN or infinity.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from tts_gateway.gateway.speech.audio_encoding import AudioFormat

MAX_INPUT_CHARS = 4096
MAX_NAME_CHARS = 128

_CONTROL_CHARS: Final = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_SURROGATES: Final = re.compile(r"[\ud800-\udfff]")


def clean_text(value: str) -> str:
    """``value`` with every control character but tab, line feed and carriage return replaced by a space.

    Raises ``ValueError`` for a lone surrogate, which no encoder (UTF-8 to Triton) accepts.
    """
    if _SURROGATES.search(value):
        raise ValueError("text must be valid Unicode (it contains a lone surrogate)")
    return _CONTROL_CHARS.sub(" ", value)


class VoiceRef(BaseModel):
    """``voice`` given as an object, as OpenAI's newer API allows."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=MAX_NAME_CHARS)


class SpeechRequest(BaseModel):
    """Body of ``POST /v1/audio/speech``. Unknown fields are rejected, as OpenAI does."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    input: str = Field(min_length=1, max_length=MAX_INPUT_CHARS)
    voice: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)] | VoiceRef
    instructions: str | None = Field(None, max_length=MAX_INPUT_CHARS)
    response_format: AudioFormat = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0, strict=True, allow_inf_nan=False)
    stream_format: Literal["audio", "sse"] = "audio"
    # Vendor extension (send through the SDK's ``extra_body``): reproducible sampling on
    # models that declare a ``seed`` input; ignored by the others.
    seed: int | None = Field(None, ge=0, le=2**63 - 1, strict=True)
    # Vendor extension: write numbers, money, dates, units... as words before synthesis;
    # unset follows the gateway's ``TTS_TEXT_NORMALIZATION``.
    text_normalization: bool | None = Field(None, strict=True)
    # Vendor extension: false sends the audio whole once it is synthesised, so that a wav (or flac) header
    # carries the true sizes, which a header sent ahead of the audio cannot know.
    stream: bool = Field(True, strict=True)

    @field_validator("instructions")
    @classmethod
    def _clean_instructions(cls, value: str | None) -> str | None:
        return None if value is None else clean_text(value)

    @field_validator("input")
    @classmethod
    def _clean_input(cls, value: str) -> str:
        value = clean_text(value)
        if not value.strip():
            raise ValueError("input must contain text to speak")
        return value

    @field_validator("stream")
    @classmethod
    def _check_stream(cls, value: bool, info: ValidationInfo) -> bool:
        if not value and info.data.get("stream_format") == "sse":
            raise ValueError("false (the audio whole) does not go with stream_format sse")
        return value

    @property
    def voice_id(self) -> str:
        return self.voice if isinstance(self.voice, str) else self.voice.id
