"""The GPU benchmark's floors: FLOPs of the flow estimator, bytes of an LLM decode step, and which traces they use."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.gpu_cosyvoice2 import add_floors, floor_lines
from benchmarks.gpu_floors import DeviceRates, EstimatorFlops, Floors, LlmBytes, stage_floors
from tts_gateway.models.cosyvoice2.checkpoints.random_checkpoint import full_llm_config, official_config
from tts_gateway.models.stage_trace import StageTrace


@pytest.fixture(scope="module")
def estimator_flops() -> EstimatorFlops:
    return EstimatorFlops(official_config().flow.decoder.estimator)


def test_estimator_flops_follow_the_frames_exactly(estimator_flops: EstimatorFlops) -> None:
    counted = EstimatorFlops(official_config().flow.decoder.estimator, samples=(100, 300, 500))
    assert estimator_flops(300) == pytest.approx(counted(300), rel=1e-6)
    assert estimator_flops(1000) == pytest.approx(counted(1000), rel=1e-6)
    # Dense layers of CosyVoice2's 71 M-parameter estimator: about twice its parameters per frame, plus attention.
    assert 2 * 71e6 * 300 < counted(300) < 4 * 71e6 * 300


def test_a_decode_step_reads_qwen2_05bs_weights_and_cache() -> None:
    llm = LlmBytes.of(full_llm_config())
    # Qwen2-0.5B: 494 M parameters, 136 M of them the token embedding; bf16.
    assert 2 * 350e6 < llm.weights < 2 * 365e6
    # 24 layers x keys and values x 2 KV heads x 64 dimensions x 2 bytes.
    assert llm.kv_per_position == 24 * 2 * 2 * 64 * 2


def test_floors_of_a_pass_use_its_own_requests(tmp_path: Path, estimator_flops: EstimatorFlops) -> None:
    floors = Floors(DeviceRates(matmul_flops=1e15, copy_bytes=2e12), estimator_flops, LlmBytes(10**9, 10**4), 10)
    StageTrace("orchestrator", tmp_path).record("s1", request="pass-a")
    StageTrace("orchestrator", tmp_path).record("s2", request="other-pass")
    token2wav = StageTrace("token2wav", tmp_path)
    token2wav.record("s1", offset=0, rows=4, frames=250.0)
    token2wav.record("s1", offset=25, rows=8, frames=300.0)
    token2wav.record("s2", offset=0, rows=1, frames=100.0)
    StageTrace("llm", tmp_path).record("s1", prompt_tokens=200, tokens=100)

    result = stage_floors(tmp_path, {"pass-a": (0.0, 1.0)}, floors, rows=16)

    flow_ms = 1000 * 4 * 2 * 10 * estimator_flops(250) / 1e15
    step_ms = 1000 * (1e9 + 16 * 250 * 1e4) / 2e12
    assert result["flow_floor"]["p50"] == pytest.approx(flow_ms, abs=0.01)
    assert result["llm_step_floor"]["p50"] == pytest.approx(step_ms, abs=0.01)
    assert stage_floors(tmp_path, {"nothing": (0.0, 1.0)}, floors, rows=16) == {}


def test_the_report_sets_each_stage_against_its_floor(tmp_path: Path, estimator_flops: EstimatorFlops) -> None:
    floors = Floors(DeviceRates(matmul_flops=1e15, copy_bytes=2e12), estimator_flops, LlmBytes(10**9, 10**4), 10)
    StageTrace("orchestrator", tmp_path).record("s1", request="pass-a")
    StageTrace("token2wav", tmp_path).record("s1", offset=0, rows=4, frames=250.0)
    StageTrace("llm", tmp_path).record("s1", prompt_tokens=200, tokens=100)
    streamed = {
        "target": "gateway",
        "mode": "stream",
        "gpus": 1,
        "concurrency": 16,
        "stages": {"flow": {"p50": 120.0, "p90": 130.0}, "llm_step_gpu": {"p50": 3.0, "p90": 4.0}},
        "per_request": [{"request_id": "pass-a", "sent": 0.0, "first_at": 1.0, "error": None}],
    }
    report = {"setup": {"floors": floors.describe()}, "passes": [streamed, {"mode": "offline", "concurrency": 16}]}

    add_floors(report, tmp_path, floors, llm_slots=64)
    lines = floor_lines(report, [streamed])

    step_floor = (1e9 + 16 * 250 * 1e4) / 2e12 * 1000
    assert f"| 3.0 / {step_floor:.2f} ({3.0 / step_floor:.0f}x) |" in "\n".join(lines)
    assert any(line.startswith("| token2wav: flow of its group") and "x) |" in line for line in lines)
    assert "floors" not in report["passes"][1]
