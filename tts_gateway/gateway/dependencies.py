"""What routes receive: the services built once by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from tts_gateway.gateway.admission import AdmissionControl
from tts_gateway.gateway.live_catalog import LiveCatalog
from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.settings import Settings
from tts_gateway.gateway.speech_plan import SpeechPlanner
from tts_gateway.gateway.speech_service import SpeechService
from tts_gateway.gateway.triton_pool import TritonPool
from tts_gateway.gateway.voice_registry import VoiceRegistry


@dataclass(frozen=True)
class Services:
    settings: Settings
    catalog: LiveCatalog
    pool: TritonPool
    voices: VoiceRegistry
    planner: SpeechPlanner
    speech: SpeechService
    admission: AdmissionControl
    """The speech service's synthesis slots, which text-streaming sessions hold too."""
    metrics: GatewayMetrics
    started_at: int


async def get_services(request: Request) -> Services:
    # Async: FastAPI would run a plain function on its thread pool, a thread hop per request.
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]
