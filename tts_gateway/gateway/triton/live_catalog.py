"""The catalog of what the Triton pool serves, kept current.

The catalog is the union of what the ready servers serve. It is rebuilt whenever the set of
ready servers (or what they serve) changes, and is empty while none is ready, so the gateway
can start before Triton, report 503 meanwhile, and recover on its own when Triton comes back.
Calls to the models do not pass through here: they go to the pool (:class:`TritonPool`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

from tts_gateway.gateway.errors import ServerUnavailableError
from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.triton.client import TritonModelConfig
from tts_gateway.gateway.triton.model_catalog import ModelCatalog
from tts_gateway.gateway.triton.pool import TritonPool

logger = logging.getLogger(__name__)

# How often start-up checks the servers again while it waits for the default model.
_REFRESH_STEP = 0.2


class LiveCatalog:
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
        pool.on_change(self._rebuild)

    @property
    def current(self) -> ModelCatalog:
        """The current catalog; raises 503 while no Triton server is ready."""
        if self._catalog is None or not self._catalog.models:
            raise ServerUnavailableError("the Triton servers are not ready yet; retry shortly")
        return self._catalog

    @property
    def ready(self) -> bool:
        """Some ready Triton server serves the default model."""
        return self._catalog is not None and self._catalog.default is not None

    def builtin_voices(self) -> list[str]:
        """The own voices of every model served since start-up: one stays built in while its model is
        down (deleting it is refused as read-only, not answered as an unknown voice)."""
        return sorted(self._builtin_seen)

    async def refresh(self) -> bool:
        """Check every Triton server once; rebuild the catalog if what is served changed. Returns readiness."""
        if await self.pool.refresh() or self._catalog is None:
            self._rebuild()
        self._metrics.servers_ready.set(1 if self.ready else 0)
        return self.ready

    def _rebuild(self) -> None:
        configs: dict[str, TritonModelConfig] = {}
        for server in self.pool.ready_servers():
            for config in server.configs:
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
            logger.warning("no Triton server serves a speech model")

    async def wait_ready(self, within: float) -> bool:
        """Whether the default model is served within ``within`` seconds, checking the servers itself
        (start-up, before the watcher runs)."""
        return await _poll(self.refresh, within, _REFRESH_STEP)

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


async def _poll(condition: Callable[[], Awaitable[bool]], within: float, step: float) -> bool:
    """Whether ``condition`` holds within ``within`` seconds, asked every ``step`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await condition():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(step)
    return True
