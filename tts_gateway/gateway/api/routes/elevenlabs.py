"""ElevenLabs' REST API: ``POST /v1/text-to-speech/{voice_id}`` (``/stream``, ``/with-timestamps``,
``/stream/with-timestamps``), ``GET /v1/voices``, ``/v2/voices``, ``/v1/voices/{voice_id}``.

Errors on these paths use ElevenLabs' envelope (:class:`ElevenLabsRoute`). ElevenLabs' model list
is served on ``/v1/models`` to ElevenLabs' clients (routes/models.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from tts_gateway.gateway.api.dependencies import Services, ServicesDep
from tts_gateway.gateway.api.elevenlabs_api import (
    ERROR_RESPONSES,
    AudioWithTimestamps,
    ElevenLabsVoice,
    TextToSpeechBody,
    TextToSpeechQuery,
    VoicesPage,
    VoicesResponse,
    error_response,
    gateway_error_response,
    validation_error_response,
)
from tts_gateway.gateway.api.elevenlabs_speech import VOICE_NOT_FOUND, ElevenLabsAudio, ElevenLabsSpeech
from tts_gateway.gateway.api.routes.speech import SpeechResponse
from tts_gateway.gateway.errors import GatewayError, NotFoundError
from tts_gateway.gateway.speech.request import MAX_NAME_CHARS
from tts_gateway.gateway.speech.text_stream.output_format import FORMATS

logger = logging.getLogger(__name__)

_NDJSON = "application/x-ndjson"


class ElevenLabsRoute(APIRoute):
    """A route whose errors (validation and a method it does not serve included) answer in ElevenLabs'
    envelope, not OpenAI's."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette raises a 405 here, which the app would answer in OpenAI's envelope; every ElevenLabs
        # path has one route, so its methods are all the path allows.
        if self.methods and scope["method"] not in self.methods:
            allow = ", ".join(sorted(self.methods))
            message = f"method {scope['method']} is not allowed on {scope['path']}; allowed: {allow}"
            await error_response(405, "method_not_allowed", message, {"Allow": allow})(scope, receive, send)
            return
        await super().handle(scope, receive, send)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return validation_error_response(exc)
            except HTTPException as exc:
                # FastAPI's own refusals inside the handler, such as a body that is not UTF-8 at all.
                return error_response(exc.status_code, "invalid_request", str(exc.detail), dict(exc.headers or {}))
            except GatewayError as exc:
                if exc.status_code >= 500:
                    logger.warning("request failed: %s (%s)", exc.message, exc.code)
                return gateway_error_response(exc)

        return route


router = APIRouter(route_class=ElevenLabsRoute, responses=ERROR_RESPONSES)

QueryDep = Annotated[TextToSpeechQuery, Query()]


class _Body:
    """A response body over one ElevenLabs response's audio: closing it frees the synthesis."""

    def __init__(self, audio: ElevenLabsAudio, pieces: AsyncIterator[bytes]) -> None:
        self._audio = audio
        self._pieces = pieces

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._pieces

    async def aclose(self) -> None:
        await self._audio.aclose()


def _speech(services: Services) -> ElevenLabsSpeech:
    return ElevenLabsSpeech(services.planner.plan, services.speech.open_stream)


async def _audio_response(
    services: Services, voice_id: str, body: TextToSpeechBody, query: TextToSpeechQuery, *, streaming: bool
) -> StreamingResponse:
    audio = await _speech(services).open(voice_id, body, query, streaming=streaming)
    return SpeechResponse(_Body(audio, audio.audio()), media_type=audio.format.content_type)


_MEDIA_TYPES = sorted({fmt.content_type for fmt in FORMATS.values()})
_AUDIO: dict[int | str, dict[str, Any]] = {200: {"content": {mime: {} for mime in _MEDIA_TYPES}}}


@router.post("/v1/text-to-speech/{voice_id}", response_class=StreamingResponse, responses=_AUDIO)
async def convert(voice_id: str, body: TextToSpeechBody, query: QueryDep, services: ServicesDep) -> StreamingResponse:
    return await _audio_response(services, voice_id, body, query, streaming=False)


@router.post("/v1/text-to-speech/{voice_id}/stream", response_class=StreamingResponse, responses=_AUDIO)
async def stream(voice_id: str, body: TextToSpeechBody, query: QueryDep, services: ServicesDep) -> StreamingResponse:
    return await _audio_response(services, voice_id, body, query, streaming=True)


@router.post("/v1/text-to-speech/{voice_id}/with-timestamps")
async def convert_with_timestamps(
    voice_id: str, body: TextToSpeechBody, query: QueryDep, services: ServicesDep
) -> AudioWithTimestamps:
    audio = await _speech(services).open(voice_id, body, query, streaming=False)
    try:
        return await audio.timestamped_whole()
    finally:
        await audio.aclose()


@router.post(
    "/v1/text-to-speech/{voice_id}/stream/with-timestamps",
    response_class=StreamingResponse,
    responses={200: {"content": {_NDJSON: {}}, "description": "one AudioWithTimestamps object a line"}},
)
async def stream_with_timestamps(
    voice_id: str, body: TextToSpeechBody, query: QueryDep, services: ServicesDep
) -> StreamingResponse:
    audio = await _speech(services).open(voice_id, body, query, streaming=True)

    async def lines() -> AsyncIterator[bytes]:
        async for piece in audio.timestamped():
            yield json.dumps(piece.model_dump(), separators=(",", ":")).encode() + b"\n"

    return SpeechResponse(_Body(audio, lines()), media_type=_NDJSON)


def _voices(services: Services) -> list[ElevenLabsVoice]:
    return [ElevenLabsVoice.of(voice) for voice in services.voices.describe(services.catalog.current)]


@router.get("/v1/voices")
async def list_voices(services: ServicesDep) -> VoicesResponse:
    return VoicesResponse(voices=_voices(services))


@router.get("/v2/voices")
async def search_voices(
    services: ServicesDep,
    search: Annotated[str, Query(max_length=MAX_NAME_CHARS, description="part of a voice's id or name")] = "",
    page_size: Annotated[int, Query(ge=1, le=100)] = 10,
    next_page_token: Annotated[str, Query(pattern=r"^\d{0,6}$", description="from the previous page")] = "",
) -> VoicesPage:
    needle = search.lower()
    voices = [v for v in _voices(services) if needle in v.voice_id.lower() or needle in v.name.lower()]
    start = int(next_page_token or 0)
    end = start + page_size
    return VoicesPage(
        voices=voices[start:end],
        has_more=end < len(voices),
        total_count=len(voices),
        next_page_token=str(end) if end < len(voices) else None,
    )


@router.get("/v1/voices/{voice_id}")
async def get_voice(voice_id: str, services: ServicesDep) -> ElevenLabsVoice:
    for voice in _voices(services):
        if voice.voice_id == voice_id:
            return voice
    raise NotFoundError(f"voice {voice_id!r} does not exist", code=VOICE_NOT_FOUND)
