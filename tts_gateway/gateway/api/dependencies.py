"""What routes receive: the services built once by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.settings import Settings
from tts_gateway.gateway.speech.admission import AdmissionControl
from tts_gateway.gateway.speech.plan import SpeechPlanner
from tts_gateway.gateway.speech.service import SpeechService
from tts_gateway.gateway.speech.voice_registry import VoiceRegistry
from tts_gateway.gateway.triton.live_catalog import LiveCatalog
from tts_gateway.gateway.triton.pool import TritonPool


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
