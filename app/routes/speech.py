"""POST /v1/audio/speech."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from app.audio_encoding import CONTENT_TYPES
from app.dependencies import ServicesDep
from app.protocol import SpeechRequest

router = APIRouter()


@router.post(
    "/v1/audio/speech",
    response_class=StreamingResponse,
    responses={200: {"content": {mime: {} for mime in sorted(set(CONTENT_TYPES.values()))}}},
)
async def create_speech(body: SpeechRequest, services: ServicesDep) -> StreamingResponse:
    plan = services.speech.plan(body)
    stream = await services.speech.open_stream(plan)
    if plan.sse:
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return StreamingResponse(stream, media_type=CONTENT_TYPES[plan.response_format])
