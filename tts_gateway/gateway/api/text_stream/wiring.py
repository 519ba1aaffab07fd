"""The text-streaming sockets built over the gateway's services (called by the app's lifespan)."""

from __future__ import annotations

import functools

from tts_gateway.gateway.api.dependencies import Services
from tts_gateway.gateway.api.text_stream.metrics import TextStreamMetrics
from tts_gateway.gateway.api.text_stream.service import TextStreamService
from tts_gateway.gateway.api.text_stream.session import TextStreamLimits
from tts_gateway.gateway.settings import Settings
from tts_gateway.gateway.speech.text_stream.synthesis import SpeechServicePhrases
from tts_gateway.gateway.speech.text_stream.text_streaming_model import TextStreamCalls
from tts_gateway.models.stage_trace import StageTrace


def text_stream_service(services: Services, settings: Settings) -> TextStreamService:
    limits = TextStreamLimits(
        max_sockets=settings.ws_max_sockets,
        max_contexts=settings.ws_max_contexts,
        max_buffered_chars=settings.ws_max_buffered_chars,
        max_socket_buffered_chars=settings.ws_max_socket_buffered_chars,
        speech_slots=settings.ws_socket_speech_slots,
    )
    sessions = TextStreamCalls(
        services.planner.normalize, services.pool, services.admission, StageTrace.from_env("gateway")
    )
    # The phrases of one context (a socket's context, a Wyoming request), each a speech request.
    phrases = functools.partial(SpeechServicePhrases, services.planner, services.speech.open_stream)
    return TextStreamService(services.planner, phrases, limits, TextStreamMetrics(services.metrics), sessions)
