"""Request and response schemas of the OpenAI-compatible API."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.audio_encoding import AudioFormat

MAX_INPUT_CHARS = 4096


class VoiceRef(BaseModel):
    """``voice`` given as an object, as OpenAI's newer API allows."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=128)


class SpeechRequest(BaseModel):
    """Body of ``POST /v1/audio/speech``. Unknown fields are rejected, as OpenAI does."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=128)
    input: str = Field(min_length=1, max_length=MAX_INPUT_CHARS)
    voice: str | VoiceRef
    instructions: str | None = Field(None, max_length=MAX_INPUT_CHARS)
    response_format: AudioFormat = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    # Vendor extension (send through the SDK's ``extra_body``): reproducible sampling on
    # models that declare a ``seed`` input; ignored by the others.
    seed: int | None = Field(None, ge=0, le=2**63 - 1)

    @field_validator("input")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("input must contain text to speak")
        return value

    @property
    def voice_id(self) -> str:
        return self.voice if isinstance(self.voice, str) else self.voice.id


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tts-gateway"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AudioModel(BaseModel):
    id: str
    name: str
    sample_rate: int
    supports_cloning: bool
    native_speed: bool = Field(description="the model changes tempo itself; otherwise the gateway time-stretches")
    supports_streaming: bool
    languages: list[str]
    voices: list[str]


class AudioModelList(BaseModel):
    models: list[AudioModel]


class VoiceInfo(BaseModel):
    id: str
    name: str
    type: Literal["builtin", "reference", "uploaded"]
    models: list[str] = Field(description="models that can speak with this voice")
    transcript: str | None = None
    duration: float | None = None
    created_at: int | None = None


class VoiceList(BaseModel):
    voices: list[VoiceInfo]


class VoiceObject(BaseModel):
    """Answer to a voice upload, in OpenAI's ``audio.voice`` shape plus the gateway's details."""

    object: Literal["audio.voice"] = "audio.voice"
    id: str
    name: str
    created_at: int
    type: Literal["uploaded"] = "uploaded"
    transcript: str | None
    duration: float


class VoiceDeleted(BaseModel):
    object: Literal["audio.voice.deleted"] = "audio.voice.deleted"
    id: str
    deleted: bool = True


class HealthStatus(BaseModel):
    status: Literal["ok", "unavailable"]
    backend: str
    models: list[str]
