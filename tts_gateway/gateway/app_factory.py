"""``create_app(settings)``: the FastAPI application and the lifespan that wires it."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from fastapi import FastAPI

from tts_gateway.allocator import keep_audio_buffers_in_heap, limit_malloc_arenas
from tts_gateway.gateway.api.auth import ApiKeyMiddleware
from tts_gateway.gateway.api.dependencies import Services
from tts_gateway.gateway.api.error_handlers import install_error_handlers
from tts_gateway.gateway.api.request_limits import RequestBodyLimitMiddleware
from tts_gateway.gateway.api.routes import elevenlabs, health, models, speech, text_to_speech_ws, voices
from tts_gateway.gateway.api.text_stream.wiring import text_stream_service
from tts_gateway.gateway.api.wyoming.server import serving
from tts_gateway.gateway.api.wyoming.wiring import wyoming_server
from tts_gateway.gateway.embedded.fleet import start_embedded_fleet
from tts_gateway.gateway.metrics import GatewayMetrics, HttpMetricsMiddleware
from tts_gateway.gateway.request_ids import RequestIdMiddleware
from tts_gateway.gateway.settings import OPENAI_MODEL_NAMES, Settings
from tts_gateway.gateway.speech.admission import AdmissionControl
from tts_gateway.gateway.speech.ffmpeg_threads import single_threaded_ffmpeg
from tts_gateway.gateway.speech.idle_memory import freeze_startup_objects
from tts_gateway.gateway.speech.plan import SpeechPlanner
from tts_gateway.gateway.speech.service import SpeechService
from tts_gateway.gateway.speech.text_normalization import TextNormalizer
from tts_gateway.gateway.speech.voice_registry import VoiceRegistry
from tts_gateway.gateway.triton.client import TritonClient
from tts_gateway.gateway.triton.live_catalog import LiveCatalog
from tts_gateway.gateway.triton.pool import TritonPool

logger = logging.getLogger(__name__)

# How long a gateway pointed at a remote Triton waits for it at start-up before serving 503s.
_REMOTE_STARTUP_WAIT = 10.0
# The voice upload route (routes/voices.py): its body may be as large as an upload plus the form fields.
_UPLOAD_ROUTE = ("POST", "/v1/audio/voices")
_LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    keep_audio_buffers_in_heap()
    limit_malloc_arenas()
    single_threaded_ffmpeg()
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        _log_exposure(settings)
        admission = AdmissionControl(
            slots=settings.max_concurrent_speech,
            max_queued=settings.max_queued_speech,
            queue_timeout=settings.queue_timeout,
            metrics=metrics,
        )
        async with AsyncExitStack() as stack:
            # Pushed first, so it runs last: this worker's live gauges leave a shared metrics directory.
            stack.callback(metrics.close)
            # The grammars load (a second or two) on a thread while Triton starts.
            loading = asyncio.create_task(asyncio.to_thread(TextNormalizer))
            stack.callback(loading.cancel)
            urls = settings.triton_urls
            if not urls:
                # Blocks the event loop until Triton is ready: nothing is served yet.
                fleet = start_embedded_fleet(settings, stack, metrics.embedded_restarts.inc)
                stack.push_async_callback(asyncio.to_thread, fleet.stop)
                urls = fleet.grpc_urls

            def connect(address: str) -> TritonClient:
                return TritonClient(
                    address, timeout=settings.backend_timeout, chunk_timeout=settings.backend_chunk_timeout
                )

            pool = TritonPool(
                urls,
                connect,
                metrics,
                resolve_interval=settings.triton_resolve_interval,
                # A stream resumed after its server failed waits for another as long as for a chunk.
                failover_wait=settings.backend_chunk_timeout,
            )
            stack.push_async_callback(pool.close)
            catalog = LiveCatalog(
                pool,
                metrics,
                default_model=settings.default_model,
                model_aliases=settings.model_aliases,
                openai_model_names=OPENAI_MODEL_NAMES,
            )
            stack.push_async_callback(catalog.close)
            registry = VoiceRegistry(
                settings.ref_audios_dir,
                settings.voices_dir,
                min_seconds=settings.ref_min_seconds,
                max_seconds=settings.ref_max_seconds,
                aliases=settings.voice_aliases,
            )
            await asyncio.to_thread(registry.load)
            wait = settings.embedded_startup_timeout if settings.triton_url is None else _REMOTE_STARTUP_WAIT
            if not await catalog.wait_ready(wait):
                logger.warning("Triton at %s is not ready; serving 503 until it is", ", ".join(urls))
            catalog.start_watching()
            normalizer = await loading
            stack.callback(normalizer.close)
            app.state.services = Services(
                settings=settings,
                catalog=catalog,
                pool=pool,
                voices=registry,
                planner=SpeechPlanner(catalog, registry, settings, normalizer),
                speech=SpeechService(
                    pool,
                    admission,
                    metrics,
                    request_timeout=settings.request_timeout,
                    synthesis_parallelism=settings.synthesis_parallelism,
                ),
                admission=admission,
                metrics=metrics,
                started_at=int(time.time()),
            )
            app.state.text_stream_service = text_stream_service(app.state.services, settings)
            wyoming = wyoming_server(app.state.services, app.state.text_stream_service, settings)
            if wyoming is not None:
                await stack.enter_async_context(serving(wyoming, announce=settings.wyoming_zeroconf))
            freeze_startup_objects()
            stack.callback(gc.unfreeze)
            yield

    app = FastAPI(
        title="TTS gateway",
        summary="OpenAI-compatible text-to-speech over NVIDIA Triton (CosyVoice2, Piper)",
        version="0.1.0",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    for module in (speech, elevenlabs, text_to_speech_ws, voices, models, health):
        app.include_router(module.router)
    # The last added runs first: every answer carries its request id, metrics see every answer, a
    # missing key is refused before the body is read, and the body limit applies before any route
    # parses anything.
    app.add_middleware(
        RequestBodyLimitMiddleware,
        default_limit=settings.request_max_bytes,
        route_limits={_UPLOAD_ROUTE: settings.upload_max_bytes + settings.request_max_bytes},
    )
    if settings.api_keys:
        app.add_middleware(
            ApiKeyMiddleware,
            keys=[key.get_secret_value() for key in settings.api_keys],
            public_paths=settings.public_endpoints,
        )
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)
    app.add_middleware(RequestIdMiddleware)
    return app


def _log_exposure(settings: Settings) -> None:
    if settings.api_keys:
        public = ", ".join(settings.public_endpoints) or "none"
        logger.info("API keys required (%d configured); public paths: %s", len(settings.api_keys), public)
    elif settings.host not in _LOOPBACK_HOSTS:
        logger.warning("listening on %s without API keys: anyone who can reach it can use it", settings.host)
