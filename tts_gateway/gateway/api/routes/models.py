"""Model listings: OpenAI's ``/v1/models`` and the community ``/v1/audio/models``.

``/v1/models`` answers ElevenLabs' clients in ElevenLabs' shape (a bare list of models): they send their
key as ``xi-api-key`` and OpenAI's clients as ``Authorization: Bearer``, so a request with the first and
without the second gets ElevenLabs' list.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header
from fastapi.responses import JSONResponse

from tts_gateway.gateway.api.dependencies import ServicesDep
from tts_gateway.gateway.api.elevenlabs_api import ElevenLabsModel
from tts_gateway.gateway.api.openai_schema import ERROR_RESPONSES, AudioModel, AudioModelList, ModelCard, ModelList
from tts_gateway.gateway.errors import NotFoundError

router = APIRouter(responses=ERROR_RESPONSES)


@router.get(
    "/v1/models",
    response_model=ModelList,
    responses={200: {"description": "ElevenLabs' shape, a list of models, for a request with `xi-api-key`"}},
)
async def list_models(
    services: ServicesDep,
    xi_api_key: Annotated[str | None, Header(include_in_schema=False)] = None,
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> ModelList | JSONResponse:
    catalog = services.catalog.current
    if xi_api_key is not None and authorization is None:
        return JSONResponse([ElevenLabsModel.of(model).model_dump() for model in catalog.models.values()])
    created = services.started_at
    names = [*catalog.models, *catalog.aliases]
    return ModelList(data=[ModelCard(id=name, created=created) for name in names])


@router.get("/v1/models/{model_id}")
async def get_model(model_id: str, services: ServicesDep) -> ModelCard:
    catalog = services.catalog.current
    if model_id not in catalog.models and model_id not in catalog.aliases:
        raise NotFoundError(f"model {model_id!r} does not exist", param="model", code="model_not_found")
    return ModelCard(id=model_id, created=services.started_at)


@router.get("/v1/audio/models")
async def list_audio_models(services: ServicesDep) -> AudioModelList:
    catalog = services.catalog.current
    return AudioModelList(
        models=[
            AudioModel(
                id=m.id,
                name=m.description or m.id,
                sample_rate=m.sample_rate,
                supports_cloning=m.supports_cloning,
                native_speed=m.supports_speed,
                supports_streaming=m.supports_streaming,
                languages=list(m.languages),
                voices=list(m.builtin_voices),
            )
            for m in catalog.models.values()
        ]
    )
