"""The CPU a server's processes kept busy: read from /proc for real processes, labelled by role."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from benchmarks.server_processes import CpuUse, cores_cell
from benchmarks.text_stream import markdown

# A parent that starts one child spinning in a thread of its own and another asleep, then waits.
_SPIN = (
    "import threading, time; threading.Thread(target=lambda: sum(iter(int, 1)), daemon=True).start(); time.sleep(60)"
)
_PARENT = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {_SPIN!r}])
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
time.sleep(60)
"""


@pytest.fixture
def parent() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", _PARENT], start_new_session=True)
    time.sleep(1.0)  # both children started
    yield process
    subprocess.run(["pkill", "-KILL", "-s", str(process.pid)], check=False)
    process.wait()


def test_the_spinning_process_and_its_thread_are_the_busiest(parent: subprocess.Popen[bytes]) -> None:
    use = CpuUse(parent.pid, "server")
    use.start()
    time.sleep(1.5)
    cores = use.cores()
    # The parent and the sleeping child stay under the threshold; the spinner's one busy thread is its load.
    assert list(cores) == ["server python"], cores
    spinner = cores["server python"]
    assert spinner["process"] > 0.3
    assert spinner["thread"] > 0.3
    assert spinner["thread"] <= spinner["process"]
    assert "server python" in cores_cell(cores) and f"({spinner['thread']:g})" in cores_cell(cores)


def test_a_process_that_ended_is_left_out(parent: subprocess.Popen[bytes]) -> None:
    use = CpuUse(parent.pid, "server")
    use.start()
    subprocess.run(["pkill", "-KILL", "-s", str(parent.pid)], check=False)
    parent.wait()
    time.sleep(0.2)
    assert use.cores(least=0.0) == {}


def test_the_text_stream_report_shows_the_busiest_processes() -> None:
    figures = {
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
    busy = {
        "stub:cosyvoice2_bistream": {"process": 0.97, "thread": 0.41},
        "stub:token2wav": {"process": 0.8, "thread": 0.7},
    }
    report = {
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
        # A report written before the CPU was measured has no cpu_cores: its cell reads "-".
        "levels": [{"sockets": 1, "pace_ms": 30, "websocket": figures | {"cpu_cores": busy}, "http": figures}],
    }
    rows = [line for line in markdown(report).splitlines() if line.startswith("| 30 | 1 |")]
    assert rows[0].endswith("| stub:cosyvoice2_bistream 0.97 (0.41), stub:token2wav 0.8 (0.7) |")
    assert rows[1].endswith("| cosyvoice2_bistream 48 | - |")
    # Without any such figure (a gateway not started here) the report has no column for it.
    del report["levels"][0]["websocket"]["cpu_cores"]
    text = markdown(report)
    assert "busiest processes" not in text.lower()
    assert next(line for line in text.splitlines() if line.startswith("| 30 | 1 |")).endswith(
        "| cosyvoice2_bistream 48 |"
    )
