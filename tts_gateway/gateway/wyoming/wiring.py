"""The Wyoming server built over the gateway's services (called by the app's lifespan)."""

from __future__ import annotations

from tts_gateway.gateway.dependencies import Services
from tts_gateway.gateway.settings import Settings
from tts_gateway.gateway.text_stream.service import TextStreams
from tts_gateway.gateway.wyoming.handler import WyomingLimits
from tts_gateway.gateway.wyoming.server import WyomingServer
from tts_gateway.gateway.wyoming.voices import GatewayVoices


def wyoming_server(services: Services, text_streams: TextStreams, settings: Settings) -> WyomingServer | None:
    """The server ``settings`` ask for (``None``: Wyoming is off). Its requests are planned and
    synthesised as the text-streaming WebSocket's contexts are."""
    port = settings.wyoming_port
    if port is None:
        return None
    return WyomingServer(
        settings.wyoming_host,
        port,
        voices=GatewayVoices(services.catalog, services.voices),
        synthesizers=text_streams.synthesizer,
        limits=WyomingLimits(
            max_connections=settings.wyoming_max_connections,
            max_buffered_chars=settings.wyoming_max_buffered_chars,
            idle_timeout=settings.wyoming_idle_timeout,
        ),
        metrics=services.metrics,
        reuse_port=settings.workers > 1,
    )
