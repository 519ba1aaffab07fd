"""Voice listing, upload and deletion."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Query, UploadFile

from tts_gateway.gateway.api.dependencies import ServicesDep
from tts_gateway.gateway.api.openai_schema import ERROR_RESPONSES, VoiceDeleted, VoiceList, VoiceObject
from tts_gateway.gateway.errors import PayloadTooLargeError
from tts_gateway.gateway.speech.voice_registry import VOICE_ID_PATTERN

router = APIRouter()

_READ_CHUNK = 1 << 16


@router.get("/v1/audio/voices", responses=ERROR_RESPONSES)
async def list_voices(
    services: ServicesDep,
    model: Annotated[str | None, Query(description="only the voices this model (or alias) can speak")] = None,
    include_all: Annotated[bool, Query(alias="all", description="also the voices no deployed model can speak")] = False,
) -> VoiceList:
    catalog = services.catalog.current
    speaker = catalog.resolve(model) if model is not None else None
    return VoiceList(voices=services.voices.describe(catalog, speaker, everything=include_all))


@router.post("/v1/audio/voices", status_code=201, responses=ERROR_RESPONSES)
async def upload_voice(
    services: ServicesDep,
    name: Annotated[
        str,
        # The pattern is documented here and checked by the registry, whose message explains it.
        Form(max_length=64, json_schema_extra={"pattern": f"^{VOICE_ID_PATTERN.pattern}$"}),
    ],
    audio_sample: Annotated[UploadFile, File(description="reference recording, any common format")],
    transcript: Annotated[str | None, Form(description="what the recording says; improves cloning")] = None,
    consent: Annotated[str | None, Form(description="accepted for OpenAI compatibility")] = None,
) -> VoiceObject:
    limit = services.settings.upload_max_bytes
    data = bytearray()
    while chunk := await audio_sample.read(_READ_CHUNK):
        data += chunk
        if len(data) > limit:
            raise PayloadTooLargeError(f"audio_sample is larger than {limit} bytes", param="audio_sample")
    voice = await services.voices.add_upload(name, bytes(data), transcript, services.catalog.current.builtin_voices)
    return VoiceObject(
        id=voice.id,
        name=voice.id,
        created_at=voice.created_at,
        transcript=voice.transcript,
        duration=round(voice.audio.duration, 3),
    )


@router.delete("/v1/audio/voices/{voice_id}", responses=ERROR_RESPONSES)
async def delete_voice(voice_id: str, services: ServicesDep) -> VoiceDeleted:
    await services.voices.delete(voice_id, services.catalog.builtin_voices())
    return VoiceDeleted(id=voice_id)
