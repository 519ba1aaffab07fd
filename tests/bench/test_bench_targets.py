"""The project's targets read off a report: pass, fail, and not measured."""

from __future__ import annotations

from typing import Any

from benchmarks.bench_report import check_targets, markdown, targets_json
from benchmarks.bench_stats import ratios


def stats(total_p50: float, first_p50: float, rps: float, rss: float | None = None) -> dict[str, Any]:
    return {
        "total_ms": {"p50": total_p50, "p90": total_p50, "p99": total_p50},
        "first_byte_ms": {"p50": first_p50, "p90": first_p50, "p99": first_p50},
        "requests_per_s": rps,
        "rtf": 0.01,
        "rss_peak_mb": rss,
        "by_text": {"short-en": {"total_p50_ms": total_p50, "first_byte_p50_ms": first_p50, "audio_s": 5.0}},
    }


def level(concurrency: int, gateway: dict[str, Any], direct: dict[str, Any]) -> dict[str, Any]:
    return {"concurrency": concurrency, "gateway": gateway, "direct": direct, "ratio": ratios(gateway, direct)}


def report() -> dict[str, Any]:
    offline = [level(1, stats(11.5, 9, 90), stats(10, 8, 100)), level(32, stats(50, 40, 96), stats(45, 35, 100))]
    stream = [level(1, stats(20, 7.5, 50), stats(18, 2, 55)), level(64, stats(90, 60, 40, rss=150), stats(80, 50, 50))]
    return {
        "sweeps": [
            {"model": "bench_fixture", "mode": "offline", "levels": offline},
            {"model": "bench_fixture", "mode": "stream", "levels": stream},
        ],
        "encoding": [
            {"format": "mp3", "input_rate": 24_000, "cpu_s_per_audio_s": 0.009, "core_percent": 0.9},
            {"format": "opus", "input_rate": 24_000, "cpu_s_per_audio_s": 0.035, "core_percent": 3.5},
        ],
    }


def test_each_target_passes_fails_or_is_not_measured() -> None:
    results = {check.name: (check.measured, check.passed) for check in check_targets(report(), "bench_fixture")}
    assert results["gateway added latency p50, offline, concurrency 1 (bench_fixture)"] == (
        "+1.50 ms (5.0 s of wav)",
        True,
    )
    assert results["throughput at concurrency 32, offline (bench_fixture)"] == ("96.0 % of direct", True)
    assert results["throughput at concurrency 32, streaming (bench_fixture)"] == ("not measured", None)
    assert results["first streamed byte p50, concurrency 1 (bench_fixture)"][1] is False
    assert results["gateway RSS with 64 concurrent streams (bench_fixture)"] == ("150 MiB", True)
    assert results["mp3 streaming encoding per real-time stream (24 kHz in)"][1] is True
    assert results["opus streaming encoding per real-time stream (24 kHz in)"][1] is False
    assert results["aac streaming encoding per real-time stream (24 kHz in)"][1] is None
    assert results["embedded CPU default RTF, concurrency 1 (Piper)"][1] is None


def test_markdown_shows_the_verdicts() -> None:
    data = report()
    data.update(
        command="python -m benchmarks.bench",
        started="2026-01-01T00:00:00+00:00",
        machine={"cpu": "x", "cpus_usable": 2, "memory_gib": 8, "system": "L", "python": "3.11", "load_average": "0"},
        targets=targets_json(check_targets(data, "bench_fixture")),
    )
    for sweep in data["sweeps"]:
        sweep.update(triton_model="m", response_format="wav", texts=["short-en"])
        for entry in sweep["levels"]:
            for target in ("gateway", "direct"):
                entry[target].update(errors=0, requests=10)
    text = markdown(data)
    assert "| <= 3 % of a core | 3.50 % of a core | **FAIL** |" in text
    assert "| 32 | gateway | 40.0 / 40.0 / 40.0 | 50.0 / 50.0 / 50.0 |" in text
