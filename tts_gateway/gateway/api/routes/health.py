"""Health, metrics and the root probe some clients send before speaking."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tts_gateway.gateway.api.dependencies import ServicesDep
from tts_gateway.gateway.api.openai_schema import ERROR_RESPONSES, HealthStatus, ServerHealth

router = APIRouter(responses=ERROR_RESPONSES)


@router.get("/health", response_model=HealthStatus, responses={503: {"model": HealthStatus}})
async def health(services: ServicesDep) -> JSONResponse:
    ready = await services.catalog.refresh()
    models = list(services.catalog.current.models) if ready else []
    status = HealthStatus(
        status="ok" if ready else "unavailable",
        backend=",".join(services.pool.entries),
        models=models,
        backends=[
            ServerHealth(
                address=s.address, entry=s.entry, ready=s.ready, models=sorted(s.models), outstanding=s.outstanding
            )
            for s in services.pool.servers
        ],
    )
    return JSONResponse(status.model_dump(), status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response)
async def metrics(services: ServicesDep) -> Response:
    return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/")
async def root() -> dict[str, str]:
    return {"service": "tts-gateway", "api": "/v1/audio/speech", "docs": "/docs"}
