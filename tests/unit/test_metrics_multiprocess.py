"""Metrics summed over several real worker processes through PROMETHEUS_MULTIPROC_DIR.

prometheus_client picks how it stores values when it is imported, so every multi-process
``GatewayMetrics`` lives in a child process started with the variable already set. Run as a script,
this file is that child: it builds one ``GatewayMetrics`` and obeys JSON commands on stdin.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
_SLOTS_PER_WORKER = 4
_FIRST_AUDIO_SECONDS = 0.3  # lands in the 0.35 bucket and above, not in 0.2

Samples = list[tuple[str, dict[str, str], float]]
StartWorker = Callable[[], "Worker"]


class Worker:
    """One child process holding a ``GatewayMetrics``, driven one JSON line at a time."""

    def __init__(self, directory: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__],
            env={**os.environ, _DIR_ENV: str(directory)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.process.pid
        assert self._reply() == "ready"

    def call(self, command: str, **arguments: int) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"command": command, **arguments}) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def load(self, *, in_flight: int, finished: int, ready: int = 1) -> None:
        self.call("load", in_flight=in_flight, finished=finished, ready=ready)

    def render(self) -> Samples:
        return _samples(self.call("render"))

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            self.process.wait(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()

    def _reply(self) -> Any:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"worker {self.pid} exited with status {self.process.wait(timeout=10)}"
        return json.loads(line)


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[StartWorker]:
    workers: list[Worker] = []

    def start() -> Worker:
        workers.append(Worker(tmp_path))
        return workers[-1]

    yield start
    for worker in workers:
        if worker.process.poll() is None:
            worker.kill()
        worker.stop()


def _samples(text: str) -> Samples:
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def _value(samples: Samples, name: str, **labels: str) -> float:
    found = [value for sample_name, sample_labels, value in samples if (sample_name, sample_labels) == (name, labels)]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def _process_pids(samples: Samples) -> set[int]:
    """The workers whose resident memory is shown, each once and non-zero."""
    rss = [(labels, value) for name, labels, value in samples if name == "process_resident_memory_bytes"]
    assert all(value > 0 for _, value in rss)
    pids = [int(labels["pid"]) for labels, _ in rss]
    assert len(pids) == len(set(pids))
    return set(pids)


def _live_gauge_pids(directory: Path) -> set[int]:
    names = (path.name for path in directory.iterdir())
    return {int(match[1]) for name in names if (match := re.fullmatch(r"gauge_live\w+_(\d+)\.db", name))}


def test_any_worker_answers_for_all_of_them(start_worker: StartWorker) -> None:
    workers = [start_worker() for _ in range(3)]
    for worker, (in_flight, finished) in zip(workers, [(1, 2), (2, 0), (0, 5)], strict=True):
        worker.load(in_flight=in_flight, finished=finished)

    samples = workers[1].render()
    assert _value(samples, "tts_speech_in_flight") == 3
    assert _value(samples, "tts_speech_slots_in_use") == 3
    assert _value(samples, "tts_speech_slots") == 3 * _SLOTS_PER_WORKER
    assert _value(samples, "tts_backend_ready") == 1
    assert _value(samples, "tts_triton_ready") == 1
    assert _value(samples, "tts_speech_requests_total", model="piper", format="wav", outcome="ok") == 7
    assert _value(samples, "tts_time_to_first_audio_seconds_count", model="piper") == 7
    assert _value(samples, "tts_time_to_first_audio_seconds_bucket", model="piper", le="0.35") == 7
    assert _value(samples, "tts_time_to_first_audio_seconds_bucket", model="piper", le="0.2") == 0
    # Only the answering worker has counted its tasks: asyncio.run's main task.
    assert _value(samples, "tts_event_loop_tasks") == 1
    assert _process_pids(samples) == {worker.pid for worker in workers}

    workers[2].load(in_flight=0, finished=0, ready=0)
    assert _value(workers[0].render(), "tts_backend_ready") == 0
    assert _value(workers[0].render(), "tts_triton_ready") == 0


def test_a_killed_workers_gauges_are_swept_by_its_replacement(start_worker: StartWorker, tmp_path: Path) -> None:
    survivor, killed = start_worker(), start_worker()
    survivor.load(in_flight=1, finished=1)
    killed.load(in_flight=2, finished=3, ready=0)
    killed.kill()
    assert killed.pid in _live_gauge_pids(tmp_path)

    replacement = start_worker()
    assert _live_gauge_pids(tmp_path) == {survivor.pid, replacement.pid}
    assert (tmp_path / f"counter_{killed.pid}.db").exists()
    replacement.load(in_flight=0, finished=0)

    samples = survivor.render()
    assert _value(samples, "tts_speech_in_flight") == 1
    assert _value(samples, "tts_speech_slots") == 2 * _SLOTS_PER_WORKER
    assert _value(samples, "tts_backend_ready") == 1
    assert _value(samples, "tts_triton_ready") == 1
    # Counters keep what the dead worker counted: a restart does not make them go backwards.
    assert _value(samples, "tts_speech_requests_total", model="piper", format="wav", outcome="ok") == 4
    assert _process_pids(samples) == {survivor.pid, replacement.pid}


def test_render_leaves_out_a_worker_killed_since(start_worker: StartWorker) -> None:
    survivor, killed = start_worker(), start_worker()
    survivor.load(in_flight=1, finished=0)
    killed.load(in_flight=2, finished=1, ready=0)
    assert _value(survivor.render(), "tts_speech_in_flight") == 3
    killed.kill()

    samples = survivor.render()
    assert _value(samples, "tts_speech_in_flight") == 1
    assert _value(samples, "tts_backend_ready") == 1
    assert _value(samples, "tts_triton_ready") == 1
    assert _value(samples, "tts_speech_requests_total", model="piper", format="wav", outcome="ok") == 1
    assert _process_pids(samples) == {survivor.pid}


def test_a_closed_worker_leaves_the_gauges_at_once(start_worker: StartWorker, tmp_path: Path) -> None:
    staying, leaving = start_worker(), start_worker()
    staying.load(in_flight=1, finished=0)
    leaving.load(in_flight=2, finished=2)
    leaving.call("close")
    assert _live_gauge_pids(tmp_path) == {staying.pid}

    samples = staying.render()
    assert leaving.process.poll() is None
    assert _value(samples, "tts_speech_in_flight") == 1
    assert _value(samples, "tts_speech_requests_total", model="piper", format="wav", outcome="ok") == 2
    assert _process_pids(samples) == {staying.pid}


def test_a_directory_set_after_prometheus_client_is_imported_is_refused(tmp_path: Path) -> None:
    late = (
        "import os, prometheus_client\n"
        f"os.environ[{_DIR_ENV!r}] = {str(tmp_path)!r}\n"
        "from tts_gateway.gateway.metrics import GatewayMetrics\n"
        "GatewayMetrics()\n"
    )
    env = {name: value for name, value in os.environ.items() if name != _DIR_ENV}
    result = subprocess.run([sys.executable, "-c", late], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "must be in the environment before the worker process starts" in result.stderr
    assert list(tmp_path.iterdir()) == []


async def test_one_process_keeps_its_own_registry_and_process_metrics() -> None:
    from tts_gateway.gateway.metrics import GatewayMetrics

    assert _DIR_ENV not in os.environ
    busy, idle = GatewayMetrics(), GatewayMetrics()
    busy.in_flight.inc()
    busy.close()
    samples = _samples(busy.render().decode())
    assert _value(samples, "tts_speech_in_flight") == 1
    assert _value(samples, "process_open_fds") > 0
    assert _value(samples, "tts_event_loop_tasks") >= 1
    assert idle.registry.get_sample_value("tts_speech_in_flight") == 0


def _serve() -> None:
    """The child's side: one ``GatewayMetrics`` in multi-process mode, set as the commands say."""
    from tts_gateway.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()

    async def render() -> str:
        return metrics.render().decode()

    _answer("ready")
    for line in sys.stdin:
        request = json.loads(line)
        reply = None
        if request["command"] == "load":
            metrics.servers_ready.set(request["ready"])
            metrics.speech_slots.set(_SLOTS_PER_WORKER)
            for _ in range(request["in_flight"]):
                metrics.speech_slots_in_use.inc()
                metrics.in_flight.inc()
            for _ in range(request["finished"]):
                metrics.speech_requests.labels("piper", "wav", "ok").inc()
                metrics.first_audio.labels("piper").observe(_FIRST_AUDIO_SECONDS)
        elif request["command"] == "render":
            reply = asyncio.run(render())
        elif request["command"] == "close":
            metrics.close()
        else:
            raise ValueError(request["command"])
        _answer(reply)


def _answer(reply: Any) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _serve()
