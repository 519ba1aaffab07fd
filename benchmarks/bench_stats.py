"""Figures of one concurrency level, and the gateway/direct comparison, as JSON-ready dicts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.bench_load import LevelRun, Sample

PERCENTILES = (50, 90, 99)
_ERROR_EXAMPLES = 3


def percentiles_ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    points = np.percentile(np.asarray(values) * 1000.0, PERCENTILES)
    return {f"p{p}": round(float(v), 3) for p, v in zip(PERCENTILES, points, strict=True)}


def summarize(run: LevelRun) -> dict[str, Any]:
    """Latency percentiles, aggregate RTF, throughput and errors of one target at one level."""
    ok = [s for s in run.samples if s.error is None]
    failed = [s for s in run.samples if s.error is not None]
    audio = sum(s.audio_seconds for s in ok)
    return {
        "requests": len(run.samples),
        "errors": len(failed),
        "error_examples": sorted({s.error for s in failed if s.error})[:_ERROR_EXAMPLES],
        "first_byte_ms": percentiles_ms([s.first_byte for s in ok if s.first_byte is not None]),
        "total_ms": percentiles_ms([s.total for s in ok]),
        "wall_s": round(run.wall, 3),
        "audio_s": round(audio, 3),
        # Aggregate real-time factor: wall time of the level over the audio it produced.
        "rtf": round(run.wall / audio, 5) if audio else None,
        "requests_per_s": round(len(ok) / run.wall, 3) if run.wall else None,
        "audio_s_per_s": round(audio / run.wall, 3) if run.wall else None,
        "rss_peak_mb": round(run.rss_peak_mb, 1) if run.rss_peak_mb is not None else None,
        "by_text": _by_text(ok),
    }


def _by_text(samples: Sequence[Sample]) -> dict[str, dict[str, Any]]:
    texts = sorted({s.text for s in samples})
    figures: dict[str, dict[str, Any]] = {}
    for name in texts:
        mine = [s for s in samples if s.text == name]
        first = [s.first_byte for s in mine if s.first_byte is not None]
        figures[name] = {
            "requests": len(mine),
            "audio_s": round(float(np.mean([s.audio_seconds for s in mine])), 3),
            "first_byte_p50_ms": percentiles_ms(first)["p50"],
            "total_p50_ms": percentiles_ms([s.total for s in mine])["p50"],
        }
    return figures


def ratios(gateway: dict[str, Any], direct: dict[str, Any]) -> dict[str, float | None]:
    """Gateway over direct for each latency percentile and throughput; added ms at the medians."""
    out: dict[str, float | None] = {}
    for figure in ("first_byte_ms", "total_ms"):
        for point in gateway[figure]:
            out[f"{figure.removesuffix('_ms')}_{point}"] = _ratio(gateway[figure][point], direct[figure][point])
        out[f"{figure.removesuffix('_ms')}_added_p50_ms"] = _difference(gateway[figure]["p50"], direct[figure]["p50"])
    out["requests_per_s"] = _ratio(gateway["requests_per_s"], direct["requests_per_s"])
    out["rtf"] = _ratio(gateway["rtf"], direct["rtf"])
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return round(a / b, 4)


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)
