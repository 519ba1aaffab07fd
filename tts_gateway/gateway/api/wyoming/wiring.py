"""The Wyoming server built over the gateway's services (called by the app's lifespan)."""

from __future__ import annotations

from tts_gateway.gateway.api.dependencies import Services
from tts_gateway.gateway.api.text_stream.service import TextStreamService
from tts_gateway.gateway.api.wyoming.handler import WyomingLimits
from tts_gateway.gateway.api.wyoming.server import WyomingServer
from tts_gateway.gateway.api.wyoming.voices import GatewayVoices
from tts_gateway.gateway.settings import Settings


def wyoming_server(
    services: Services, text_stream_service: TextStreamService, settings: Settings
) -> WyomingServer | None:
    """The server ``settings`` ask for (``None``: Wyoming is off). Its requests are planned and
    synthesised as the text-streaming WebSocket's contexts are."""
    port = settings.wyoming_port
    if port is None:
        return None
    return WyomingServer(
        settings.wyoming_host,
        port,
        voices=GatewayVoices(services.catalog, services.voices),
        synthesizers=text_stream_service.synthesizer,
        limits=WyomingLimits(
            max_connections=settings.wyoming_max_connections,
            max_buffered_chars=settings.wyoming_max_buffered_chars,
            idle_timeout=settings.wyoming_idle_timeout,
        ),
        metrics=services.metrics,
        reuse_port=settings.workers > 1,
    )
