"""The speech backend as the gateway sees it: a pool of Triton servers and the catalog of their models.

The catalog is the union of what the ready servers serve. It is rebuilt whenever the set of
ready servers (or what they serve) changes, and is empty while none is ready, so the gateway
can start before Triton, report 503 meanwhile, and recover on its own when Triton comes back.
Calls go to the least busy ready server that serves the model; one that fails before its first
audio is sent once more to another server, so a server going down costs no request that had
not started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from tts_gateway.gateway.errors import BackendError, BackendUnavailableError, GatewayError, ModelUnavailableError
from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.model_catalog import ModelCatalog
from tts_gateway.gateway.triton_client import TritonModelConfig
from tts_gateway.gateway.triton_pool import TritonBackend, TritonPool

logger = logging.getLogger(__name__)

# Failures worth another server: it is down or broke, not the request (a 400) or a slow model (a 504).
_RETRIED = (BackendUnavailableError, BackendError)


class SpeechBackend:
    def __init__(
        self,
        pool: TritonPool,
        metrics: GatewayMetrics,
        *,
        default_model: str | None,
        model_aliases: Mapping[str, str],
        openai_model_names: Iterable[str],
        poll_interval: float = 2.0,
    ) -> None:
        self.pool = pool
        self._metrics = metrics
        self._default_model = default_model
        self._model_aliases = dict(model_aliases)
        self._openai_names = tuple(openai_model_names)
        self._poll_interval = poll_interval
        self._catalog: ModelCatalog | None = None
        self._builtin_seen: set[str] = set()
        self._watcher: asyncio.Task[None] | None = None

    @property
    def catalog(self) -> ModelCatalog:
        """The current catalog; raises 503 while no backend is ready."""
        if self._catalog is None or not self._catalog.models:
            raise BackendUnavailableError("speech backend is not ready yet; retry shortly")
        return self._catalog

    @property
    def ready(self) -> bool:
        """Some ready backend serves the default model."""
        return self._catalog is not None and self._catalog.default is not None

    def builtin_voices(self) -> list[str]:
        """The own voices of every model served since start-up: one stays built in while its model is
        down (deleting it is refused as read-only, not answered as an unknown voice)."""
        return sorted(self._builtin_seen)

    async def refresh(self) -> bool:
        """Check every backend once; rebuild the catalog if what is served changed. Returns readiness."""
        if await self.pool.refresh() or self._catalog is None:
            self._rebuild()
        self._metrics.backend_ready.set(1 if self.ready else 0)
        return self.ready

    def _rebuild(self) -> None:
        configs: dict[str, TritonModelConfig] = {}
        for backend in self.pool.ready_backends():
            for config in backend.configs:
                configs.setdefault(config.name, config)
        before = list(self._catalog.models) if self._catalog is not None else None
        self._catalog = ModelCatalog.from_triton(
            configs.values(),
            default_model=self._default_model,
            aliases=self._model_aliases,
            openai_names=self._openai_names,
        )
        self._builtin_seen.update(self._catalog.builtin_voices)
        if list(self._catalog.models) == before:
            return
        if self._catalog.models:
            logger.info("speech models ready: %s", ", ".join(self._catalog.models))
        elif before:
            logger.warning("no Triton backend serves a speech model")

    async def wait_ready(self, within: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while not await self.refresh():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.2)
        return True

    def start_watching(self) -> None:
        self._watcher = asyncio.create_task(self._watch(), name="triton-watch")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval)
            try:
                await self.refresh()
            except Exception:
                # The watcher is what brings the gateway back when Triton does: it must not die.
                logger.exception("checking Triton failed")

    # -- calls -----------------------------------------------------------------------------------

    def _choose(self, model: str, tried: list[TritonBackend], failure: GatewayError | None) -> TritonBackend:
        backend = self.pool.pick(model, exclude=tried)
        if backend is None:
            raise failure or BackendUnavailableError(f"no ready speech backend serves model {model!r}")
        return backend

    def _failed(self, backend: TritonBackend, exc: GatewayError, request_id: str) -> None:
        # A model that reports itself unavailable answered: its Triton is up and keeps its other models.
        if isinstance(exc, BackendUnavailableError) and not isinstance(exc, ModelUnavailableError):
            self.pool.mark_down(backend)
            self._rebuild()
        logger.warning(
            "request %s failed at %s before any audio (%s); retrying elsewhere",
            request_id,
            backend.address,
            exc.message,
        )
        self._metrics.triton_retries.inc()

    async def infer(self, model: str, values: Mapping[str, Any], request_id: str) -> NDArray[np.float32]:
        """One offline call on the least busy backend, sent once more elsewhere if it fails."""
        tried: list[TritonBackend] = []
        failure: GatewayError | None = None
        while True:
            backend = self._choose(model, tried, failure)
            try:
                with self.pool.call(backend):
                    return await backend.client.infer(model, values, request_id)
            except _RETRIED as exc:
                if tried:
                    raise
                self._failed(backend, exc, request_id)
                tried.append(backend)
                failure = exc

    async def stream(
        self, model: str, values: Mapping[str, Any], request_id: str
    ) -> AsyncGenerator[NDArray[np.float32], None]:
        """A decoupled model's chunks from the least busy backend; before the first chunk, a failed
        call is sent once more elsewhere, after it the failure is the caller's."""
        tried: list[TritonBackend] = []
        failure: GatewayError | None = None
        while True:
            backend = self._choose(model, tried, failure)
            started = False
            try:
                with self.pool.call(backend):
                    async with contextlib.aclosing(backend.client.stream(model, values, request_id)) as chunks:
                        async for chunk in chunks:
                            started = True
                            yield chunk
                return
            except _RETRIED as exc:
                if started or tried:
                    raise
                self._failed(backend, exc, request_id)
                tried.append(backend)
                failure = exc

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.pool.close()
