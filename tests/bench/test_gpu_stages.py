"""What the GPU benchmark reads from the models' stage traces."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu_cosyvoice2 import _first_hop_cell
from benchmarks.gpu_stages import first_hops
from tts_gateway.models.stage_trace import StageTrace


def test_first_hops_of_the_passes_own_streams(tmp_path: Path) -> None:
    trace = StageTrace("orchestrator", tmp_path)
    trace.record("s1", request="pass1-a", first_hop_tokens=25)
    trace.record("s2", request="pass1-b", first_hop_tokens=50)
    trace.record("s3", request="pass1-c", first_hop_tokens=50)
    trace.record("s4", request="other-pass", first_hop_tokens=100)
    trace.record("s5", request="pass1-offline", first_hop_tokens=0)
    sent = {name: (0.0, 1.0) for name in ("pass1-a", "pass1-b", "pass1-c", "pass1-offline")}

    hops = first_hops(tmp_path, sent)

    assert hops == {"mean": 41.7, "min": 25, "max": 50}
    assert _first_hop_cell(hops) == "41.7 (25-50)"
    assert first_hops(tmp_path, {"nothing": (0.0, 1.0)}) == {}
    assert _first_hop_cell({}) == "-"
