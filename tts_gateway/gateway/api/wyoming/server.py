"""The Wyoming server of one gateway worker: its TCP port, its connections, its announcement.

Started by the app's lifespan when ``TTS_WYOMING_PORT`` is set, once the speech services exist,
and stopped before them: open connections are ended, their synthesis cancelled.

With ``--workers N`` every worker serves the port (``SO_REUSEPORT``: the kernel spreads the
connections over the workers), so Wyoming keeps being served while a worker restarts; the
connection limit is per worker, as the WebSocket's is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Final

from prometheus_client import Counter, Gauge
from wyoming.server import AsyncTcpServer, HandlerFactory

from tts_gateway.gateway.api.text_stream.session import SynthesizerFactory
from tts_gateway.gateway.api.wyoming.discovery import Announcement
from tts_gateway.gateway.api.wyoming.handler import Voices, WyomingHandler, WyomingLimits
from tts_gateway.gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

# How long stopping waits for the connections' tasks to end after it has cancelled their synthesis.
_STOP_WAIT: Final = 5.0
_LOOPBACK_HOSTS: Final = ("127.0.0.1", "::1", "localhost")


class _TcpServer(AsyncTcpServer):
    """The library's TCP server, able to share its port with the other workers."""

    def __init__(self, host: str, port: int, *, reuse_port: bool) -> None:
        super().__init__(host, port)
        self._reuse_port = reuse_port

    async def start(self, handler_factory: HandlerFactory) -> None:
        self._server = await asyncio.start_server(
            partial(self._handler_callback, handler_factory),
            host=self.host,
            port=self.port,
            reuse_port=self._reuse_port or None,
        )

    async def stop(self) -> None:
        tasks = list(self._handlers)
        await super().stop()
        if tasks:
            await asyncio.wait(tasks, timeout=_STOP_WAIT)


class WyomingServer:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        voices: Voices,
        synthesizers: SynthesizerFactory,
        limits: WyomingLimits,
        metrics: GatewayMetrics,
        reuse_port: bool = False,
    ) -> None:
        self.host = host
        self.port = port
        self._voices = voices
        self._synthesizers = synthesizers
        self._limits = limits
        self._tcp = _TcpServer(host, port, reuse_port=reuse_port)
        self._open: set[WyomingHandler] = set()
        self._connections = Gauge(
            "tts_wyoming_connections_open",
            "Wyoming connections open",
            registry=metrics.registry,
            multiprocess_mode="livesum",
        )
        self._errors = Counter(
            "tts_wyoming_errors",
            "Wyoming error events sent (each ends its connection), by code",
            ["code"],
            registry=metrics.registry,
        )

    def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> WyomingHandler:
        limit = self._limits.max_connections
        refusal = f"connection limit: {limit} Wyoming connections are open" if len(self._open) >= limit else ""
        handler = WyomingHandler(
            reader,
            writer,
            voices=self._voices,
            synthesizers=self._synthesizers,
            limits=self._limits,
            refusal=refusal,
            on_close=self._closed,
            on_error=lambda code: self._errors.labels(code).inc(),
        )
        if refusal:
            logger.warning("Wyoming connection refused: %s", refusal)
        else:
            self._open.add(handler)
            self._connections.inc()
        return handler

    def _closed(self, handler: WyomingHandler) -> None:
        if handler in self._open:
            self._open.discard(handler)
            self._connections.dec()

    async def start(self) -> None:
        await self._tcp.start(self._connect)
        logger.info("Wyoming text-to-speech server on tcp://%s:%d", self.host, self.port)
        if self.host not in _LOOPBACK_HOSTS:
            logger.warning("Wyoming has no authentication: anyone who can reach %s:%d can use it", self.host, self.port)

    async def stop(self) -> None:
        await self._tcp.stop()


@asynccontextmanager
async def serving(server: WyomingServer, *, announce: bool) -> AsyncIterator[WyomingServer]:
    """``server`` listening (and announced over zeroconf if asked) for the duration of the block."""
    # Built first: an address it cannot announce fails the start before the port is bound.
    announcement = Announcement(server.host, server.port) if announce else None
    await server.start()
    try:
        if announcement is not None:
            await announcement.start()
        yield server
    finally:
        if announcement is not None:
            await announcement.stop()
        await server.stop()
