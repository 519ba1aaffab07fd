"""Response schemas of the OpenAI-compatible API (the request body, ``SpeechRequest``, is speech's own:
``speech/request.py``)."""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, Field

from tts_gateway.gateway.speech.voice_registry import VoiceInfo


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: the body of every 4xx and 5xx answer."""

    error: ErrorDetail


# ``responses`` of a route: the error envelope for every 4xx and 5xx. Declaring "4XX" also
# keeps FastAPI from documenting its 422, which this API never sends (validation errors are 400).
ERROR_RESPONSES: Final[dict[int | str, dict[str, Any]]] = {
    "4XX": {"model": ErrorResponse, "description": "The request is invalid (OpenAI error envelope)"},
    "5XX": {"model": ErrorResponse, "description": "The gateway or a Triton server failed (OpenAI error envelope)"},
}


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


class ServerHealth(BaseModel):
    address: str = Field(description="the Triton server's gRPC address")
    entry: str = Field(description="the configured address it came from (a name may resolve to several servers)")
    ready: bool
    models: list[str] = Field(description="what it serves, speech models and their variants alike")
    outstanding: int = Field(description="calls of this gateway process in flight there")


class HealthStatus(BaseModel):
    status: Literal["ok", "unavailable"]
    backend: str = Field(description="the configured Triton addresses")
    models: list[str]
    backends: list[ServerHealth] = Field(default_factory=list)
