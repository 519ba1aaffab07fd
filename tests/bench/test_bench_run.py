"""A short real benchmark run: both targets, both modes, two levels; JSON, Markdown and PNG come out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench
from tests.bench.conftest import STREAM_FIRST_CHUNK_DELAY_MS
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = pytest.mark.triton

TEXTS = ("short-en", "medium-zh")  # one sentence, two sentences: 1 s and 2 s of fixture tone


def test_sweep_reports_both_targets_at_each_level(bench_triton: EmbeddedTriton, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--out", str(out), "--parts", "sweep", "--models", "bench_fixture", "--levels", "1,2"]
    argv += ["--requests", "4", "--rounds", "1", "--passes", "2", "--warmup", "1", "--texts", ",".join(TEXTS)]
    assert bench.main([*argv, "--triton-url", bench_triton.grpc_url]) == 0

    report = json.loads((out / "bench.json").read_text())
    assert set(report) >= {"command", "started", "machine", "sweeps", "targets"}
    assert [(s["mode"], s["triton_model"]) for s in report["sweeps"]] == [
        ("offline", "bench_fixture"),
        ("stream", "bench_fixture_stream"),
    ]
    for sweep in report["sweeps"]:
        assert sweep["texts"] == list(TEXTS)
        assert [level["concurrency"] for level in sweep["levels"]] == [1, 2]
        for level in sweep["levels"]:
            for target in ("direct", "gateway"):
                stats = level[target]
                assert stats["requests"] == 4
                assert stats["errors"] == 0, stats["error_examples"]
                # Same audio both ways: two requests of each text, 1 s and 2 s.
                assert stats["audio_s"] == pytest.approx(6.0, abs=0.01)
                assert stats["by_text"]["short-en"]["audio_s"] == pytest.approx(1.0, abs=0.01)
                first, total = stats["first_byte_ms"], stats["total_ms"]
                assert 0 < first["p50"] <= first["p90"] <= first["p99"]
                assert first["p50"] <= total["p50"] <= total["p90"] <= total["p99"] < 10_000
                assert 0 < stats["rtf"] < 1
                assert stats["requests_per_s"] > 0
            assert level["gateway"]["rss_peak_mb"] > 20
            assert level["direct"]["rss_peak_mb"] is None
            assert level["ratio"]["total_p50"] > 0
        if sweep["mode"] == "stream":
            first_chunk = sweep["levels"][0]["direct"]["first_byte_ms"]["p50"]
            assert first_chunk >= STREAM_FIRST_CHUNK_DELAY_MS

    targets = {t["name"]: t for t in report["targets"]}
    assert targets["first streamed byte p50, concurrency 1 (bench_fixture)"]["passed"] in (True, False)
    assert targets["throughput at concurrency 32, offline (bench_fixture)"]["measured"] == "not measured"

    markdown = (out / "bench.md").read_text()
    assert "| 2 | gateway |" in markdown
    assert "first streamed byte p50" in markdown
    assert (out / "bench.png").read_bytes().startswith(b"\x89PNG")


def test_sweep_from_client_processes_against_gateway_workers(bench_triton: EmbeddedTriton, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--out", str(out), "--parts", "sweep", "--models", "bench_fixture", "--modes", "offline"]
    argv += ["--levels", "3", "--requests", "5", "--rounds", "1", "--passes", "1", "--warmup", "1"]
    argv += ["--texts", "short-en", "--client-processes", "2", "--gateway-workers", "2"]
    argv += ["--client-cores", "0", "--gateway-cores", "1", "--triton-url", bench_triton.grpc_url]
    assert bench.main(argv) == 0

    report = json.loads((out / "bench.json").read_text())
    # The CPUs are read back from the processes started.
    assert report["stack"] == {"gateway_workers": 2, "client_processes": 2, "cpus": {"clients": "0", "gateway": "1"}}
    (sweep,) = report["sweeps"]
    # The supervisor and its two workers at least.
    assert sweep["gateway_processes"] >= 3
    (level,) = sweep["levels"]
    for target in ("direct", "gateway"):
        stats = level[target]
        assert stats["requests"] == 5
        assert stats["errors"] == 0, stats["error_examples"]
        assert stats["audio_s"] == pytest.approx(5.0, abs=0.01)
        assert stats["requests_per_s"] > 0
    # Summed over the supervisor and its workers: more than one gateway process holds (about 110 MiB).
    assert level["gateway"]["rss_peak_mb"] > 150
    assert (
        "Sweep stack: gateway workers: 2; client processes: 2; CPUs: gateway 1, clients 0."
        in (out / "bench.md").read_text()
    )


def test_pinning_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        bench._parser().parse_args(["--client-cores", "0-x"])
    argv = ["--out", str(tmp_path), "--parts", "sweep", "--triton-url", "127.0.0.1:1"]
    with pytest.raises(SystemExit, match="--triton-cores pins the Triton started here"):
        bench.main([*argv, "--triton-cores", "0"])
    with pytest.raises(SystemExit, match="--gateway-workers apply to gateways started here"):
        bench.main([*argv, "--gateway-url", "http://127.0.0.1:1", "--gateway-workers", "2"])
