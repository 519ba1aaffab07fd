"""POST /v1/audio/speech."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tts_gateway.gateway.api.dependencies import ServicesDep
from tts_gateway.gateway.api.openai_schema import ERROR_RESPONSES
from tts_gateway.gateway.speech.audio_encoding import CONTENT_TYPES
from tts_gateway.gateway.speech.request import SpeechRequest
from tts_gateway.gateway.speech.service import StreamAborted

router = APIRouter()

_SSE = "text/event-stream"


class ResponseBody(Protocol):
    """A speech response's body: a :class:`SpeechStream`, or another API's view of one."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class SpeechResponse(StreamingResponse):
    """Closes its speech stream however the response ends (sent, client gone, failed).

    That stops the synthesis and frees the request's synthesis slot at once. A stream that
    cannot be completed (:class:`StreamAborted`, already logged) returns without the end of
    the body, so the gateway drops the connection and the client sees an error, not a short file.
    """

    def __init__(self, stream: ResponseBody, *, media_type: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(stream, media_type=media_type, headers=headers)
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except StreamAborted:
            pass
        finally:
            await self._stream.aclose()


@router.post(
    "/v1/audio/speech",
    response_class=StreamingResponse,
    responses={200: {"content": {mime: {} for mime in sorted({*CONTENT_TYPES.values(), _SSE})}}, **ERROR_RESPONSES},
)
async def create_speech(body: SpeechRequest, services: ServicesDep) -> StreamingResponse:
    plan = await services.planner.plan(body)
    stream = await services.speech.open_stream(plan)
    if plan.sse:
        return SpeechResponse(stream, media_type=_SSE, headers={"Cache-Control": "no-cache"})
    return SpeechResponse(stream, media_type=CONTENT_TYPES[plan.response_format])
