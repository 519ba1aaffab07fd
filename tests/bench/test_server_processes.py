"""The CPU a server's processes kept busy: read from /proc for real processes, labelled by role."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.gpu_cosyvoice2 import cpu_lines
from benchmarks.server_processes import CpuUse, cores_cell
from benchmarks.text_stream import markdown

# One child spins in a thread that lives for the whole run; another spins in short threads, one after
# another, each ended before the next starts (as an orchestrator's thread per request); a third sleeps.
_LONG = (
    "import threading, time; threading.Thread(target=lambda: sum(iter(int, 1)), daemon=True).start(); time.sleep(60)"
)
_SHORT = """
import threading, time
def spin():
    end = time.monotonic() + 0.25
    while time.monotonic() < end:
        pass
while True:
    thread = threading.Thread(target=spin)
    thread.start()
    thread.join()
"""
_PARENT = f"""
import subprocess, sys, time
for code in ({_LONG!r}, {_SHORT!r}, "import time; time.sleep(60)"):
    subprocess.Popen([sys.executable, "-c", code])
    time.sleep(0.3)  # started in this order, so labelled in this order (by pid)
time.sleep(60)
"""


@pytest.fixture
def parent() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", _PARENT], start_new_session=True)
    time.sleep(1.5)  # all three children started
    yield process
    subprocess.run(["pkill", "-KILL", "-s", str(process.pid)], check=False)
    process.wait()


def test_processes_count_their_threads_ended_or_alive(parent: subprocess.Popen[bytes]) -> None:
    use = CpuUse({"server": parent.pid})
    use.start()
    time.sleep(2.0)
    cores = use.cores()
    # The parent and the sleeping child stay under the threshold; the two spinners share two CPUs.
    assert len(cores) == 2, cores
    (long_label, long), (short_label, short) = sorted(cores.items())
    assert long_label.startswith("server ") and short_label.startswith("server ")
    assert long["process"] > 0.3 and long["thread"] > 0.3
    # Its spinning threads ended one after another: the process's figure keeps their time, while the
    # busiest thread alive at the end spun for at most 0.25 s of the 2 s.
    assert short["process"] > 0.3
    assert short["thread"] <= 0.25 / 2.0 + 0.05
    assert cores_cell(cores).count("server ") == 2


def test_a_process_that_ended_is_left_out(parent: subprocess.Popen[bytes]) -> None:
    use = CpuUse({"server": parent.pid})
    use.start()
    subprocess.run(["pkill", "-KILL", "-s", str(parent.pid)], check=False)
    parent.wait()
    time.sleep(0.2)
    assert use.cores(least=0.0) == {}


def _figures() -> dict[str, Any]:
    return {
        "first_audio_after_first_text_ms": {"p50": 150.0, "p90": 160.0},
        "first_audio_after_sentence_end_ms": {"p50": 1.0, "p90": 70.0},
        "stalls_per_utterance": 0.0,
        "stalled_s_per_utterance": 0.0,
        "audio_s_per_utterance": 9.4,
        "rtf": 0.09,
        "failed": 0,
        "utterances": 2,
        "first_error": None,
        "triton_requests": {"cosyvoice2_bistream": 48},
    }


def test_the_text_stream_report_shows_the_busiest_processes() -> None:
    busy = {
        "stub:cosyvoice2_bistream": {"process": 0.97, "thread": 0.41},
        "stub:token2wav": {"process": 0.8, "thread": 0.7},
    }
    report: dict[str, Any] = {
        "setup": {
            "report_name": "t",
            "command": "python -m benchmarks.text_stream",
            "gateway": "g",
            "voice": "lumen",
            "rounds": 2,
            "host": "h",
            "device": "d",
            "warmup_sockets": 1,
        },
        # A path measured without the CPU figure reads "-"; a skipped level keeps the row's cells.
        "levels": [
            {"sockets": 1, "pace_ms": 30, "websocket": _figures() | {"cpu_cores": busy}, "http": _figures()},
            {"sockets": 64, "pace_ms": 30, "skipped": "no budget"},
        ],
    }
    lines = markdown(report).splitlines()
    header = next(line for line in lines if line.startswith("| pace"))
    rows = [line for line in lines if line.startswith("| 30 | 1 |")]
    skipped = next(line for line in lines if line.startswith("| 30 | 64 |"))
    assert rows[0].endswith("| stub:cosyvoice2_bistream 0.97 (0.41), stub:token2wav 0.8 (0.7) |")
    assert rows[1].endswith("| cosyvoice2_bistream 48 | - |")
    assert header.count("|") == rows[0].count("|") == skipped.count("|")
    # Without any such figure (a gateway not started here) the report has no column for it.
    del report["levels"][0]["websocket"]["cpu_cores"]
    lines = markdown(report).splitlines()
    assert not any("busiest processes" in line for line in lines)
    assert next(line for line in lines if line.startswith("| 30 | 1 |")).endswith("| cosyvoice2_bistream 48 |")
    header = next(line for line in lines if line.startswith("| pace"))
    assert header.count("|") == next(line for line in lines if line.startswith("| 30 | 64 |")).count("|")


def test_the_gpu_report_lists_each_measured_pass() -> None:
    passes = [
        {
            "target": "gateway",
            "mode": "stream",
            "concurrency": 64,
            "triton_cpu_cores": {"stub:llm": {"process": 1.2, "thread": 0.9}},
        },
        {"target": "gateway", "mode": "offline", "concurrency": 64, "triton_cpu_cores": {}},
        {"target": "direct", "mode": "stream", "concurrency": 1},  # from before the figure
    ]
    lines = cpu_lines({"passes": passes})
    assert [line for line in lines if line.startswith("- ")] == ["- gateway stream, 64 streams: stub:llm 1.2 (0.9)"]
    assert cpu_lines({"passes": passes[1:]}) == []
