"""What the GPU benchmark reads from the models' stage traces."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu_cosyvoice2 import _first_hop_cell
from benchmarks.gpu_stages import SESSION_STAGES, first_chunk_stages, first_hops, stages_between
from tts_gateway.models.stage_trace import StageTrace, TraceValue


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


def trace_stream(directory: Path, session: str, started: float, *, request: str = "", **llm: TraceValue) -> None:
    """One stream's records as the orchestrator, the LLM and token2wav write them: 10 ms of voice prompt, 20 in the
    LLM's queue, 30 to the first token, 40 to the first hop, 5 in token2wav's queue, 50 of flow and 8 of HiFT."""
    StageTrace("orchestrator", directory).record(
        session,
        request=request,
        started=started,
        prompt_ready=started + 0.010,
        first_token=started + 0.060,
        first_hop=started + 0.100,
        first_chunk=started + 0.170,
        first_hop_tokens=25,
    )
    StageTrace("llm", directory).record(
        session,
        submitted=started + 0.010,
        admitted=started + 0.030,
        first_token=started + 0.060,
        last_token=started + 0.460,
        tokens=101,
        steps=100,
        step_s=0.2,
        wait_s=0.1,
        periods=99,
        period_s=0.396,
        **llm,
    )
    token2wav = StageTrace("token2wav", directory)
    token2wav.record(session, offset=0, started=started + 0.105, rows=2, flow_s=0.050, hift_s=0.008)
    token2wav.record(session, offset=25, started=started + 0.300, rows=2, flow_s=0.5, hift_s=0.5)


def test_the_stages_of_the_streams_started_in_a_window(tmp_path: Path) -> None:
    trace_stream(tmp_path, "early", 100.0)
    trace_stream(tmp_path, "s1", 200.0)
    trace_stream(tmp_path, "s2", 201.0)
    StageTrace("orchestrator", tmp_path).record("no-llm", started=200.5, first_chunk=201.0)

    stages = stages_between(tmp_path, 150.0, 250.0)

    medians = {name: figures["p50"] for name, figures in stages.items()}
    assert medians == {
        "prompt": 10.0,
        "llm_queue": 20.0,
        "llm_prefill": 30.0,
        "llm_to_hop": 40.0,
        "t2w_queue": 5.0,
        "flow": 50.0,
        "hift": 8.0,
        "t2w_other": 7.0,
        "llm_step_gpu": 2.0,
        "llm_token_wall": 4.0,
        "llm_step_wait": 1.0,
        "llm_step_period": 4.0,
    }
    assert stages_between(tmp_path, 300.0, 400.0) == {}


def test_a_requests_stages_with_the_clients_times(tmp_path: Path) -> None:
    trace_stream(tmp_path, "s1", 200.0, request="r1")
    trace_stream(tmp_path, "s2", 201.0, request="other-pass")

    stages = first_chunk_stages(tmp_path, {"r1": (199.99, 200.18)})

    medians = {name: figures["p50"] for name, figures in stages.items()}
    assert medians["to_orchestrator"] == 10.0 and medians["to_client"] == 10.0
    assert medians["llm_to_hop"] == 40.0 and medians["t2w_other"] == 7.0
    assert list(medians)[:2] == ["to_orchestrator", "prompt"]


def test_a_text_streams_way_through_the_gateway_and_the_llm_engine(tmp_path: Path) -> None:
    # A session the gateway opened 15 ms after its first text, whose orchestrator started 25 ms later; its
    # engine made the first hop's 28th token (25 + 3 look-ahead) 34 ms after its first, 6 ms of that
    # out of its row waiting for text (a wait before its first token does not count), and the
    # orchestrator had it 6 ms later.
    first = 200.060
    token_times = [first + k * 0.001 for k in range(27)] + [first + 0.034, first + 0.040]
    trace_stream(
        tmp_path,
        "s1",
        200.0,
        request="gw-session:0",
        token_times=token_times,
        waits=[[199.0, 200.05], [200.07, 200.076]],
    )
    StageTrace("gateway", tmp_path).record(
        "gw-session",
        request="gw-session:0",
        text_in=199.960,
        opening=199.975,
        opened=200.01,
        first_taken=200.02,
        first_audio=200.174,
        first_out=200.175,
    )

    medians = {name: figures["p50"] for name, figures in stages_between(tmp_path, 150.0, 250.0).items()}

    assert {name: medians[name] for name, _ in SESSION_STAGES} == {
        "gw_words": 15.0,
        "gw_opening": 25.0,
        "llm_making": 34.0,
        "llm_parked": 6.0,
        "llm_handing": 6.0,
        "gw_back": 4.0,
        "gw_out": 1.0,
    }
