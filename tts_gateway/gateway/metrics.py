"""Prometheus metrics of the gateway, in one process or summed over several worker processes.

One process (the default): each ``GatewayMetrics`` has its own registry, so several apps can coexist in
one process (the tests build many), and ``render()`` shows this process's values and its ``process_*``
metrics.

Several workers (``tts-gateway serve --workers N``): the parent points ``PROMETHEUS_MULTIPROC_DIR`` at an
empty directory before the workers start, so prometheus_client keeps every value in per-process files
there, and ``render()`` answers with the whole gateway, whichever worker is asked:

- counters and histograms are summed over every worker that ever ran, the dead ones too, so that a
  replaced worker does not make a counter go backwards;
- gauges count live workers only. In-flight, queued, slots, slots in use and event-loop tasks are
  summed; ``tts_triton_ready`` is the minimum, 1 only when every worker sees the servers ready, because
  a request may land on any of them. A worker's event-loop task count is as fresh as its last HTTP
  request or ``/metrics`` answer;
- ``process_*``: prometheus_client cannot add these up (a sum of start times or of open-file limits
  means nothing), so each live worker's are read from ``/proc`` and carry its ``pid`` label.

A worker's live gauges stop counting when it calls ``close()`` at shutdown. One killed without that
(SIGKILL, OOM) is swept when the next ``GatewayMetrics`` is built, which is what the replacement worker
does, and before every multi-process ``render()``. Only one ``GatewayMetrics`` per process in this mode:
instances in one process would share its files.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterable
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest, values
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# How prometheus_client names the file of a process's gauges in one of the live* modes.
_LIVE_GAUGE_FILE = re.compile(r"gauge_live[a-z]+_(\d+)\.db")


class GatewayMetrics:
    def __init__(self) -> None:
        self._multiprocess_dir = os.environ.get(MULTIPROC_DIR_ENV) or None
        if self._multiprocess_dir is not None and not values.ValueClass._multiprocess:
            raise RuntimeError(
                f"{MULTIPROC_DIR_ENV} was set after prometheus_client was imported; "
                "it must be in the environment before the worker process starts"
            )
        # This process's metrics. With several workers, render() serves their sum from the files
        # instead, and this registry only keeps the names unique.
        self.registry = CollectorRegistry()
        if self._multiprocess_dir is None:
            # process_resident_memory_bytes, process_open_fds, process_cpu_seconds_total, ...
            ProcessCollector(registry=self.registry)
        else:
            _sweep_dead_workers(self._multiprocess_dir)
        self.event_loop_tasks = self._gauge(
            "tts_event_loop_tasks", "asyncio tasks alive on the event loop (a leak shows as growth)", "livesum"
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
        self.in_flight = self._gauge("tts_speech_in_flight", "Speech responses being produced", "livesum")
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
        self.servers_ready = RenamedGauge(
            self._gauge("tts_triton_ready", "1 when the Triton servers serve speech", "livemin"),
            self._gauge("tts_backend_ready", "Former name of tts_triton_ready", "livemin"),
        )
        self.triton_up = self._server_gauge(
            "up", "1 while this Triton server is ready and serves speech models", "livemin"
        )
        self.triton_outstanding = self._server_gauge("outstanding", "Calls in flight at this Triton server", "livesum")
        self.triton_calls = self._server_counter(
            "calls", "Calls to this Triton server by outcome (ok, failed, cancelled)", ["server", "outcome"]
        )
        self.triton_retries = self._server_counter(
            "retries", "Calls that failed before their first audio and were sent again to another server", []
        )
        self.embedded_restarts = embedded_restarts_counter(self.registry)
        self.speech_slots = self._gauge(
            "tts_speech_slots", "Speech requests that may be synthesised at once", "livesum"
        )
        self.speech_slots_in_use = self._gauge(
            "tts_speech_slots_in_use", "Speech requests holding a synthesis slot", "livesum"
        )
        self.speech_queued = self._gauge("tts_speech_queued", "Speech requests waiting for a slot", "livesum")
        self.speech_rejected = Counter(
            "tts_speech_rejected",
            "Speech requests turned away with 429, by reason (queue_full, queue_timeout)",
            ["reason"],
            registry=self.registry,
        )

    def _gauge(self, name: str, documentation: str, mode: Literal["livesum", "livemin"]) -> Gauge:
        """``mode``: how the values of the live workers add up when there are several."""
        return Gauge(name, documentation, registry=self.registry, multiprocess_mode=mode)

    def _server_gauge(self, suffix: str, documentation: str, mode: Literal["livesum", "livemin"]) -> RenamedGauge:
        """``tts_triton_server_<suffix>{server}``, exported also as ``tts_triton_backend_<suffix>{backend}``."""
        return RenamedGauge(
            Gauge(
                f"tts_triton_server_{suffix}", documentation, ["server"], registry=self.registry, multiprocess_mode=mode
            ),
            Gauge(
                f"tts_triton_backend_{suffix}",
                f"Former name of tts_triton_server_{suffix}",
                ["backend"],
                registry=self.registry,
                multiprocess_mode=mode,
            ),
        )

    def _server_counter(self, suffix: str, documentation: str, labels: list[str]) -> RenamedCounter:
        """``tts_triton_server_<suffix>``, exported also as ``tts_triton_backend_<suffix>`` (its ``server`` label
        named ``backend``)."""
        former_labels = ["backend" if label == "server" else label for label in labels]
        return RenamedCounter(
            Counter(f"tts_triton_server_{suffix}", documentation, labels, registry=self.registry),
            Counter(
                f"tts_triton_backend_{suffix}",
                f"Former name of tts_triton_server_{suffix}",
                former_labels,
                registry=self.registry,
            ),
        )

    @property
    def shared(self) -> bool:
        """Whether the values are summed over several worker processes."""
        return self._multiprocess_dir is not None

    def count_event_loop_tasks(self) -> None:
        """Sets ``tts_event_loop_tasks``; must run on the event loop."""
        self.event_loop_tasks.set(len(asyncio.all_tasks()))

    def render(self) -> bytes:
        """The exposition text of this process, or of every worker; called on the event loop."""
        self.count_event_loop_tasks()
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        workers = _sweep_dead_workers(self._multiprocess_dir)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self._multiprocess_dir)  # type: ignore[no-untyped-call]
        registry.register(_WorkersProcessCollector(workers))
        return generate_latest(registry)

    def close(self) -> None:
        """Takes this worker's gauges out of the sum; call once at shutdown. Nothing to do in one process."""
        if self._multiprocess_dir is not None:
            _mark_dead(os.getpid(), self._multiprocess_dir)


class RenamedGauge:
    """A gauge exported under its name and under its former one, so that dashboards on the old name keep working."""

    def __init__(self, current: Gauge, former: Gauge) -> None:
        self._current = current
        self._former = former

    def labels(self, *values: str) -> RenamedGauge:
        return RenamedGauge(self._current.labels(*values), self._former.labels(*values))

    def set(self, value: float) -> None:
        self._current.set(value)
        self._former.set(value)

    def inc(self, amount: float = 1) -> None:
        self._current.inc(amount)
        self._former.inc(amount)

    def dec(self, amount: float = 1) -> None:
        self._current.dec(amount)
        self._former.dec(amount)

    def remove(self, *values: str) -> None:
        self._current.remove(*values)
        self._former.remove(*values)


class RenamedCounter:
    """A counter exported under its name and under its former one (see :class:`RenamedGauge`)."""

    def __init__(self, current: Counter, former: Counter) -> None:
        self._current = current
        self._former = former

    def labels(self, *values: str) -> RenamedCounter:
        return RenamedCounter(self._current.labels(*values), self._former.labels(*values))

    def inc(self, amount: float = 1) -> None:
        self._current.inc(amount)
        self._former.inc(amount)


def embedded_restarts_counter(registry: CollectorRegistry | None) -> Counter:
    """``tts_embedded_triton_restarts_total``: the embedded Triton replaced after it exited or hung."""
    return Counter(
        "tts_embedded_triton_restarts",
        "Times the embedded Triton was restarted after it exited or stopped answering",
        registry=registry,
    )


def shared_restarts_counter() -> Counter:
    """The restart counter of the parent of several workers, written where the workers' metrics are summed.

    The parent imported prometheus_client before it set ``PROMETHEUS_MULTIPROC_DIR``, so it switches to
    per-process files itself (counters only: its file is kept and summed after it exits).
    """
    if os.environ.get(MULTIPROC_DIR_ENV) is None:
        raise RuntimeError(f"{MULTIPROC_DIR_ENV} must be set before the shared restart counter is made")
    values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
    return embedded_restarts_counter(None)


def _sweep_dead_workers(directory: str) -> list[int]:
    """The pids that have live gauges in ``directory``; those of processes gone are removed first."""
    pids = {int(match[1]) for name in os.listdir(directory) if (match := _LIVE_GAUGE_FILE.fullmatch(name))}
    alive = []
    for pid in sorted(pids):
        if _process_exists(pid):
            alive.append(pid)
        else:
            _mark_dead(pid, directory)
    return alive


def _mark_dead(pid: int, directory: str) -> None:
    """Removes the live-gauge files of ``pid``, the only files prometheus_client deletes for a dead process."""
    mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]


def _process_exists(pid: int) -> bool:
    """A pid reused by another process reads as alive: the dead worker's gauges then count until it ends."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _WorkersProcessCollector:
    """``process_*`` of each given worker, told apart by a ``pid`` label."""

    def __init__(self, pids: list[int]) -> None:
        self._pids = pids

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for pid in self._pids:
            for family in _process_metrics(pid):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "pid": str(pid)}, sample.value)
        return families.values()


def _process_metrics(pid: int) -> Iterable[Metric]:
    """Read from ``/proc/<pid>``; a worker that exits meanwhile yields nothing rather than an error."""
    return ProcessCollector(pid=lambda: pid, registry=None).collect()


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
            if self._metrics.shared:
                # An idle worker's task count would otherwise date from its last /metrics answer.
                self._metrics.count_event_loop_tasks()
