"""Request and response schemas of ElevenLabs' REST text-to-speech API, as its SDK and LiveKit's plugin use it.

Fields the gateway has no use for (``enable_logging``, ``optimize_streaming_latency``, ``language_code``,
``previous_text`` / ``next_text``, ``voice_settings`` other than ``speed``, pronunciation dictionaries...)
are accepted and ignored, as ElevenLabs' clients send many of them by default. Errors on these paths
use ElevenLabs' envelope, ``{"detail": {"status": CODE, "message": TEXT}}``, with the gateway's status
codes (a request that fails validation is a 422, as ElevenLabs answers).
"""

from __future__ import annotations

from typing import Any, Final, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tts_gateway.gateway.errors import GatewayError
from tts_gateway.gateway.speech.request import MAX_INPUT_CHARS, MAX_NAME_CHARS, SpeechRequest, clean_text
from tts_gateway.gateway.speech.voice_registry import VoiceInfo
from tts_gateway.gateway.triton.model_catalog import SpeechModel

# ElevenLabs' own model ids all start so; any of them means the gateway's default model, as
# OpenAI's model names do (they are its aliases).
ELEVENLABS_MODEL_PREFIX: Final = "eleven_"
DEFAULT_MODEL_ALIAS: Final = "tts-1"
DEFAULT_OUTPUT_FORMAT: Final = "mp3_44100_128"
# ElevenLabs' REST paths: their errors, refused keys included, come in ElevenLabs' envelope.
REST_PATHS: Final = ("/v1/text-to-speech/", "/v1/voices", "/v2/voices")

Normalization = Literal["auto", "on", "off"]


def gateway_model(model_id: str | None) -> str:
    """The gateway model an ElevenLabs ``model_id`` names: ElevenLabs' own ids (and none) mean the default."""
    if not model_id or model_id.startswith(ELEVENLABS_MODEL_PREFIX):
        return DEFAULT_MODEL_ALIAS
    return model_id


def text_normalization(setting: Normalization) -> bool | None:
    """``auto`` follows the gateway's ``TTS_TEXT_NORMALIZATION``."""
    return {"auto": None, "on": True, "off": False}[setting]


class VoiceSettings(BaseModel):
    model_config = ConfigDict(extra="ignore")

    speed: float | None = Field(None, ge=0.25, le=4.0, allow_inf_nan=False)


class TextToSpeechQuery(BaseModel):
    model_config = ConfigDict(extra="ignore")

    output_format: str = Field(DEFAULT_OUTPUT_FORMAT, max_length=64)
    optimize_streaming_latency: int | None = Field(None, ge=0, le=4)
    enable_logging: bool = True


class TextToSpeechBody(BaseModel):
    """Body of ``POST /v1/text-to-speech/{voice_id}`` and its ``/stream`` and timestamped forms."""

    model_config = ConfigDict(extra="ignore")

    text: str = Field(min_length=1, max_length=MAX_INPUT_CHARS)
    model_id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    voice_settings: VoiceSettings | None = None
    language_code: str | None = Field(None, max_length=16)
    seed: int | None = Field(None, ge=0, le=4_294_967_295)
    previous_text: str | None = None
    next_text: str | None = None
    apply_text_normalization: Normalization = "auto"

    @field_validator("text")
    @classmethod
    def _clean_text(cls, value: str) -> str:
        value = clean_text(value)
        if not value.strip():
            raise ValueError("text must contain something to speak")
        return value

    def speech_request(self, voice_id: str) -> SpeechRequest:
        """The request in the gateway's terms: what the speech service plans and synthesises (as 24 kHz PCM)."""
        speed = self.voice_settings.speed if self.voice_settings is not None else None
        return SpeechRequest(
            model=gateway_model(self.model_id),
            input=self.text,
            voice=voice_id,
            response_format="pcm",
            speed=1.0 if speed is None else speed,
            seed=self.seed,
            text_normalization=text_normalization(self.apply_text_normalization),
        )


class CharacterAlignment(BaseModel):
    characters: list[str]
    character_start_times_seconds: list[float]
    character_end_times_seconds: list[float]


class AudioWithTimestamps(BaseModel):
    """One answer of ``/with-timestamps``, or one line of ``/stream/with-timestamps``."""

    audio_base64: str
    alignment: CharacterAlignment | None
    normalized_alignment: CharacterAlignment | None


class ElevenLabsVoice(BaseModel):
    voice_id: str
    name: str
    category: Literal["premade", "cloned"]
    labels: dict[str, str] = Field(default_factory=dict)
    description: str | None = None
    preview_url: str | None = None
    settings: None = None
    high_quality_base_model_ids: list[str] = Field(description="models that can speak with this voice")
    created_at_unix: int | None = None

    @classmethod
    def of(cls, voice: VoiceInfo) -> ElevenLabsVoice:
        return cls(
            voice_id=voice.id,
            name=voice.name,
            category="cloned" if voice.type == "uploaded" else "premade",
            description=voice.transcript,
            high_quality_base_model_ids=voice.models,
            created_at_unix=voice.created_at,
        )


class VoicesResponse(BaseModel):
    voices: list[ElevenLabsVoice]


class VoicesPage(BaseModel):
    voices: list[ElevenLabsVoice]
    has_more: bool
    total_count: int
    next_page_token: str | None


class Language(BaseModel):
    language_id: str
    name: str


class ElevenLabsModel(BaseModel):
    model_id: str
    name: str
    description: str
    can_do_text_to_speech: bool = True
    can_do_voice_conversion: bool = False
    can_use_style: bool = False
    can_use_speaker_boost: bool = False
    serves_pro_voices: bool = False
    requires_alpha_access: bool = False
    maximum_text_length_per_request: int = MAX_INPUT_CHARS
    languages: list[Language]

    @classmethod
    def of(cls, model: SpeechModel) -> ElevenLabsModel:
        return cls(
            model_id=model.id,
            name=model.description or model.id,
            description=model.description or model.id,
            languages=[Language(language_id=code, name=code) for code in model.languages],
        )


class ErrorDetail(BaseModel):
    status: str
    message: str


class ErrorResponse(BaseModel):
    """ElevenLabs' error envelope."""

    detail: ErrorDetail


ERROR_RESPONSES: Final[dict[int | str, dict[str, Any]]] = {
    "4XX": {"model": ErrorResponse, "description": "The request is invalid (ElevenLabs error envelope)"},
    "5XX": {"model": ErrorResponse, "description": "The gateway or a Triton server failed (ElevenLabs error envelope)"},
}


def error_response(status_code: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": {"status": code, "message": message}}, status_code=status_code, headers=headers)


def gateway_error_response(exc: GatewayError) -> JSONResponse:
    return error_response(exc.status_code, exc.code or exc.error_type, exc.message, exc.headers)


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(part) for part in first.get("loc", ())[1:])
    message = str(first.get("msg", "invalid request"))
    return error_response(422, "invalid_value", f"{where}: {message}" if where else message)
