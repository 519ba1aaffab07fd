"""Health, metrics and the root probe some clients send before speaking."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tts_gateway.gateway.dependencies import ServicesDep
from tts_gateway.gateway.protocol import ERROR_RESPONSES, BackendHealth, HealthStatus

router = APIRouter(responses=ERROR_RESPONSES)


@router.get("/health", response_model=HealthStatus, responses={503: {"model": HealthStatus}})
async def health(services: ServicesDep) -> JSONResponse:
    backend = services.backend
    ready = await backend.refresh()
    models = list(backend.catalog.models) if ready else []
    status = HealthStatus(
        status="ok" if ready else "unavailable",
        backend=",".join(backend.pool.entries),
        models=models,
        backends=[
            BackendHealth(
                address=b.address, entry=b.entry, ready=b.ready, models=sorted(b.models), outstanding=b.outstanding
            )
            for b in backend.pool.backends
        ],
    )
    return JSONResponse(status.model_dump(), status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response)
async def metrics(services: ServicesDep) -> Response:
    return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/")
async def root() -> dict[str, str]:
    return {"service": "tts-gateway", "api": "/v1/audio/speech", "docs": "/docs"}
