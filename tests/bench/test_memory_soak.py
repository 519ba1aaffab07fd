"""The memory soak's readings: what it takes from /proc and how it compares two rests."""

from __future__ import annotations

import mmap
import os

import pytest

from benchmarks.memory_soak import growth, rss_mib


def test_a_process_own_memory_leaves_out_what_it_shares() -> None:
    shared = mmap.mmap(-1, 32 * 1024 * 1024, flags=mmap.MAP_SHARED)
    before = rss_mib(os.getpid())
    shared.write(b"x" * len(shared))  # resident now, and counted as shared memory
    after = rss_mib(os.getpid())
    shared.close()
    assert after[" shmem"] - before[" shmem"] == pytest.approx(32, abs=1)
    assert after[" own"] == pytest.approx(after[""] - after[" shmem"])
    assert after[" own"] - before[" own"] < 8


def test_growth_compares_the_rests_and_ignores_the_load_between() -> None:
    samples = [
        {"t_s": 0, "phase": "warmup", "tritonserver": 40.0},
        {"t_s": 5, "phase": "warmup", "tritonserver": 90.0},
        {"t_s": 10, "phase": "warmup rest", "tritonserver": 60.0},
        {"t_s": 15, "phase": "soak", "tritonserver": 120.0},
        {"t_s": 20, "phase": "soak rest", "tritonserver": 61.0},
    ]
    assert growth(samples) == {
        "tritonserver": {
            "rss_first_mib": 40.0,
            "rss_rest_after_warmup_mib": 60.0,
            "rss_rest_at_end_mib": 61.0,
            "rss_peak_mib": 120.0,
            "growth_after_warmup_pct": 1.67,
        }
    }
