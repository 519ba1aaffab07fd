"""The memory soak's readings: what it takes from /proc and how it compares two rests."""

from __future__ import annotations

import datetime
import mmap
import os
import random
import threading
from pathlib import Path

import pytest

from benchmarks.memory_soak import (
    climbs,
    growth,
    memory_steps,
    report,
    rest_interval,
    rss_mib,
    soak_schedule,
    soak_segments,
    soak_text,
    thread_count,
)
from benchmarks.server_processes import child_label


def test_a_process_own_memory_leaves_out_what_it_shares() -> None:
    shared = mmap.mmap(-1, 32 * 1024 * 1024, flags=mmap.MAP_SHARED)
    before = rss_mib(os.getpid())
    shared.write(b"x" * len(shared))  # resident now, and counted as shared memory
    after = rss_mib(os.getpid())
    shared.close()
    assert after[" shmem"] - before[" shmem"] == pytest.approx(32, abs=1)
    assert after[""] - before[""] == pytest.approx(32, abs=8)
    assert after[" own"] - before[" own"] < 8


def test_the_thread_count_counts_a_thread_that_starts() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        running = {int(task) for task in os.listdir("/proc/self/task")}
        assert thread.native_id in running
        assert thread_count(os.getpid()) == len(running)
    finally:
        stop.set()
        thread.join()


def test_growth_compares_the_rests_and_ignores_the_load_between() -> None:
    samples = [
        {"t_s": 0, "phase": "warmup", "tritonserver": 40.0},
        {"t_s": 5, "phase": "warmup", "tritonserver": 90.0},
        {"t_s": 10, "phase": "warmup rest", "tritonserver": 60.0},
        {"t_s": 15, "phase": "soak", "tritonserver": 120.0},
        {"t_s": 20, "phase": "soak rest 1", "tritonserver": 61.0},
    ]
    assert growth(samples) == {
        "tritonserver": {
            "rss_first_mib": 40.0,
            "rss_rest_after_warmup_mib": 60.0,
            "rss_rests_between_mib": [],
            "rss_rest_at_end_mib": 61.0,
            "rss_peak_mib": 120.0,
            "peak_first_at_s": 15,
            "growth_after_warmup_pct": 1.67,
        }
    }


def test_growth_reads_each_rest_by_its_last_sample_in_the_order_they_came() -> None:
    samples = [
        {"t_s": 0, "phase": "warmup", "gateway": 50.0},
        {"t_s": 5, "phase": "warmup rest", "gateway": 70.0},
        {"t_s": 10, "phase": "warmup rest", "gateway": 60.0},
        {"t_s": 15, "phase": "soak", "gateway": 90.0},
        {"t_s": 20, "phase": "soak rest 1", "gateway": 61.0},
        {"t_s": 25, "phase": "soak", "gateway": 95.0},
        {"t_s": 30, "phase": "soak rest 2", "gateway": 59.5},
        {"t_s": 35, "phase": "soak", "gateway": 80.0},
        {"t_s": 40, "phase": "soak rest 3", "gateway": 60.3},
        {"t_s": 45, "phase": "soak", "other": 1.0},  # a process that came too late for the warm-up's rest
        {"t_s": 50, "phase": "soak rest 4", "gateway": 60.6, "other": 1.0},
    ]
    rows = growth(samples)
    assert set(rows) == {"gateway"}
    assert rows["gateway"]["rss_rest_after_warmup_mib"] == 60.0
    assert rows["gateway"]["rss_rests_between_mib"] == [61.0, 59.5, 60.3]
    assert rows["gateway"]["rss_rest_at_end_mib"] == 60.6
    assert rows["gateway"]["growth_after_warmup_pct"] == 1.0


def test_growth_keeps_each_rest_in_its_place_and_leaves_out_a_process_gone_before_the_end() -> None:
    samples = [
        {"t_s": 0, "phase": "warmup rest", "gateway": 60.0, "worker": 90.0},
        {"t_s": 5, "phase": "soak rest 1", "worker": 91.0},  # the gateway was not read at this rest
        {"t_s": 10, "phase": "soak rest 2", "gateway": 60.5, "worker": 92.0},
        {"t_s": 15, "phase": "soak rest 3", "gateway": 60.6},  # the worker had ended
    ]
    rows = growth(samples)
    assert set(rows) == {"gateway"}
    assert rows["gateway"]["rss_rests_between_mib"] == [None, 60.5]


@pytest.mark.parametrize(
    ("minutes", "rest_every", "parts"),
    [
        (15.0, 5.0, [5.0, 5.0, 5.0]),
        (7.0, 2.5, [7 / 3] * 3),
        (4.0, 5.0, [4.0]),
        (5.0, 5.0, [5.0]),
        (15.0, 0.0, [15.0]),
        (1.1, 0.1, [0.1] * 11),  # 1.1 / 0.1 is a hair above 11 in floating point
        (8.3 - 2.3, 2.0, [2.0] * 3),
        (0.0, 5.0, [0.0]),
    ],
)
def test_the_soak_is_cut_into_equal_parts_of_at_most_the_rest_interval(
    minutes: float, rest_every: float, parts: list[float]
) -> None:
    assert soak_segments(minutes, rest_every) == pytest.approx(parts)


def test_the_schedule_names_each_rest_and_says_how_often_they_came() -> None:
    assert soak_schedule(10.0, 4.0, 3.0) == [
        ("warmup", 4.0, "warmup rest"),
        ("soak", 3.0, "soak rest 1"),
        ("soak", 3.0, "soak rest 2"),
    ]
    assert soak_schedule(4.0, 4.0, 3.0) == [("warmup", 4.0, "warmup rest"), ("soak", 0.0, "soak rest 1")]
    assert rest_interval(7.0, 2.5) == 2.33
    assert rest_interval(6.0, 0.0) == rest_interval(6.0, 10.0) == 0.0


def test_the_report_names_each_process_and_skips_shared_memory_it_never_had() -> None:
    row = {
        "rss_first_mib": 10.0,
        "rss_rest_after_warmup_mib": 20.0,
        "rss_rests_between_mib": [20.4, None],
        "rss_rest_at_end_mib": 20.1,
        "rss_peak_mib": 30.0,
        "peak_first_at_s": 90.0,
        "growth_after_warmup_pct": 0.5,
    }
    results = {
        "date": "2026-01-01T00:00:00+00:00",
        "machine": "x86_64, 2 CPUs",
        "minutes": 30.0,
        "warmup_minutes": 5.0,
        "warmup_longest_minutes": 1.67,
        "rest_every_minutes": 8.33,
        "concurrency": 8,
        "speech": {"model": "piper", "voice": "alloy", "max_chars": 4096},
        "requests": {"ok": 500},
        "first_byte_ms": {
            "warmup": {"p50": 120.4, "p90": 300.0, "p99": 410.2},
            "soak": {"p50": None, "p90": None, "p99": None},
        },
        "processes": {
            "all GPUs cuda": row,
            "tritonserver": row,
            "tritonserver own": row,
            "tritonserver shmem": {**row, "rss_rests_between_mib": [20.04, 20.08]},
            "gateway": {**row, "rss_rests_between_mib": []},
            "gateway shmem": {**row, "rss_peak_mib": 0.0},
        },
        "threads": {"gateway": {"rest_after_warmup": 12, "rest_at_end": 14, "peak": 20}},
    }
    text = report({**results, "memory_steps": []}, "python -m benchmarks.memory_soak")
    assert text.endswith("with the work that took it:\n\n- nothing\n")
    assert "\nThreads at the rest after the warm-up and at the end: gateway 12 → 14.\n" in text
    step = {"at_min": 8.8, "line": "token2wav: CUDA memory reserved rose from 1 to 2 MiB"}
    assert report({**results, "memory_steps": [step]}, "x").endswith(
        "\n- min 8.8: `token2wav: CUDA memory reserved rose from 1 to 2 MiB`\n"
    )
    assert "stepping up" not in report(results, "python -m benchmarks.memory_soak")
    assert "First byte of a response (ms, p50 / p90 / p99): warmup 120 / 300 / 410; soak - / - / -." in text
    assert (
        "once the first 5 minutes have passed (of which the first 1.67 min sent only the longest input),"
        " after every 8.33 minutes of load from then on, and at the end;" in text
    )
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[1:] == [
        "| all GPUs | CUDA | 10 | 20 | 20.4 / - | 20.1 | +0.50 % | 30 | 1.5 |",
        "| gateway | RSS | 10 | 20 | - | 20.1 | +0.50 % | 30 | 1.5 |",
        "| tritonserver | RSS | 10 | 20 | 20.4 / - | 20.1 | +0.50 % | 30 | 1.5 |",
        "| tritonserver | own | 10 | 20 | 20.4 / - | 20.1 | +0.50 % | 30 | 1.5 |",
        "| tritonserver | shared | 10 | 20 | 20.04 / 20.08 | 20.1 | +0.50 %, up at every rest | 30 | 1.5 |",
    ]


@pytest.mark.parametrize(
    ("between", "end", "marked"),
    [
        ([20.2, 20.3], 20.4, True),  # a leak too small for the 1 % target still shows
        ([20.2], 20.4, True),  # three rests are enough
        ([20.2, 20.2], 20.4, False),  # a rest that held
        ([20.6, 20.3], 20.4, False),  # a heap that wanders
        ([19.9, 20.3], 20.4, False),  # the first rest between is below the one after the warm-up
        ([20.2, 20.3], 20.25, False),  # the end breaks the climb
        ([], 20.4, False),  # two rests cannot tell a climb from a step
        (None, 20.4, False),  # a report from a run without rests between
        ([20.2, None], 20.4, False),  # a rest not read is not a rise
    ],
)
def test_climbs_only_where_memory_rose_at_every_rest(
    between: list[float | None] | None, end: float, marked: bool
) -> None:
    row = {"rss_rest_after_warmup_mib": 20.0, "rss_rests_between_mib": between, "rss_rest_at_end_mib": end}
    assert climbs(row) is marked
    assert climbs({key: value for key, value in row.items() if key != "rss_rests_between_mib"}) is False


def test_the_report_says_by_kind_of_mapping_where_the_own_memory_that_grew_lies() -> None:
    def own(start: float, between: list[float], end: float) -> dict[str, object]:
        return {
            "rss_first_mib": start,
            "rss_rest_after_warmup_mib": start,
            "rss_rests_between_mib": between,
            "rss_rest_at_end_mib": end,
            "rss_peak_mib": end,
            "peak_first_at_s": 60.0,
            "growth_after_warmup_pct": round(100 * (end - start) / start, 2),
        }

    kinds = {"malloc heap": 10.0, "malloc arenas": 600.0, "other anonymous": 1000.0}
    results = {
        "date": "2026-01-01T00:00:00+00:00",
        "machine": "x86_64, 2 CPUs",
        "minutes": 18.0,
        "warmup_minutes": 3.0,
        "concurrency": 64,
        "speech": {"model": "tts-1", "voice": "lumen", "max_chars": 4096},
        "requests": {"ok": 4000},
        "first_byte_ms": {"soak": {"p50": 900.0, "p90": 1200.0, "p99": 1500.0}},
        "processes": {
            "stub:llm own": own(1610.0, [1612.0, 1614.0], 1616.0),  # +0.37 %, but up at every rest
            "gateway worker own": own(100.0, [103.0, 101.0], 102.0),  # +2 %
            "stub:token2wav own": own(8000.0, [8010.0, 8000.0], 8001.0),  # neither
            "stub:piper own": own(100.0, [100.5, 100.2], 101.0),  # +1 %: the bar itself
            "tritonserver own": own(100.0, [100.5, 100.2], 100.9),  # +0.9 %, no climb
            "gateway own": own(60.0, [60.0, 60.0], 60.0),
        },
        "own_by_kind": {
            "warmup rest": {
                "stub:llm": kinds,
                "gateway worker": kinds,
                "stub:token2wav": kinds,
                "stub:piper": kinds,
                "tritonserver": kinds,
                "gateway": kinds,
            },
            "soak rest 1": {},
            "soak rest 2": {
                "stub:llm": {**kinds, "malloc arenas": 600.04, "other anonymous": 1006.0},
                "gateway worker": {**kinds, "malloc heap": 11.5, "malloc arenas": 599.5},
                "stub:token2wav": {**kinds, "other anonymous": 1001.0},
                "stub:piper": {**kinds, "malloc heap": 10.1, "other anonymous": 1000.04},
                "tritonserver": {**kinds, "other anonymous": 1000.9},
                "gateway": kinds,
            },
        },
    }
    lines = report(results, "x").splitlines()
    start = lines.index(next(line for line in lines if line.startswith("Where own memory grew")))
    assert lines[start + 1 :] == [
        "",
        "- gateway worker: malloc heap 10.0 → 11.5 (+1.5); malloc arenas 600.0 → 599.5 (-0.5)",
        "- stub:llm: other anonymous 1,000.0 → 1,006.0 (+6.0)",
        "- stub:piper: malloc heap 10.0 → 10.1 (+0.1)",
    ]
    results["processes"]["gateway own"] = own(60.0, [60.5, 61.0], 61.5)
    assert "- gateway: no kind moved by 0.1 MiB or more" in report(results, "x").splitlines()
    assert "Where own memory grew" not in report({**results, "own_by_kind": {}}, "x")


@pytest.mark.parametrize(
    ("parent", "argv", "label"),
    [
        ("tritonserver", ["/b/triton_python_backend_stub", "/r/token2wav/1/model.py", "shm"], "stub:token2wav"),
        ("gateway", ["/w/bin/tritonserver", "--model-repository=/r"], "tritonserver"),
        ("gateway", ["python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"], "gateway worker"),
        ("gateway", ["python3", "-c", "from multiprocessing.resource_tracker import main"], "gateway resource tracker"),
        ("stub:llm", ["python3", "/t/torch/_inductor/compile_worker/__main__.py"], "stub:llm compile worker"),
    ],
)
def test_child_processes_are_labelled_by_their_role(parent: str, argv: list[str], label: str) -> None:
    assert child_label(parent, argv) == label


def test_soak_inputs_vary_in_length_except_the_longest_ones() -> None:
    rng = random.Random(0)
    lengths = {len(soak_text(rng, 1000)) for _ in range(200)}
    assert min(lengths) < 200 and max(lengths) <= 1000 and len(lengths) > 50
    assert {len(soak_text(rng, 1000, longest=True)) for _ in range(20)} == {1000}


def test_the_models_memory_steps_are_read_from_the_triton_log_with_the_minute_they_came(tmp_path: Path) -> None:
    log = tmp_path / "tritonserver.log"
    step = (
        'I1129 04:14:49.123456 5889 triton_logging.py:52] "token2wav: tts_gateway.models.cosyvoice2.engines.token2wav:'
        " CUDA memory reserved rose from 18786 to 19300 MiB while converting 32 calls of up to 640 mel frames"
        ' (flow solved eagerly: none; HiFT batches vocoded eagerly: 8 x 400 frames)"'
    )
    loaded = 'I1129 04:05:40.000001 5889 triton_logging.py:52] "token2wav: ...: flow and HiFT weights loaded"'
    log.write_text(f"{loaded}\n{step}\nCUDA memory reserved rose, a line without Triton's time\n")
    started = datetime.datetime(2026, 11, 29, 4, 6, 3, tzinfo=datetime.UTC)
    assert memory_steps(log, "CUDA memory reserved rose", started) == [
        {"at_min": 8.8, "line": step},
        {"at_min": None, "line": "CUDA memory reserved rose, a line without Triton's time"},
    ]
    assert memory_steps(tmp_path / "absent.log", "CUDA memory reserved rose", started) == []
