"""The text-streaming benchmark's table of where each path's first chunks went inside the server."""

from __future__ import annotations

from benchmarks.text_stream import stage_lines


def test_each_traced_path_gets_a_row_of_its_stages() -> None:
    ws = {"llm_prefill": {"p50": 180.4, "p90": 260.0}, "flow": {"p50": 95.0, "p90": 110.0}}
    report = {
        "levels": [
            {"sockets": 64, "pace_ms": 30, "websocket": {"stages": ws}, "http": {"stages": {}}},
            {"sockets": 128, "pace_ms": 30, "skipped": "budget"},
        ]
    }

    lines = stage_lines(report)

    header = next(line for line in lines if line.startswith("| pace"))
    assert "LLM to first speech token" in header and "token2wav queue" in header
    rows = [line for line in lines if line.startswith("| 30 ")]
    assert rows == ["| 30 | 64 | ws | - | - | 180 / 260 | - | - | 95 / 110 | - | - |"]
    assert stage_lines({"levels": [{"sockets": 1, "pace_ms": 30, "websocket": {}, "http": {}}]}) == []
