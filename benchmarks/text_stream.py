"""Benchmark the text-to-speech WebSocket against the OpenAI HTTP path, with text arriving as an LLM writes it.

Each utterance (a few sentences) is streamed over ``multi-stream-input`` one word at a time at
``--paces`` (milliseconds per word: 30 is an LLM at full speed, 200 a slow one). Measured per
utterance, as a listener who starts playing at the first audio hears it:

- first audio after the first word was sent;
- first audio after the first sentence's last word was sent (the gateway waits for the next
  word to know the sentence has ended, so one word's pace is part of it);
- stalls: the playback buffer running dry before the last audio (count and seconds).

The HTTP baseline is what a client of ``POST /v1/audio/speech`` does with the same LLM: each
sentence is sent whole as soon as its last word has arrived (streamed pcm), sentences in
parallel as they come, played in order; the same three figures. ``--levels`` runs that many
sockets (and then as many HTTP clients) at once, ``--rounds`` utterances each. Per level and path
also: RTF (the path's wall time at that level over the seconds of audio it produced: upstream's
definition, a throughput figure, which the text's pace bounds from below at slow paces), failed
utterances (an error message, a closed socket, an HTTP error, ``--timeout-s`` passed) with the
first error, and, where the benchmark knows the Triton server, the requests its text-streaming
model (``cosyvoice2_bistream``) and its streaming models took meanwhile: the proof of which path
served the sockets. A CosyVoice2 server started here (``--profile``) traces its streams'
stages (``tts_gateway/models/stage_trace.py``), and the report adds where each path's first chunks
went inside it (voice prompt, LLM, token2wav's queue, flow, HiFT), per level.

Where the gateway runs:

- ``--gateway-url URL``: a gateway already running;
- ``--triton-url HOST:PORT``: a gateway started here on that Triton (gRPC), e.g. one a GPU run
  already serves, so that this runs in the same call as other measurements;
- ``--profile NAME``: a Triton started here on a CosyVoice2 profile over a random checkpoint under
  ``--workdir`` (``benchmarks/cosyvoice2_triton.py``: full size on ``gpu-*`` profiles, tiny shapes
  with the full size's LLM head on ``cosyvoice2-cpu``), then a gateway on it, as with ``--triton-url``;
- none of them: the gateway on its embedded CPU default (Piper; voice ``joe``).

With random CosyVoice2 weights the audio is noise; its length is what the checkpoint's LLM head
imposes (about 2 speech tokens per text token on both paths; the sockets' last few text tokens
get none), and the cost per token is the real model's at full size.

A warm-up (``--warmup`` sockets, then as many HTTP clients, one utterance each; by default the
largest level) goes first, so that no level pays for CUDA's lazy start or the voice prompts; a
failed warm-up ends the run. The report, NAME.json and NAME.md in ``--out`` (``--name``, default
``text-stream``), names the command that produced it and is rewritten after every level, so an
interrupted run keeps what it measured; ``--budget-s`` skips the levels that would end later than
that (counted from the start, stack start-up included). The gateway's and Triton's logs stay under
``--workdir``; the checkpoint there is reused.

    python -m benchmarks.text_stream --out var/bench --levels 1,4  # Piper, embedded
    python -m benchmarks.text_stream --gateway-url http://HOST:8080 --voice alloy --levels 1,4,16
    # CPU rehearsal of the GPU run (2 cores, tiny checkpoint; one to two minutes):
    python -m benchmarks.text_stream --profile cosyvoice2-cpu --set cosyvoice2.instance_count=1 \\
        --set cosyvoice2_stream.instance_count=1 --levels 1,2 --paces 30 --rounds 1 --name rehearsal
    # One GPU, its own stack (the full-size checkpoint is written first; 5 to 7 minutes):
    python -m benchmarks.text_stream --profile gpu-torch --levels 1,16,64 --paces 30,200 --rounds 2 \\
        --gateway-workers 4 --budget-s 480 --out var/bench --name text-stream-gpu
    # One GPU, on a Triton already serving gpu-torch over the full-size checkpoint:
    tts-models random-full --models-root var/random-full
    tts-models launch --profile gpu-torch --models-root var/random-full --repo var/random-full/repo &
    python -m benchmarks.text_stream --triton-url 127.0.0.1:8001 --levels 1,16,64 --gateway-workers 4
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import tritonclient.grpc as grpcclient
import websockets
from tritonclient.utils import InferenceServerException

from benchmarks import gpu_stages
from benchmarks.bench_stack import GatewayServer
from benchmarks.bench_stats import percentiles_ms
from benchmarks.cosyvoice2_triton import cosyvoice2_triton
from benchmarks.gpu_query import nvidia_smi
from benchmarks.gpu_sanity import print_server_errors
from benchmarks.server_processes import CpuUse, cores_cell
from tts_gateway.models import stage_trace

UTTERANCES = (
    "Thanks for calling. Your order shipped this morning and should arrive on Thursday. "
    "Is there anything else I can help you with today?",
    "The weather will be sunny with a light breeze. Later in the evening, expect some clouds. "
    "Tomorrow looks much the same.",
)
PCM_RATE = 24_000
_STALL_MIN = 0.02  # a gap shorter than this is not heard as a stall
# Triton models whose request counts tell which path served a level (absent ones are left out).
SERVING_MODELS: Final = ("cosyvoice2_bistream", "cosyvoice2_stream", "piper_stream")


@dataclass
class Playback:
    """When audio arrived, and what a listener who starts at the first audio hears."""

    started: float
    first_sentence_end: float
    arrivals: list[tuple[float, float]] = field(default_factory=list)  # (arrival, seconds of audio)

    def add(self, seconds: float) -> None:
        self.arrivals.append((time.perf_counter(), seconds))

    def figures(self) -> dict[str, float]:
        if not self.arrivals:
            raise RuntimeError("no audio arrived")
        first = self.arrivals[0][0]
        clock = first
        stalls = 0
        stalled = 0.0
        for arrival, seconds in self.arrivals:
            if arrival - clock > _STALL_MIN:
                stalls += 1
                stalled += arrival - clock
            clock = max(clock, arrival) + seconds
        return {
            "first_audio_after_first_text": first - self.started,
            "first_audio_after_sentence_end": first - self.first_sentence_end,
            "stalls": stalls,
            "stalled_s": stalled,
            "audio_s": sum(seconds for _, seconds in self.arrivals),
        }


def words_of(text: str) -> list[str]:
    words = text.split(" ")
    return [words[0], *(f" {word}" for word in words[1:])]


async def over_websocket(url: str, text: str, pace: float, voice: str, context: str) -> dict[str, float]:
    query = f"model_id=eleven_flash_v2_5&output_format=pcm_{PCM_RATE}"
    ws_url = url.replace("http://", "ws://") + f"/v1/text-to-speech/{voice}/multi-stream-input?{query}"
    async with websockets.connect(ws_url, max_size=16 * 2**20) as ws:
        await ws.send(json.dumps({"text": " ", "context_id": context}))
        playback = Playback(started=0.0, first_sentence_end=0.0)

        async def write() -> None:
            sentence_ended = False
            playback.started = time.perf_counter()
            for word in words_of(text):
                await ws.send(json.dumps({"text": word, "context_id": context}))
                if not sentence_ended and word.rstrip().endswith((".", "?", "!")):
                    playback.first_sentence_end = time.perf_counter()
                    sentence_ended = True
                await asyncio.sleep(pace)
            await ws.send(json.dumps({"text": "", "context_id": context, "flush": True}))
            await ws.send(json.dumps({"context_id": context, "close_context": True}))

        writer = asyncio.create_task(write())
        try:
            final = False
            async for raw in ws:
                message = json.loads(raw)
                if message.get("error"):
                    raise RuntimeError(message.get("message") or message["error"])
                if message.get("audio"):
                    playback.add(len(base64.b64decode(message["audio"])) / 2 / PCM_RATE)
                if message.get("isFinal"):
                    final = True
                    break
            if not final:
                raise RuntimeError(f"the socket closed before the end: {ws.close_code} {ws.close_reason}")
            await writer
        finally:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, websockets.ConnectionClosed):
                await writer
    return playback.figures()


async def over_http(client: httpx.AsyncClient, url: str, text: str, pace: float, voice: str) -> dict[str, float]:
    """Sentences posted whole as the LLM completes them; their audio played in order."""
    sentences: list[str] = []
    current = ""
    for word in words_of(text):
        current += word
        if word.rstrip().endswith((".", "?", "!")):
            sentences.append(current.strip())
            current = ""
    if current.strip():
        sentences.append(current.strip())
    started = time.perf_counter()
    queues: list[asyncio.Queue[bytes | None]] = [asyncio.Queue() for _ in sentences]
    ends: list[float] = []

    speakers: list[asyncio.Task[None]] = []

    async def speak(sentence: str, queue: asyncio.Queue[bytes | None]) -> None:
        body = {"model": "tts-1", "voice": voice, "input": sentence, "response_format": "pcm"}
        try:
            async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
                response.raise_for_status()
                async for data in response.aiter_bytes():
                    await queue.put(data)
        finally:
            # A failed sentence ends its part of the playback too; the gather below raises its error.
            await queue.put(None)

    async def write() -> None:
        for sentence, queue in zip(sentences, queues, strict=True):
            await asyncio.sleep(pace * len(sentence.split(" ")))
            ends.append(time.perf_counter())
            speakers.append(asyncio.create_task(speak(sentence, queue)))

    writer = asyncio.create_task(write())
    playback = Playback(started=started, first_sentence_end=0.0)
    try:
        for queue in queues:
            while (data := await queue.get()) is not None:
                playback.add(len(data) / 2 / PCM_RATE)
        await writer
        await asyncio.gather(*speakers)
    finally:
        for task in (writer, *speakers):
            task.cancel()
        await asyncio.gather(writer, *speakers, return_exceptions=True)
    playback.first_sentence_end = ends[0]
    return playback.figures()


@dataclass
class PathRun:
    """One path's utterances at one level: each one's figures, or its error."""

    wall_s: float = 0.0
    runs: list[dict[str, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def attempt(run: PathRun, utterance: Awaitable[dict[str, float]], limit_s: float) -> None:
    """Record one utterance's figures, or why it failed; a failure never stops the level."""
    try:
        async with asyncio.timeout(limit_s):
            run.runs.append(await utterance)
    except TimeoutError:
        run.errors.append(f"no end within {limit_s:.0f} s")
    except (OSError, RuntimeError, httpx.HTTPError, websockets.WebSocketException) as exc:
        run.errors.append(f"{type(exc).__name__}: {exc}")


def summary(run: PathRun) -> dict[str, Any]:
    runs = run.runs
    audio = sum(r["audio_s"] for r in runs)
    count = max(1, len(runs))
    return {
        "utterances": len(runs) + len(run.errors),
        "failed": len(run.errors),
        "first_error": run.errors[0] if run.errors else None,
        "wall_s": round(run.wall_s, 2),
        "rtf": round(run.wall_s / audio, 4) if audio else None,
        "first_audio_after_first_text_ms": percentiles_ms([r["first_audio_after_first_text"] for r in runs]),
        "first_audio_after_sentence_end_ms": percentiles_ms([r["first_audio_after_sentence_end"] for r in runs]),
        "stalls_per_utterance": round(sum(r["stalls"] for r in runs) / count, 2),
        "stalled_s_per_utterance": round(sum(r["stalled_s"] for r in runs) / count, 3),
        "audio_s_per_utterance": round(audio / count, 2),
    }


class ServedCounts:
    """Requests the Triton server's serving models have taken, to tell which path served a run (a
    text-streaming session is one request, and one more per piece of text, end and close)."""

    def __init__(self, triton_url: str | None) -> None:
        self._url = triton_url

    def now(self) -> dict[str, int]:
        if self._url is None:
            return {}
        client = grpcclient.InferenceServerClient(self._url)
        counts = {}
        try:
            for model in SERVING_MODELS:
                with contextlib.suppress(InferenceServerException):  # a model this server lacks
                    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
                    counts[model] = sum(int(stats[kind].get("count", 0)) for kind in ("success", "fail"))
        finally:
            client.close()
        return counts

    def since(self, before: dict[str, int]) -> dict[str, int]:
        return {model: count - before.get(model, 0) for model, count in self.now().items()}


async def level(
    args: argparse.Namespace,
    url: str,
    sockets: int,
    pace: float,
    served: ServedCounts,
    cpu_roots: dict[str, int],
    *,
    rounds: int,
    trace_dir: Path | None = None,
) -> dict[str, Any]:
    """``sockets`` WebSocket clients at once, ``rounds`` utterances each; then as many HTTP clients. The
    processes under ``cpu_roots`` (label -> pid: the Triton server and the gateway started here) have their
    CPU measured over each path's run; a CosyVoice2 server writing stage traces to ``trace_dir`` has its
    streams' first chunks broken down by stage."""

    def text(index: int, round_: int) -> str:
        return UTTERANCES[(index + round_) % len(UTTERANCES)]

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=4 * sockets)
    async with httpx.AsyncClient(timeout=args.timeout_s, limits=limits) as client:

        def utterance(path: str, index: int, round_: int) -> Awaitable[dict[str, float]]:
            if path == "websocket":
                return over_websocket(url, text(index, round_), pace, args.voice, f"s{index}r{round_}")
            return over_http(client, url, text(index, round_), pace, args.voice)

        row: dict[str, Any] = {"sockets": sockets, "pace_ms": round(pace * 1000)}
        for path in ("websocket", "http"):
            run = PathRun()

            async def one_client(index: int, path: str = path, run: PathRun = run) -> None:
                for round_ in range(rounds):
                    await attempt(run, utterance(path, index, round_), args.timeout_s)

            before = served.now()
            cpu = CpuUse(cpu_roots)
            cpu.start()
            started, since = time.perf_counter(), time.monotonic()
            await asyncio.gather(*(one_client(i) for i in range(sockets)))
            run.wall_s = time.perf_counter() - started
            row[path] = summary(run) | {"triton_requests": served.since(before), "cpu_cores": cpu.cores()}
            if trace_dir is not None and (stages := gpu_stages.stages_between(trace_dir, since, time.monotonic())):
                row[path]["stages"] = stages
    return row


def _ms(figures: dict[str, float | None]) -> str:
    p50, p90 = figures["p50"], figures["p90"]
    return "-" if p50 is None or p90 is None else f"{p50:.0f} / {p90:.0f}"


def markdown(report: dict[str, Any]) -> str:
    setup = report["setup"]
    stack = setup.get("stack")
    # Reports from before the CPU was measured, and runs on a gateway not started here, have no such column.
    with_cpu = any(row.get(path, {}).get("cpu_cores") for row in report["levels"] for path in ("websocket", "http"))
    lines = [
        f"# Text streaming: {setup['report_name']}",
        "",
        f"`{setup['command']}`",
        "",
        f"Gateway: {setup['gateway']}; voice {setup['voice']}; {setup['rounds']} utterances per socket and "
        f"level; host {setup['host']}; device {setup['device']}. Warm-up: {setup['warmup_sockets']} sockets, then "
        f"as many HTTP clients, one utterance each ({setup.get('warmup_s', '-')} s).",
    ]
    if stack:
        lines.append(
            f"Triton: profile {stack['profile']}, checkpoint {stack['checkpoint']} "
            f"({'written' if stack['checkpoint_written'] else 'reused'} in {stack['checkpoint_s']} s), "
            f"ready in {stack['startup_s']} s, CUDA MPS {'on' if stack['cuda_mps'] else 'off'}"
            + (f", overrides {', '.join(stack['overrides'])}" if stack["overrides"] else "")
            + "."
        )
    lines += [
        "",
        "First audio after the first word, after the first sentence's last word (p50 / p90 ms), stalls a "
        "listener hears (per utterance), RTF (the path's wall time over its audio seconds) and failed "
        "utterances, over the WebSocket (`ws`) and the OpenAI HTTP path fed whole sentences (`http`). "
        "Triton requests: what the server's serving models took during the path's run."
        + (
            " Busiest processes: the CPU cores each process started here (Triton's, a model instance being "
            "`stub:MODEL`, and the gateway's) kept busy over the path's run, its busiest thread's in brackets; "
            "a process near one core in all may be held by Python's interpreter lock (a thread near one core "
            "is busy or spinning in a CUDA synchronisation, which the figure does not tell apart)."
            if with_cpu
            else ""
        ),
        "",
        "| pace ms/word | sockets | path | first text → audio | sentence end → audio | stalls | stalled s "
        "| audio s | RTF | failed | Triton requests |"
        + (" busiest processes, CPU cores (thread) |" if with_cpu else ""),
        "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---|" + ("---|" if with_cpu else ""),
    ]
    for row in report["levels"]:
        if "skipped" in row:
            lines.append(
                f"| {row['pace_ms']} | {row['sockets']} | skipped: {row['skipped']} |||||||||" + "|" * with_cpu
            )
            continue
        for path in ("websocket", "http"):
            figures = row[path]
            served = ", ".join(f"{model} {count}" for model, count in figures.get("triton_requests", {}).items())
            lines.append(
                f"| {row['pace_ms']} | {row['sockets']} | {'ws' if path == 'websocket' else 'http'} "
                f"| {_ms(figures['first_audio_after_first_text_ms'])} "
                f"| {_ms(figures['first_audio_after_sentence_end_ms'])} "
                f"| {figures['stalls_per_utterance']} | {figures['stalled_s_per_utterance']} "
                f"| {figures['audio_s_per_utterance']} | {figures['rtf'] if figures['rtf'] is not None else '-'} "
                f"| {figures['failed']}/{figures['utterances']} | {served or '-'} |"
                + (f" {cores_cell(figures.get('cpu_cores', {}))} |" if with_cpu else "")
            )
    lines += stage_lines(report)
    errors = [
        f"- {row['pace_ms']} ms/word, {row['sockets']} sockets, {path}: {row[path]['first_error']}"
        for row in report["levels"]
        for path in ("websocket", "http")
        if path in row and row[path]["first_error"]
    ]
    if errors:
        lines += ["", "First error of each run with failures:", "", *errors]
    return "\n".join(lines) + "\n"


# The stages of a first chunk inside the server (gpu_stages.py), as the report's columns.
STAGE_COLUMNS: Final = (
    ("prompt", "voice prompt"),
    ("llm_queue", "LLM queue (ws: until its first text)"),
    ("llm_prefill", "LLM to first speech token"),
    ("llm_to_hop", "LLM tokens to first hop"),
    ("t2w_queue", "token2wav queue"),
    ("flow", "flow"),
    ("hift", "HiFT"),
    ("t2w_other", "token2wav rest"),
)


def stage_lines(report: dict[str, Any]) -> list[str]:
    """Where the streams' first chunks spent their time inside the server, per level and path (none without traces)."""
    rows = [
        (row, path) for row in report["levels"] for path in ("websocket", "http") if row.get(path, {}).get("stages")
    ]
    if not rows:
        return []
    lines = [
        "",
        "Where the first chunk of each stream the server started went (p50 / p90 ms, from the models' stage traces): "
        "over the WebSocket a stream is a session, which enters the LLM with its first piece of text and whose "
        "first speech token waits for as much text as it needs; over HTTP a stream is a sentence.",
        "",
        "| pace ms/word | sockets | path | " + " | ".join(label for _, label in STAGE_COLUMNS) + " |",
        "|---:|---:|---|" + "---|" * len(STAGE_COLUMNS),
    ]
    for row, path in rows:
        cells = _stage_cells(row[path]["stages"], STAGE_COLUMNS)
        lines.append(f"| {row['pace_ms']} | {row['sockets']} | {'ws' if path == 'websocket' else 'http'} | {cells} |")
    sessions = [row for row, path in rows if path == "websocket" and "gw_opening" in row[path]["stages"]]
    if sessions:
        lines += [
            "",
            "Over the WebSocket, the rest of a session's way to its first audio (p50 / p90 ms): in the gateway, "
            "which records its sessions beside the models, and the LLM's share above split into the engine's "
            "making of the first hop's tokens, the time it spent out of its row waiting for text meanwhile, and "
            "their way to the orchestrator.",
            "",
            "| pace ms/word | sockets | " + " | ".join(label for _, label in gpu_stages.SESSION_STAGES) + " |",
            "|---:|---:|" + "---|" * len(gpu_stages.SESSION_STAGES),
        ]
        for row in sessions:
            cells = _stage_cells(row["websocket"]["stages"], gpu_stages.SESSION_STAGES)
            lines.append(f"| {row['pace_ms']} | {row['sockets']} | {cells} |")
    return lines


def _stage_cells(stages: dict[str, Any], columns: Sequence[tuple[str, str]]) -> str:
    """A stage table's cells for one row: each column's p50 / p90, ``-`` where the stage was not traced."""
    return " | ".join(_ms(stages.get(name, {"p50": None, "p90": None})) for name, _ in columns)


def write_report(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = report["setup"]["report_name"]
    for name, text in ((f"{stem}.json", json.dumps(report, indent=2) + "\n"), (f"{stem}.md", markdown(report))):
        partial = out / f".{name}.partial"
        partial.write_text(text, encoding="utf-8")
        partial.replace(out / name)


def device() -> str:
    """The GPU's name and memory where ``nvidia-smi`` answers, else the CPU."""
    try:
        return ", ".join(nvidia_smi("gpu=name,memory.total")[0]) + " MiB"
    except (OSError, subprocess.SubprocessError):
        return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


async def measure(
    args: argparse.Namespace,
    url: str,
    report: dict[str, Any],
    served: ServedCounts,
    cpu_roots: dict[str, int],
    deadline: float,
    trace_dir: Path | None = None,
) -> None:
    """Warm-up (``--warmup`` sockets, then HTTP clients, one utterance each; all must succeed), then every
    pace and level, the report written after each."""
    warm_started = time.perf_counter()
    warm = await level(args, url, args.warmup, args.paces[0], served, cpu_roots, rounds=1)
    report["setup"]["warmup_s"] = round(time.perf_counter() - warm_started, 1)
    for path in ("websocket", "http"):
        if warm[path]["failed"]:
            raise RuntimeError(f"the warm-up failed over {path}: {warm[path]['first_error']}")
    previous = 0.0
    for pace in args.paces:
        for sockets in args.levels:
            remaining = deadline - time.perf_counter()
            if previous * 2 > remaining:
                reason = f"~{previous * 2:.0f} s expected, {max(0.0, remaining):.0f} s of budget left"
                report["levels"].append({"sockets": sockets, "pace_ms": round(pace * 1000), "skipped": reason})
            else:
                started = time.perf_counter()
                measured = await level(
                    args, url, sockets, pace, served, cpu_roots, rounds=args.rounds, trace_dir=trace_dir
                )
                report["levels"].append(measured)
                previous = time.perf_counter() - started
            print(json.dumps(report["levels"][-1]), flush=True)
            write_report(args.out, report)


def wait_ready(triton_url: str, timeout_s: float) -> None:
    """Until the Triton at ``triton_url`` says it is ready: one launched in the background is found
    when its models have loaded."""
    deadline = time.monotonic() + timeout_s
    client = grpcclient.InferenceServerClient(triton_url)
    try:
        while True:
            with contextlib.suppress(InferenceServerException):
                if client.is_server_ready():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Triton at {triton_url} was not ready within {timeout_s:.0f} s")
            time.sleep(2.0)
    finally:
        client.close()


def gateway_env(triton_url: str, args: argparse.Namespace) -> dict[str, str]:
    """A gateway on ``triton_url`` that admits every socket and sentence of the largest level at once."""
    return {
        "TTS_TRITON_URL": triton_url,
        "TTS_WORKERS": str(args.gateway_workers),
        # A socket holds one admission slot; an HTTP utterance up to one per sentence.
        "TTS_MAX_CONCURRENT_SPEECH": str(4 * max(args.levels)),
        "TTS_BACKEND_TIMEOUT": str(args.timeout_s),
        "TTS_BACKEND_CHUNK_TIMEOUT": str(args.timeout_s),
        "TTS_REQUEST_TIMEOUT": str(args.timeout_s),
        "TTS_LOG_LEVEL": "info",
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    deadline = started + args.budget_s
    report: dict[str, Any] = {
        "setup": {
            "command": shlex.join(["python", "-m", "benchmarks.text_stream", *sys.argv[1:]]),
            "report_name": args.name,
            "gateway": "",
            "stack": None,
            "voice": args.voice,
            "rounds": args.rounds,
            "warmup_sockets": args.warmup,
            "host": f"{platform.node()} {platform.machine()}",
            "device": device(),
            "utterances": list(UTTERANCES),
        },
        "levels": [],
    }
    setup = report["setup"]
    cpu_roots: dict[str, int] = {}
    trace_dir: Path | None = None
    with contextlib.ExitStack() as stack:
        triton_url = args.triton_url
        if args.profile:
            # The models of a server started here trace each stream's stages (tts_gateway/models/stage_trace.py).
            trace_dir = args.workdir / "stage_trace"
            stage_trace.trace_servers_into(trace_dir)
        if args.gateway_url:
            url = args.gateway_url.rstrip("/")
            setup["gateway"] = url
        else:
            if args.profile:
                server, stack_setup = stack.enter_context(
                    cosyvoice2_triton(
                        args.workdir / "triton", args.profile, args.set, startup_timeout=args.startup_timeout
                    )
                )
                triton_url = server.grpc_url
                if server.pid is not None:
                    cpu_roots["tritonserver"] = server.pid
                setup["stack"] = asdict(stack_setup)
                print(f"Triton ready: {setup['stack']}", flush=True)
            elif triton_url is not None:
                wait_ready(triton_url, args.startup_timeout)
            env = {} if triton_url is None else gateway_env(triton_url, args)
            gateway = GatewayServer(args.workdir / "gateway", env)
            gateway.start(timeout=args.startup_timeout)
            stack.callback(gateway.stop)
            url = gateway.url
            cpu_roots["gateway"] = gateway.pid  # with the embedded default its Triton is one of its children
            setup["gateway"] = (
                "started here (embedded CPU default)"
                if triton_url is None
                else f"started here on Triton {triton_url} ({args.gateway_workers} workers)"
            )
        asyncio.run(measure(args, url, report, ServedCounts(triton_url), cpu_roots, deadline, trace_dir))
    setup["total_s"] = round(time.perf_counter() - started, 1)
    write_report(args.out, report)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("var/bench"), help="where NAME.json/.md go")
    parser.add_argument("--name", default="text-stream", help="file stem of the report")
    parser.add_argument("--levels", default="1,4", help="sockets at once, comma-separated (default: 1,4)")
    parser.add_argument("--paces", default="30,200", help="ms between words, comma-separated (default: 30,200)")
    parser.add_argument("--rounds", type=int, default=3, help="utterances per socket and level (default: 3)")
    parser.add_argument("--voice", help="voice (default: joe, Piper's, on the embedded default; else lumen)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gateway-url", help="use this gateway")
    where.add_argument("--triton-url", help="start a gateway on this Triton (gRPC HOST:PORT)")
    where.add_argument(
        "--profile", help="start a Triton on this CosyVoice2 profile (random checkpoint), then a gateway"
    )
    parser.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE", help="profile overrides")
    parser.add_argument("--gateway-workers", type=int, default=1, help="TTS_WORKERS of a gateway started on a Triton")
    parser.add_argument(
        "--workdir", type=Path, default=Path("var/text_stream"), help="checkpoint, repository, logs (reused)"
    )
    parser.add_argument("--warmup", type=int, default=0, help="sockets of the warm-up (default: the largest level)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="limit of one utterance")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for Triton and the gateway")
    parser.add_argument("--budget-s", type=float, default=540.0, help="skip levels that would end later than this")
    args = parser.parse_args()
    args.levels = [int(value) for value in args.levels.split(",")]
    args.paces = [float(value) / 1000 for value in args.paces.split(",")]
    if min(args.levels) < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("levels and rounds must be positive")
    args.warmup = args.warmup or max(args.levels)
    if args.set and not args.profile:
        parser.error("--set goes with --profile")
    embedded = not (args.gateway_url or args.triton_url or args.profile)
    args.voice = args.voice or ("joe" if embedded else "lumen")
    args.out = args.out.resolve()
    args.workdir = args.workdir.resolve()
    try:
        report = run(args)
    except (RuntimeError, OSError, InferenceServerException) as exc:
        # A Triton started here logs why its models failed; a gateway's log stays in the workdir.
        print_server_errors(args.workdir / "triton" / "tritonserver.log", limit=20)
        print(f"FAIL: {exc} (logs under {args.workdir})", flush=True)
        return 1
    print(markdown(report))
    failed = sum(row[path]["failed"] for row in report["levels"] for path in ("websocket", "http") if path in row)
    print(f"report: {args.out / args.name}.md and .json; {failed} utterances failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
