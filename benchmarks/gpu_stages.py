"""Where a streamed request's first chunk spends its time, from the models' stage traces.

The server runs with ``TTS_STAGE_TRACE_DIR`` set (``tts_gateway/models/stage_trace.py``): the orchestrator
records when a request started, had its voice prompt, saw its first LLM token, reached its first
hop and sent its first chunk (keyed by its token2wav session id, with the Triton request id); the
LLM records when the request was submitted, admitted (prefill starts) and drew its first token
(keyed by the same session id, which the orchestrator sends as the LLM request id); token2wav
records each batch a call ran in, with its group's flow and HiFT time. The client adds when it sent the
request and when the first audio arrived. All are ``time.monotonic()`` of one machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tts_gateway.models.cosyvoice2.orchestrator.streaming import DEFAULT_PRE_LOOKAHEAD
from tts_gateway.models.stage_trace import read_traces

STAGES = (
    ("to_orchestrator", "client send -> orchestrator starts (gRPC, Triton queue, stream worker)"),
    ("prompt", "voice prompt (cached after warm-up)"),
    ("llm_queue", "LLM: waiting for a slot / the next step"),
    ("llm_prefill", "LLM: prefill and first token"),
    ("llm_to_hop", "LLM: tokens up to the first hop (+3 look-ahead), into the orchestrator"),
    ("t2w_queue", "token2wav: waiting in its queue for its group"),
    ("flow", "token2wav: flow (encoder + 10-step solve) of its group"),
    ("hift", "token2wav: HiFT of its group"),
    ("t2w_other", "token2wav: rest (BLS transport, tensors)"),
    ("to_client", "orchestrator first chunk -> client"),
)
# A text stream's first chunk beyond the stages above: in the gateway, which records its sessions
# (``tts_gateway/gateway/speech/text_stream/session_times.py``), and inside the LLM engine's share.
SESSION_STAGES = (
    ("gw_words", "gateway: first text -> first piece normalised"),
    ("gw_opening", "gateway: session opening -> orchestrator started (slots, gRPC, sequence batcher)"),
    ("llm_making", "LLM engine: first speech token -> the first hop's last token (look-ahead included)"),
    ("llm_parked", "LLM engine: of that, out of its row waiting for text"),
    ("llm_handing", "LLM engine: that token made -> orchestrator has it"),
    ("gw_back", "orchestrator first chunk -> gateway has it"),
    ("gw_out", "gateway has it -> on towards the socket"),
)
# Rates of the LLM engine over a whole request (not parts of the first chunk's time): how long a
# decode step keeps the GPU busy, against how far apart the engine hands out a request's tokens.
ENGINE_RATES = (
    ("llm_step_gpu", "LLM engine: GPU time of one decode step (mean over the request's steps)"),
    ("llm_token_wall", "LLM engine: time between two of the request's tokens (first to last)"),
    ("llm_step_wait", "LLM engine: host waiting for a launched step (mean; ~0 when the host is the bottleneck)"),
    (
        "llm_step_period",
        "LLM engine: launch to launch of the request's decode steps (mean; less the GPU time, about the host's work "
        "between steps; steps before a yield to token2wav are left out)",
    ),
)


def first_chunk_stages(trace_dir: Path, sent: Mapping[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Per stage, p50 and p90 in ms over the streamed requests in ``sent``.

    ``sent`` maps a Triton request id to (client send time, client first-audio time).
    """
    events: list[dict[str, Any]] = read_traces(trace_dir)
    orchestrator = {e["request"]: e for e in events if e["stage"] == "orchestrator" and e.get("request") in sent}
    llm, first_batches = _llm_and_first_batches(events)
    samples: dict[str, list[float]] = {}
    for request_id, (client_sent, client_first) in sent.items():
        o = orchestrator.get(request_id)
        if o is None:
            continue
        values = _server_stages(o, llm, first_batches)
        if values is None:
            continue
        values["to_orchestrator"] = o["started"] - client_sent
        values["to_client"] = client_first - o["first_chunk"]
        _add_ms(samples, values)
    return _stage_percentiles(samples)


def stages_between(trace_dir: Path, since: float, until: float) -> dict[str, dict[str, float]]:
    """Per stage, p50 and p90 in ms over the streams the orchestrator started between ``since`` and ``until``
    (``time.monotonic()`` of this machine), from the orchestrator on: for clients whose requests the traces cannot
    name (a text stream's session over the gateway's WebSocket). A text stream enters the LLM with its first piece
    of text, so its ``llm_queue`` is mostly waiting for that text, and its ``llm_prefill`` runs to its first speech
    token, through as many rounds of text as that takes."""
    events: list[dict[str, Any]] = read_traces(trace_dir)
    llm, first_batches = _llm_and_first_batches(events)
    gateway = {e["request"]: e for e in events if e["stage"] == "gateway"}
    samples: dict[str, list[float]] = {}
    for o in events:
        if o["stage"] != "orchestrator" or not since <= float(o["started"]) < until:
            continue
        _add_ms(samples, _server_stages(o, llm, first_batches) or {})
        _add_ms(samples, _session_stages(o, llm.get(str(o["key"])), gateway.get(o.get("request"))))
    return _stage_percentiles(samples)


def _session_stages(o: dict[str, Any], g: dict[str, Any] | None, w: dict[str, Any] | None) -> dict[str, float]:
    """Seconds of a text stream's first chunk in the gateway (``w``, when it recorded the session) and in
    the LLM engine (``g``): as many of :data:`SESSION_STAGES` as the records hold."""
    values: dict[str, float] = {}
    if w is not None and w["opening"] and o["started"]:
        values["gw_words"] = w["opening"] - w["text_in"]
        values["gw_opening"] = o["started"] - w["opening"]
        if w["first_audio"] and o["first_chunk"]:
            values["gw_back"] = w["first_audio"] - o["first_chunk"]
        if w["first_out"] and w["first_audio"]:
            values["gw_out"] = w["first_out"] - w["first_audio"]
    hop = int(o.get("first_hop_tokens") or 0)
    times = g.get("token_times", []) if g is not None else []
    if g is not None and hop and len(times) >= hop + DEFAULT_PRE_LOOKAHEAD:
        made = float(times[hop + DEFAULT_PRE_LOOKAHEAD - 1])
        first = float(g["first_token"])
        values["llm_making"] = made - first
        values["llm_parked"] = sum(max(0.0, min(back, made) - max(left, first)) for left, back in g.get("waits", []))
        values["llm_handing"] = o["first_hop"] - made
    return values


def _add_ms(samples: dict[str, list[float]], values: Mapping[str, float]) -> None:
    """One stream's stages (seconds) into the samples of each (ms)."""
    for name, value in values.items():
        samples.setdefault(name, []).append(1000.0 * float(value))


def _stage_percentiles(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Each sampled stage's p50 and p90 (ms), in the pipeline's order, then the engine's rates."""
    order = [name for name, _ in (*STAGES, *SESSION_STAGES, *ENGINE_RATES)]
    return {name: _percentiles(samples[name]) for name in order if samples.get(name)}


def _llm_and_first_batches(events: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The LLM's event of each session, and token2wav's event of each session's first chunk."""
    llm = {e["key"]: e for e in events if e["stage"] == "llm"}
    first_batches: dict[str, dict[str, Any]] = {}
    for event in events:
        if event["stage"] == "token2wav" and event["offset"] == 0 and event["key"] not in first_batches:
            first_batches[str(event["key"])] = event
    return llm, first_batches


def _server_stages(o: dict[str, Any], llm: dict[str, Any], first_batches: dict[str, Any]) -> dict[str, float] | None:
    """Seconds of each stage of one stream's first chunk inside the server (None: a stage was not traced)."""
    session = str(o["key"])
    g, t = llm.get(session), first_batches.get(session)
    if g is None or t is None or not o["first_chunk"]:
        return None
    values = {
        "prompt": o["prompt_ready"] - o["started"],
        "llm_queue": g["admitted"] - g["submitted"],
        "llm_prefill": g["first_token"] - g["admitted"],
        "llm_to_hop": o["first_hop"] - g["first_token"],
        "t2w_queue": t["started"] - o["first_hop"],
        "flow": t["flow_s"],
        "hift": t["hift_s"],
        "t2w_other": o["first_chunk"] - t["started"] - t["flow_s"] - t["hift_s"],
    }
    if g.get("steps"):
        values["llm_step_gpu"] = float(g["step_s"]) / float(g["steps"])
        values["llm_step_wait"] = float(g.get("wait_s", 0.0)) / float(g["steps"])
    if g.get("periods"):
        values["llm_step_period"] = float(g["period_s"]) / float(g["periods"])
    if int(g["tokens"]) > 1:
        values["llm_token_wall"] = (float(g["last_token"]) - float(g["first_token"])) / (int(g["tokens"]) - 1)
    return values


def token2wav_batches(trace_dir: Path, sent: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """How many calls token2wav converted together (one group, one flow pass): mean and max over the
    calls of the streamed requests in ``sent`` (the warm-up's and other passes' excluded); and how many
    calls (chunks) each of those Triton streams took, the same count for direct streams and the
    gateway's (whose HTTP reads split and join chunks)."""
    events: list[dict[str, Any]] = read_traces(trace_dir)
    sessions = {str(e["key"]) for e in events if e["stage"] == "orchestrator" and e.get("request") in sent}
    rows = [float(e["rows"]) for e in events if e["stage"] == "token2wav" and str(e["key"]) in sessions]
    if not rows:
        return {}
    return {
        "mean": round(float(np.mean(rows)), 2),
        "max": max(rows),
        "calls_per_stream": round(len(rows) / len(sessions), 2),
    }


def first_hops(trace_dir: Path, sent: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """The tokens of the first chunk of the streamed requests in ``sent`` (the orchestrator's first hop,
    which grows under load where ``max_first_hop_tokens`` lets it): mean, min and max."""
    events: list[dict[str, Any]] = read_traces(trace_dir)
    hops = [
        int(e["first_hop_tokens"])
        for e in events
        if e["stage"] == "orchestrator" and e.get("request") in sent and e.get("first_hop_tokens")
    ]
    if not hops:
        return {}
    return {"mean": round(float(np.mean(hops)), 1), "min": min(hops), "max": max(hops)}


def _percentiles(values: Iterable[float]) -> dict[str, float]:
    p50, p90 = np.percentile(list(values), [50, 90])
    return {"p50": round(float(p50), 1), "p90": round(float(p90), 1)}
