"""The socket's query parameters and the messages clients send, as ElevenLabs' clients write them.

Fields the gateway has no use for (``enable_logging``, ``language_code``, ``voice_settings``
other than ``speed``, pronunciation dictionaries...) are accepted and ignored, as a client that
sets them would otherwise fail for no benefit.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tts_gateway.gateway.protocol import MAX_NAME_CHARS, clean_text
from tts_gateway.gateway.text_stream.phrase_chunker import SCHEDULE_MAX, SCHEDULE_MIN

# ElevenLabs' own model ids all start so; any of them means the gateway's default model, as
# OpenAI's model names do (they are its aliases).
ELEVENLABS_MODEL_PREFIX: Final = "eleven_"
DEFAULT_MODEL_ALIAS: Final = "tts-1"
MAX_INACTIVITY_TIMEOUT: Final = 180


class StreamQuery(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model_id: str = Field("", max_length=MAX_NAME_CHARS)
    # ElevenLabs' own default (mp3_44100_128) is not offered here: see output_format.py.
    output_format: str = Field("pcm_24000", max_length=64)
    auto_mode: bool = False
    sync_alignment: bool = False
    inactivity_timeout: int = Field(20, ge=1, le=MAX_INACTIVITY_TIMEOUT)
    apply_text_normalization: Literal["auto", "on", "off"] = "auto"

    @property
    def model(self) -> str:
        """The gateway model the socket speaks with."""
        if not self.model_id or self.model_id.startswith(ELEVENLABS_MODEL_PREFIX):
            return DEFAULT_MODEL_ALIAS
        return self.model_id

    @property
    def normalize(self) -> bool | None:
        """``auto`` follows the server's ``TTS_TEXT_NORMALIZATION``."""
        return {"auto": None, "on": True, "off": False}[self.apply_text_normalization]


class VoiceSettings(BaseModel):
    model_config = ConfigDict(extra="ignore")

    speed: float | None = Field(None, ge=0.25, le=4.0, allow_inf_nan=False)


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
    try_trigger_generation: bool = False
    close_context: bool = False
    close_socket: bool = False
    voice_settings: VoiceSettings | None = None
    generation_config: GenerationConfig | None = None

    @field_validator("text")
    @classmethod
    def _clean(cls, value: str | None) -> str | None:
        return None if value is None else clean_text(value)
