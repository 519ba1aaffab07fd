"""Prometheus metrics of one gateway instance (own registry, so several apps can coexist)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # process_resident_memory_bytes, process_open_fds, process_cpu_seconds_total, ...
        ProcessCollector(registry=self.registry)
        self.event_loop_tasks = Gauge(
            "tts_event_loop_tasks",
            "asyncio tasks alive on the event loop (a leak shows as growth)",
            registry=self.registry,
        )
        self.http_requests = Counter(
            "tts_http_requests",
            "HTTP requests by route and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.speech_requests = Counter(
            "tts_speech_requests",
            "Speech requests by model, response format and outcome",
            ["model", "format", "outcome"],
            registry=self.registry,
        )
        self.in_flight = Gauge("tts_speech_in_flight", "Speech responses being produced", registry=self.registry)
        self.first_audio = Histogram(
            "tts_time_to_first_audio_seconds",
            "Request start to first audio byte handed to the server",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "tts_speech_duration_seconds",
            "Request start to last byte",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.audio_seconds = Counter(
            "tts_audio_seconds", "Seconds of audio produced", ["model"], registry=self.registry
        )
        self.backend_ready = Gauge("tts_backend_ready", "1 when the speech backend is ready", registry=self.registry)
        self.speech_slots = Gauge(
            "tts_speech_slots", "Speech requests that may be synthesised at once", registry=self.registry
        )
        self.speech_slots_in_use = Gauge(
            "tts_speech_slots_in_use", "Speech requests holding a synthesis slot", registry=self.registry
        )
        self.speech_queued = Gauge("tts_speech_queued", "Speech requests waiting for a slot", registry=self.registry)
        self.speech_rejected = Counter(
            "tts_speech_rejected",
            "Speech requests turned away with 429, by reason (queue_full, queue_timeout)",
            ["reason"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The exposition text; called on the event loop, whose live tasks it counts."""
        self.event_loop_tasks.set(len(asyncio.all_tasks()))
        return generate_latest(self.registry)


class HttpMetricsMiddleware:
    """Counts requests by route template (not raw path, to keep label cardinality bounded)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self._app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self._app(scope, receive, send_with_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", "unmatched")
            self._metrics.http_requests.labels(scope["method"], template, str(status)).inc()
