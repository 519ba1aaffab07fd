"""The socket's query parameters and the messages clients send, as ElevenLabs' clients write them.

Fields the gateway has no use for (``enable_logging``, ``language_code``, ``voice_settings``
other than ``speed``, pronunciation dictionaries...) are accepted and ignored, as a client that
sets them would otherwise fail for no benefit.
"""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tts_gateway.gateway.api.elevenlabs_api import Normalization, VoiceSettings, gateway_model, text_normalization
from tts_gateway.gateway.speech.request import MAX_NAME_CHARS, clean_text
from tts_gateway.gateway.speech.text_stream.phrase_chunker import SCHEDULE_MAX, SCHEDULE_MIN

MAX_INACTIVITY_TIMEOUT: Final = 180


class StreamQuery(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model_id: str = Field("", max_length=MAX_NAME_CHARS)
    # Not ElevenLabs' default (mp3_44100_128): raw PCM is what voice agents play.
    output_format: str = Field("pcm_24000", max_length=64)
    auto_mode: bool = False
    sync_alignment: bool = False
    inactivity_timeout: int = Field(20, ge=1, le=MAX_INACTIVITY_TIMEOUT)
    apply_text_normalization: Normalization = "auto"

    @property
    def model(self) -> str:
        """The gateway model the socket speaks with."""
        return gateway_model(self.model_id)

    @property
    def normalize(self) -> bool | None:
        return text_normalization(self.apply_text_normalization)


class GenerationConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    chunk_length_schedule: list[int] | None = Field(None, min_length=1, max_length=16)

    @field_validator("chunk_length_schedule")
    @classmethod
    def _check_schedule(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(not SCHEDULE_MIN <= length <= SCHEDULE_MAX for length in value):
            raise ValueError(f"chunk_length_schedule entries must lie between {SCHEDULE_MIN} and {SCHEDULE_MAX}")
        return value


class ClientMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str | None = None
    context_id: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS)
    flush: bool = False
    # A hint that the chunk schedule already answers: a phrase is cut as soon as the schedule or a sentence
    # end allows, and ElevenLabs' SDK sends it with every word, which would make every word a phrase.
    try_trigger_generation: bool = False
    close_context: bool = False
    # With close_context: an interruption even right after a flush (which otherwise lets the turn finish).
    immediate: bool = False
    close_socket: bool = False
    voice_settings: VoiceSettings | None = None
    generation_config: GenerationConfig | None = None

    @field_validator("text")
    @classmethod
    def _clean(cls, value: str | None) -> str | None:
        return None if value is None else clean_text(value)
