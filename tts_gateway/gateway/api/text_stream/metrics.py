"""Prometheus metrics of the text-streaming sockets, in the gateway's registry."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from tts_gateway.gateway.metrics import GatewayMetrics

_FIRST_AUDIO_BUCKETS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0)


class TextStreamMetrics:
    def __init__(self, metrics: GatewayMetrics) -> None:
        registry = metrics.registry
        self.sockets = Gauge(
            "tts_ws_sockets_open", "Text-streaming WebSockets open", registry=registry, multiprocess_mode="livesum"
        )
        self.contexts = Gauge(
            "tts_ws_contexts_open",
            "Contexts open on the text-streaming WebSockets",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.first_audio = Histogram(
            "tts_ws_time_to_first_audio_seconds",
            "A context's first text (not whitespace) to its first audio message",
            buckets=_FIRST_AUDIO_BUCKETS,
            registry=registry,
        )
        self.closes = Counter(
            "tts_ws_closes", "Text-streaming WebSockets closed by the gateway, by reason", ["reason"], registry=registry
        )
        self.failed = Counter(
            "tts_ws_contexts_failed",
            "Contexts whose synthesis failed (after the speech service's own failover), by error code",
            ["code"],
            registry=registry,
        )
        self.interrupted = Counter(
            "tts_ws_contexts_interrupted", "Contexts closed while their audio was still pending", registry=registry
        )
