"""WebSocket /v1/text-to-speech/{voice_id}/stream-input and .../multi-stream-input (ElevenLabs' API)."""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from tts_gateway.gateway.api.text_stream.service import TextStreamService

router = APIRouter()


def _streams(websocket: WebSocket) -> TextStreamService:
    streams: TextStreamService = websocket.app.state.text_stream_service
    return streams


@router.websocket("/v1/text-to-speech/{voice_id}/stream-input")
async def stream_input(websocket: WebSocket, voice_id: str) -> None:
    await _streams(websocket).serve(websocket, voice_id, multi=False)


@router.websocket("/v1/text-to-speech/{voice_id}/multi-stream-input")
async def multi_stream_input(websocket: WebSocket, voice_id: str) -> None:
    await _streams(websocket).serve(websocket, voice_id, multi=True)
