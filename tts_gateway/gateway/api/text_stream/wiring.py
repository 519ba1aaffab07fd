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


def text_stream_service(services: Services, settings: Settings) -> TextStreamService:
    limits = TextStreamLimits(
        max_sockets=settings.ws_max_sockets,
        max_contexts=settings.ws_max_contexts,
        max_buffered_chars=settings.ws_max_buffered_chars,
        max_socket_buffered_chars=settings.ws_max_socket_buffered_chars,
        speech_slots=settings.ws_socket_speech_slots,
    )
    sessions = TextStreamCalls(services.catalog, services.planner.plan, services.pool, services.admission)
    return TextStreamService(speech_phrases(services, settings), limits, TextStreamMetrics(services.metrics), sessions)


def speech_phrases(services: Services, settings: Settings) -> SpeechServicePhrases:
    """Phrases of text streamed in (a socket's context, a Wyoming request), each a speech request."""
    return SpeechServicePhrases(
        services.planner.plan,
        services.speech.open_stream,
        # As long as a started response's sentence waits for a server (the pool's failover wait).
        functools.partial(services.catalog.until_ready, settings.backend_chunk_timeout),
    )
