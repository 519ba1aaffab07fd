"""The speech backend as the gateway sees it: a Triton client and the catalog of its models.

The catalog is (re)built from Triton whenever Triton is ready and no catalog is
known yet, and dropped when Triton stops answering, so the gateway can start before
Triton, report 503 meanwhile, and recover on its own when Triton comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping

from app.errors import BackendUnavailableError, GatewayError
from app.metrics import GatewayMetrics
from app.model_catalog import ModelCatalog
from app.triton_client import TritonClient

logger = logging.getLogger(__name__)


class SpeechBackend:
    def __init__(
        self,
        client: TritonClient,
        metrics: GatewayMetrics,
        *,
        default_model: str | None,
        model_aliases: Mapping[str, str],
        openai_model_names: Iterable[str],
        poll_interval: float = 2.0,
    ) -> None:
        self.client = client
        self._metrics = metrics
        self._default_model = default_model
        self._model_aliases = dict(model_aliases)
        self._openai_names = tuple(openai_model_names)
        self._poll_interval = poll_interval
        self._catalog: ModelCatalog | None = None
        self._watcher: asyncio.Task[None] | None = None

    @property
    def catalog(self) -> ModelCatalog:
        """The current catalog; raises 503 while the backend is not ready."""
        if self._catalog is None or not self._catalog.models:
            raise BackendUnavailableError("speech backend is not ready yet; retry shortly")
        return self._catalog

    @property
    def ready(self) -> bool:
        return self._catalog is not None and bool(self._catalog.models)

    async def refresh(self) -> bool:
        """Check Triton once; rebuild or drop the catalog accordingly. Returns readiness."""
        if not await self.client.is_ready():
            if self._catalog is not None:
                logger.warning("Triton at %s is not ready", self.client.url)
            self._catalog = None
        elif not self.ready:
            # No catalog yet, or one taken while the speech models were still loading.
            try:
                configs = await self.client.model_configs()
            except GatewayError as exc:
                logger.warning("cannot read model configs: %s", exc.message)
                return False
            self._catalog = ModelCatalog.from_triton(
                configs,
                default_model=self._default_model,
                aliases=self._model_aliases,
                openai_names=self._openai_names,
            )
            logger.info("speech models ready: %s", ", ".join(self._catalog.models) or "none")
        self._metrics.backend_ready.set(1 if self.ready else 0)
        return self.ready

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

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.client.close()
