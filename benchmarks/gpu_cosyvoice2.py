"""CosyVoice2 behind Triton on one GPU (``gpu-torch`` profile) at full model size, random weights.

Writes (or reuses) the full-size random checkpoint (flow and HiFT at CosyVoice2-0.5B's
hyper-parameters, the LLM at Qwen2-0.5B's shape; see
``tts_gateway/models/cosyvoice2/checkpoints/random_checkpoint.py``), renders the profile over it,
starts the embedded tritonserver (its start-up, graph capture included, is reported) and warms it
up. Then, for each concurrency level, it sends the prompts (English and Chinese, two reference
voices; repeated so that every level gets at least twice as many requests as streams) to each
target: ``direct`` over gRPC (one channel, as the gateway does), streamed to ``cosyvoice2_stream``
and offline to ``cosyvoice2``, and ``gateway`` through the real gateway process over HTTP (first
audio byte at the client; one gateway per mode). It reports first-chunk latency (avg/p50/p90), total
latency, RTF (wall time of the level / seconds of audio produced: upstream's definition, a
throughput figure) and GPU memory, next to upstream's L20 figures, and for direct streaming where
each first chunk's time went (queueing, voice prompt, LLM prefill, LLM tokens up to the first hop,
flow, HiFT, transport; ``gpu_stages.py``), in ``NAME.json`` and ``NAME.md`` under ``--out`` (``--name``,
default ``gpu_cosyvoice2``; rewritten after every pass, so an interrupted run keeps what it measured); the
server's and the gateways' logs go to ``WORKDIR/logs``. ``--out docs/benchmarks --name gpu-h200`` updates
the published report in place.

Random weights cost what real ones cost per token; only the output length has to be imposed: the
checkpoint's LLM stops as soon as the profile's ``min_token_text_ratio`` allows, so every request
yields a known number of speech tokens (checked) and the audio seconds are the same in every pass.

    python -m benchmarks.gpu_cosyvoice2 --out docs/benchmarks --name gpu-h200  # GPU: about 4-8 minutes
    python -m benchmarks.gpu_cosyvoice2 --cpu --levels 1,2 --prompts 2  # rehearsal without a GPU

Passes that would overrun ``--budget-s`` (counted from the start) are skipped and reported as such;
run them again with ``--levels``. The checkpoint lives under ``--workdir`` and is reused.
"""

# ruff: noqa: RUF001

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import aiohttp
import grpc
import numpy as np
import torch
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aio_grpcclient
from numpy.typing import NDArray
from transformers import AutoTokenizer
from tritonclient.utils import InferenceServerException

from benchmarks import cosyvoice2_triton, gpu_floors, gpu_sanity, gpu_stages
from benchmarks.bench_stack import GatewayServer, children
from benchmarks.gpu_query import nvidia_smi, used_mib_by_gpu
from benchmarks.gpu_sanity import ROOT, Voice, config_parameters
from benchmarks.server_processes import CpuUse, cores_cell, cpu_seconds
from benchmarks.server_startup import load_timeline
from tts_gateway.gateway.embedded.fleet import EmbeddedFleet, embedded_servers
from tts_gateway.gateway.embedded.gpu_devices import server_gpus
from tts_gateway.gateway.embedded.server import EmbeddedTriton, EmbeddedTritonError
from tts_gateway.models import contract, stage_trace
from tts_gateway.models.cosyvoice2.checkpoints.random_checkpoint import ensure_checkpoint, full_size
from tts_gateway.models.cosyvoice2.model import vocab
from tts_gateway.models.model_repository import load_profiles
from tts_gateway.paths import TRITON_REPOSITORY

MODEL: Final = "cosyvoice2"
PROFILE: Final = "gpu-torch"
# --llm-server: the LLM on `transformers serve` (continuous batching, CUDA graphs) on the same GPU.
SERVER_PROFILE: Final = "gpu-llm-server"
SERVER_PORT: Final = 8100
SAMPLE_RATE: Final = 24_000
SAMPLES_PER_TOKEN: Final = 960
VOICES: Final = ("harbor", "lumen")
MODES: Final = ("stream", "offline")
TARGETS: Final = ("direct", "gateway")
# Short (36 speech tokens: one stream chunk and the final one): warms CUDA and the voice caches.
WARMUP_TEXT: Final = "Warming up the models."
# --cpu rehearses the harness, it measures nothing: every model on the CPU in one instance, the
# flow in float32 (float16 convolutions crawl there) and with 1 Euler step instead of 10 (the
# full-size flow takes about 30 s per call on two cores with 10).
CPU_OVERRIDES: Final = (
    *gpu_sanity.SINGLE_INSTANCES,
    *gpu_sanity.CPU_DEVICES,
    "token2wav.dtype=float32",
    "token2wav.n_timesteps=1",
)

# Sentences of everyday lengths (2 to 7 s of speech), English with a Chinese one in every four or
# five (their full-width punctuation is intended). Request i uses voice i % 2 and seed i.
PROMPTS: Final = (
    "The train to the coast leaves at half past eight, so we should be at the station a little earlier.",
    "今天下午我们去公园散步，看到很多人在湖边钓鱼。",
    "Please remember to water the plants on the balcony while I am away next week.",
    "After three days of heavy rain, the river finally rose above the old stone bridge, and the village "
    "council closed the road.",
    "Thank you for calling. All of our agents are busy at the moment, but your call is important to us.",
    "这家餐厅的菜很好吃，服务也非常周到，我们下次还会再来。",
    "She opened the letter slowly, read the first line twice, and then put it back in the envelope without a word.",
    "Turn left at the next traffic light.",
    "The museum will stay open until nine on Fridays during the summer, and entry is free for children under twelve.",
    "明天早上八点开会，请大家准时参加，并提前准备好自己的报告。",
    "A good cup of coffee in the morning can make even a long day feel a little shorter.",
    "The software update fixes several security problems and improves battery life on older devices.",
    "If you have any questions about your order, you can reply to this message and someone will get back to "
    "you within a day.",
    "火车晚点了半个小时，我们只好在候车室里等着。",
    "Our neighbours are building a small wooden house for the birds in their garden.",
    "He had never seen so many stars, and for a long time he simply lay on the grass and looked up.",
    "The quarterly report shows that sales grew by twelve percent, mostly thanks to strong demand in Asia.",
    "窗外下着小雨，她一边喝茶一边看书，觉得这个周末过得很安静。",
    "Could you send me the slides from this morning's presentation?",
    "The bakery on the corner sells the best bread in town, but it is usually sold out before noon.",
    "When the lights went out, the whole audience fell silent, waiting for the first note of the piano.",
    "Scientists hope the new telescope will help them understand how the first galaxies were formed.",
    "孩子们在操场上踢足球，笑声传得很远。",
    "Don't forget your umbrella; the forecast says it will rain again this afternoon.",
    "The recipe calls for two cups of flour, a pinch of salt, three eggs and a little warm milk.",
    "We walked along the beach until the sun went down and the first lights appeared in the harbour.",
)

# Upstream runtime/triton_trtllm on one L20: real weights, TensorRT-LLM, 26 prompts, ~170 s of audio.
# Streaming with the voice cache on (this benchmark's voices are cached after the warm-up).
L20_REFERENCE: Final = {
    ("stream", 1): (190.0, 0.116),
    ("stream", 2): (323.0, 0.091),
    ("stream", 4): (978.0, 0.073),
    ("offline", 1): (758.0, 0.089),
    ("offline", 2): (1026.0, 0.066),
    ("offline", 4): (1914.0, 0.061),
}
L20_STREAM_NO_CACHE: Final = "streaming without the voice cache: 220 / 477 / 1107 ms, RTF 0.124 / 0.102 / 0.092"


@dataclass(frozen=True)
class Client:
    """One gRPC channel and one HTTP session for every request of a run, the gateways by mode and
    GPUs behind them, and the time limit of one request."""

    grpc: aio_grpcclient.InferenceServerClient
    http: aiohttp.ClientSession
    gateways: dict[tuple[str, int], GatewayServer]
    timeout_s: float
    # The first GPU's tritonserver, whose processes' CPU each pass measures (its pid read at each pass: a
    # supervisor may have restarted it).
    triton: EmbeddedTriton | None = None


@dataclass(frozen=True)
class Job:
    prompt: int
    text: str
    voice: Voice
    expected_tokens: int


@dataclass(frozen=True)
class RequestResult:
    prompt: int
    voice: str
    audio_s: float
    first_chunk_ms: float
    total_ms: float
    chunks: int
    error: str | None = None
    request_id: str = ""
    sent: float = 0.0
    first_at: float = 0.0
    stall_ms: float = 0.0


# Playback waits shorter than this are not counted as a stall (about one packet of real-time audio).
STALL_MS: Final = 10.0


def playback_stall_s(arrivals: list[tuple[float, int]], sample_rate: int) -> float:
    """Seconds a listener who plays a stream from its first chunk on waits for audio not arrived yet.

    ``arrivals`` are each chunk's arrival time (seconds) and samples, in order. A stream can be behind
    real time here and yet finish within its length (the laxer ``behind_real_time``): a second chunk
    late by 0.3 s stalls playback even when the chunks after it come fast.
    """
    stalled = 0.0
    runs_out: float | None = None
    for at, samples in arrivals:
        if runs_out is None:
            runs_out = at
        elif at > runs_out:
            stalled += at - runs_out
            runs_out = at
        runs_out += samples / sample_rate
    return stalled


@dataclass
class PassResult:
    target: str
    mode: str
    concurrency: int
    wall_s: float
    gpu_peak_mib: list[int] | None
    requests: list[RequestResult] = field(default_factory=list)
    gpus: int = 1
    # CPU time of the gateway's processes over the pass / its wall time: how many cores it kept busy.
    gateway_cores: float | None = None
    # The same for each process of the first GPU's Triton server, and its busiest thread (server_processes.py).
    triton_cores: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.requests if r.error is None]
        audio = sum(r.audio_s for r in ok)
        return {
            "target": self.target,
            "mode": self.mode,
            "gpus": self.gpus,
            "concurrency": self.concurrency,
            "requests": len(self.requests),
            "failed": len(self.requests) - len(ok),
            "wall_s": round(self.wall_s, 3),
            "audio_s": round(audio, 3),
            "rtf": round(self.wall_s / audio, 4) if audio else None,
            "first_chunk_ms": _stats([r.first_chunk_ms for r in ok]),
            "latency_ms": _stats([r.total_ms for r in ok]),
            # A stream falls behind its playback when the rest of its audio takes longer than it lasts.
            "behind_real_time": sum(1 for r in ok if (r.total_ms - r.first_chunk_ms) / 1000 > r.audio_s),
            # Stricter: a listener playing from the first chunk on waited for audio (streams only); the
            # most one stream waited, summed over its stalls.
            "stalled": sum(1 for r in ok if r.stall_ms > STALL_MS) if self.mode == "stream" else None,
            "stall_ms_max": max((r.stall_ms for r in ok), default=0.0) if self.mode == "stream" else None,
            # Pieces of audio the client read: the stream's chunks directly, HTTP reads through the gateway.
            "chunks_per_request": round(sum(r.chunks for r in ok) / len(ok), 2) if ok else None,
            # The busiest GPU's; then each GPU's.
            "gpu_peak_mib": max(self.gpu_peak_mib) if self.gpu_peak_mib else None,
            "gpu_peak_mib_each": self.gpu_peak_mib,
            "gateway_cores": self.gateway_cores,
            "triton_cpu_cores": self.triton_cores,
        }


def _stalls(item: dict[str, Any]) -> str:
    """A streaming pass's stalled streams and the most one of them stalled in all (ms); '-' offline or in
    reports from before the figure."""
    if item["mode"] != "stream" or "stalled" not in item:
        return "-"
    return f"{item['stalled']} ({item['stall_ms_max']:.0f})"


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    p50, p90 = np.percentile(values, [50, 90])
    return {"avg": round(float(np.mean(values)), 1), "p50": round(float(p50), 1), "p90": round(float(p90), 1)}


class GpuMemoryPeak:
    """Highest ``memory.used`` of each GPU while the block runs, sampled from nvidia-smi in a thread."""

    def __init__(self, enabled: bool, interval_s: float = 0.5) -> None:
        self._enabled = enabled
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.peak_mib: list[int] | None = None

    def __enter__(self) -> GpuMemoryPeak:
        if self._enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._enabled:
            self._stop.set()
            self._thread.join()

    def _sample(self) -> None:
        while True:
            used = used_mib_by_gpu()
            self.peak_mib = [max(pair) for pair in zip(self.peak_mib or [0] * len(used), used, strict=True)]
            if self._stop.wait(self._interval_s):
                return


def log(message: str) -> None:
    print(message, flush=True)


def request_inputs(job: Job) -> list[grpcclient.InferInput]:
    """gpu_sanity's request in the job's voice and seed (the prompt number), saying the job's text."""
    inputs = gpu_sanity.request_inputs(job.voice, job.prompt)
    text = next(tensor for tensor in inputs if tensor.name() == contract.TARGET_TEXT)
    text.set_data_from_numpy(np.array([job.text.encode()], dtype=np.object_))
    return inputs


async def synthesize(client: Client, target: str, mode: str, job: Job, request_id: str, gpus: int = 1) -> RequestResult:
    """One request; a stream's first-chunk time is taken when its first audio arrives."""
    chunks: list[NDArray[np.float32]] = []
    # When each piece of audio came (time.perf_counter()) and its samples; none for a direct offline call.
    arrivals: list[tuple[float, int]] = []
    error: str | None = None
    sent = time.monotonic()
    started = time.perf_counter()
    try:
        if target == "gateway":
            async for chunk in _gateway_audio(client, client.gateways[mode, gpus].url, job, request_id):
                chunks.append(chunk)
                arrivals.append((time.perf_counter(), chunk.size))
        elif mode == "offline":
            result = await client.grpc.infer(
                MODEL, request_inputs(job), request_id=request_id, client_timeout=client.timeout_s
            )
            chunks.append(result.as_numpy(contract.WAVEFORM))
        else:
            request = {
                "model_name": contract.stream_model_name(MODEL),
                "inputs": request_inputs(job),
                "request_id": request_id,
            }

            async def one_request() -> AsyncIterator[dict[str, Any]]:
                yield request

            async for result, failure in client.grpc.stream_infer(one_request(), stream_timeout=client.timeout_s):
                if failure is not None:
                    raise failure
                chunk = result.as_numpy(contract.WAVEFORM)
                if chunk is not None and chunk.size:
                    chunks.append(chunk)
                    arrivals.append((time.perf_counter(), chunk.size))
    except (InferenceServerException, grpc.RpcError, aiohttp.ClientError, TimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    total = time.perf_counter() - started
    first = arrivals[0][0] - started if arrivals else 0.0
    audio = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    # The gateway's pcm carries whole samples but not the model's token grid: check it is speech-long.
    error = error or audio_problem(audio, None if target == "gateway" else job.expected_tokens)
    return RequestResult(
        prompt=job.prompt,
        voice=job.voice.name,
        audio_s=audio.size / SAMPLE_RATE,
        first_chunk_ms=round(1000 * (first or total), 1),
        total_ms=round(1000 * total, 1),
        chunks=len(chunks),
        error=error,
        # The gateway sends a request's first sentence to Triton as "<x-request-id>-0".
        request_id=f"{request_id}-0" if target == "gateway" else request_id,
        sent=sent,
        first_at=sent + (first or total),
        stall_ms=round(1000 * playback_stall_s(arrivals, SAMPLE_RATE), 1),
    )


async def _gateway_audio(client: Client, gateway: str, job: Job, request_id: str) -> AsyncIterator[NDArray[np.float32]]:
    """The request through the gateway at ``gateway``: OpenAI's speech API, 24 kHz pcm, read as it arrives."""
    body = {"model": "tts-1", "voice": job.voice.name, "input": job.text, "response_format": "pcm", "seed": job.prompt}
    timeout = aiohttp.ClientTimeout(total=client.timeout_s)
    url = f"{gateway}/v1/audio/speech"
    async with client.http.post(url, json=body, timeout=timeout, headers={"x-request-id": request_id}) as response:
        if response.status != 200:
            raise aiohttp.ClientResponseError(
                response.request_info, (), status=response.status, message=(await response.text())[:200]
            )
        pending = b""
        async for data in response.content.iter_any():
            pending += data
            whole = len(pending) // 2 * 2
            if whole:
                yield np.frombuffer(pending[:whole], dtype="<i2").astype(np.float32) / 32768.0
                pending = pending[whole:]


def audio_problem(audio: NDArray[np.float32], expected_tokens: int | None) -> str | None:
    """Why ``audio`` is not the expected speech (float32, finite, not constant, whole expected tokens)."""
    if audio.size == 0:
        return "no audio"
    if expected_tokens is not None and audio.size != expected_tokens * SAMPLES_PER_TOKEN:
        return f"{audio.size} samples, expected {expected_tokens} tokens of {SAMPLES_PER_TOKEN}"
    if not np.isfinite(audio).all():
        return "waveform holds NaN or inf"
    if float(np.std(audio)) == 0.0:
        return "waveform is constant"
    return None


async def run_pass(
    client: Client,
    target: str,
    mode: str,
    concurrency: int,
    jobs: list[Job],
    *,
    gpu: bool,
    label: str = "pass",
    gpus: int = 1,
) -> PassResult:
    """Send every job with ``concurrency`` requests in flight; each worker takes the next job when done.
    Through the gateway, the one in front of ``gpus`` GPUs."""
    pending = iter(jobs)
    results: list[RequestResult] = []
    name = f"{target} {mode} c={concurrency}" + (f" on {gpus} GPUs" if gpus > 1 else "")
    tag = f"{label}-{target}{gpus}-{mode}-{concurrency}"
    gateway = client.gateways.get((mode, gpus)) if target == "gateway" else None

    async def worker() -> None:
        for job in pending:
            result = await synthesize(client, target, mode, job, f"{tag}-{job.prompt}", gpus)
            results.append(result)
            state = f"FAILED {result.error}" if result.error else f"first {result.first_chunk_ms:.0f} ms"
            log(
                f"  [{name}] {len(results)}/{len(jobs)} p{job.prompt:02d} {job.voice.name} "
                f"{result.audio_s:.1f} s audio, total {result.total_ms / 1000:.2f} s, {state}"
            )

    cpu_before = process_tree_cpu_s(gateway.pid) if gateway is not None else 0.0
    triton_pid = client.triton.pid if client.triton is not None else None
    triton_cpu = CpuUse({"tritonserver": triton_pid}) if triton_pid is not None else None
    if triton_cpu is not None:
        triton_cpu.start()
    with GpuMemoryPeak(gpu) as peak:
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    cores = None if gateway is None else round((process_tree_cpu_s(gateway.pid) - cpu_before) / wall, 2)
    results.sort(key=lambda r: r.prompt)
    triton_cores = triton_cpu.cores() if triton_cpu is not None else {}
    return PassResult(target, mode, concurrency, wall, peak.peak_mib, results, gpus, cores, triton_cores)


def process_tree_cpu_s(root: int) -> float:
    """User plus system CPU seconds used so far by ``root`` and its live descendants (a gateway's workers)."""
    seconds, pending = 0.0, [root]
    while pending:
        pid = pending.pop()
        try:
            seconds += cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
            pending += children(pid)
        except OSError:  # ended since it was listed
            continue
    return seconds


def make_jobs(texts: list[str], voices: list[Voice], tokenizer: Any, params: dict[str, str]) -> list[Job]:
    """Jobs with the speech tokens the pipeline must produce: the minimum its length bounds allow."""
    jobs = []
    for index, text in enumerate(texts):
        bounds = vocab.length_bounds(
            max(1, len(vocab.text_token_ids(tokenizer, text))),
            min_token_text_ratio=float(params["min_token_text_ratio"]),
            max_token_text_ratio=float(params["max_token_text_ratio"]),
            max_new_tokens_cap=int(params["max_output_tokens"]),
        )
        jobs.append(Job(index, text, voices[index % len(voices)], bounds.min_new_tokens))
    return jobs


def _first_hop_cell(hops: dict[str, float]) -> str:
    if not hops:
        return "-"
    return f"{hops['mean']:g} ({hops['min']:g}-{hops['max']:g})"


def _llm_sentence(setup: dict[str, Any]) -> str:
    if setup["profile"] == SERVER_PROFILE:
        return (
            f"LLM: {setup['llm']}, a process of its own on the same GPU, which the orchestrator streams tokens "
            "from over the OpenAI completions API (the stand-in for vLLM, SGLang or trtllm-serve)"
        )
    return (
        f"LLM: {setup['llm']} (the PyTorch engine batches every request over a static KV cache with decode "
        "steps replayed as CUDA graphs)"
    )


def markdown(report: dict[str, Any]) -> str:
    setup = report["setup"]
    lines = [
        f"## CosyVoice2 behind Triton, profile `{setup['profile']}` (LLM: {setup['llm']}), {setup['device']}",
        "",
        "**Random weights at full size** (flow and HiFT at CosyVoice2-0.5B's hyper-parameters, the LLM at "
        f"Qwen2-0.5B's shape, bf16); {_llm_sentence(setup)}; token2wav batching concurrent calls, the "
        "flow solve replayed as CUDA graphs; not TensorRT-LLM. The L20 columns are upstream's figures "
        "(runtime/triton_trtllm: real weights, TensorRT-LLM, 26 prompts, ~170 s of audio) on a **different "
        "GPU**: a point of reference, not a like-for-like comparison.",
        "",
        f"{setup['prompts']} prompts ({setup['english']} English, {setup['chinese']} Chinese), voices "
        f"{', '.join(setup['voices'])}, each level sending at least twice as many requests as streams (prompts "
        f"repeated with new seeds); per request {setup['audio_s_min']:.1f} / {setup['audio_s_avg']:.1f} / "
        f"{setup['audio_s_max']:.1f} s of audio min / avg / max: the random LLM stops at the profile's minimum "
        f"length, {setup['min_token_text_ratio']:g} speech tokens per text token of the stand-in tokenizer. "
        "RTF = wall time of the pass / seconds of audio (upstream's definition). `direct` is gRPC straight to "
        "Triton, first chunk = first audio; `gateway` is the gateway process over HTTP (OpenAI's speech API, "
        "pcm), first chunk = first audio byte at the client. Offline latency is the whole response. A stream "
        "is behind real time when the audio after its first chunk took longer to arrive than it lasts; it "
        f"stalled when a listener playing it from its first chunk on waited more than {STALL_MS:g} ms in all for "
        "audio (in brackets the most one stream of the pass waited in all). Voice prompts are cached after the "
        "warm-up.",
        "",
        "| target | mode | GPUs | streams | requests | first audio ms avg / p50 / p90 | latency ms avg / p50 / p90 | "
        "RTF | streams behind real time | streams stalled (most ms) | L20 first chunk / latency avg ms | L20 RTF | "
        "GPU memory peak MiB | gateway CPU cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for item in report["passes"]:
        key = (item["mode"], item["concurrency"])
        reference = L20_REFERENCE.get(key)
        if item.get("skipped"):
            lines.append(
                f"| {item['target']} | {item['mode']} | {item.get('gpus', 1)} | {item['concurrency']} | "
                f"skipped: {item['skipped']} | | | | | | | | | |"
            )
            continue
        first = _triple(item["first_chunk_ms"]) if item["mode"] == "stream" else "-"
        rtf = "-" if item["rtf"] is None else f"{item['rtf']:.3f}"
        failed = f" ({item['failed']} failed)" if item["failed"] else ""
        peaks = " / ".join(str(mib) for mib in item.get("gpu_peak_mib_each") or [item["gpu_peak_mib"] or "-"])
        lines.append(
            f"| {item['target']} | {item['mode']}{failed} | {item.get('gpus', 1)} | {item['concurrency']} | "
            f"{item['requests']} | {first} | {_triple(item['latency_ms'])} | {rtf} | "
            f"{item['behind_real_time'] if item['mode'] == 'stream' else '-'} | {_stalls(item)} | "
            f"{'-' if reference is None else f'{reference[0]:.0f}'} | "
            f"{'-' if reference is None else f'{reference[1]:.3f}'} | {peaks} | "
            f"{item.get('gateway_cores') if item.get('gateway_cores') is not None else '-'} |"
        )
    lines += scale_out(report)
    staged = [item for item in report["passes"] if item.get("stages")]
    if staged:
        lines += [
            "",
            "### Where the first chunk's time goes (streaming; p50 ms, p90 in brackets)",
            "",
            "Through the gateway, its own share falls in the first row (HTTP request to Triton request) and "
            "the last (Triton's first chunk to the HTTP client's first audio).",
            "",
            "| stage | " + " | ".join(f"{item['target']}, {item['concurrency']} streams" for item in staged) + " |",
            "|---|" + "---|" * len(staged),
        ]
        for name, meaning in (*gpu_stages.STAGES, *gpu_stages.ENGINE_RATES):
            cells = []
            for item in staged:
                value = item["stages"].get(name)
                cells.append("-" if value is None else f"{value['p50']:.0f} ({value['p90']:.0f})")
            lines.append(f"| {meaning} | " + " | ".join(cells) + " |")
        batches = " / ".join(
            f"{item['token2wav_batch'].get('mean', '-')} (max {item['token2wav_batch'].get('max', '-')})"
            for item in staged
        )
        chunks = " / ".join(str(item["token2wav_batch"].get("calls_per_stream", "-")) for item in staged)
        hops = " / ".join(_first_hop_cell(item.get("first_hop_tokens") or {}) for item in staged)
        lines += [
            "",
            f"token2wav calls converted together (one group), mean (max) over the pass's calls: {batches}.",
            "",
            "Chunks per Triton stream (token2wav calls; through the gateway the first sentence's), mean (fewer where "
            f"later chunks caught up with arrived tokens): {chunks}.",
            "",
            "Tokens of a stream's first chunk, mean (min-max; it grows while streams wait long for their second): "
            f"{hops}.",
        ]
        lines += floor_lines(report, staged)
    lines += cpu_lines(report)
    lines += [
        "",
        f"L20 {L20_STREAM_NO_CACHE}. Requests served at once: offline {setup['offline_slots']} (instances), "
        f"streaming {setup['stream_slots']} (instances x stream_workers), LLM {setup['llm_slots']} "
        "(KV-cache slots of the batching engine); token2wav converts up to its max_batch_size calls at once.",
    ]
    memory = report.get("cuda_memory_by_process_mib")
    if memory:
        lines.append(f"CUDA memory by process at the end (MiB): {memory}.")
    if setup["profile"] == SERVER_PROFILE:
        lines.append(
            "The LLM server is the process that is not a stub: transformers' paged cache takes most of the free GPU "
            "memory by default. `max_token_text_ratio=2.0`: that server loads the LLM as a plain Qwen2 without the "
            "head's bias through which the random checkpoint stops, so the longest output is set to the shortest, "
            "as long as in the in-Triton runs."
        )
    lines.append(
        f"Setup: instances {setup['instances']}; torch {setup['torch']} (CUDA {setup['torch_cuda']}); checkpoint "
        f"{setup['checkpoint_s']:.0f} s, tritonserver start (load and CUDA-graph capture) {setup['startup_s']:.0f} s, "
        f"warm-up {setup['warmup_s']:.0f} s; CUDA MPS {'on' if setup.get('cuda_mps') else 'off'}; gateway processes "
        f"{setup.get('gateway_workers', 1)}; overrides: "
        f"{', '.join(setup['overrides']) or 'none'}."
    )
    if setup.get("load_timeline"):
        lines += ["", "The server's start, from its log (seconds after its first line):", ""]
        lines += [f"- {event}" for event in setup["load_timeline"]]
    if setup.get("command"):
        lines += ["", f"Command: `{setup['command']}`."]
    return "\n".join(lines) + "\n"


def cpu_lines(report: dict[str, Any]) -> list[str]:
    """The Triton processes that kept the most CPU busy in each pass (none in reports from before the figure)."""
    measured = [item for item in report["passes"] if item.get("triton_cpu_cores")]
    if not measured:
        return []
    return [
        "",
        "### The Triton server's busiest processes (CPU cores over the pass, its busiest thread's in brackets)",
        "",
        "A model instance is `stub:MODEL`. A process near one core in all may be held by Python's interpreter "
        "lock; a thread near one core is busy or spinning in a CUDA synchronisation (CUDA's default), which "
        "this figure does not tell apart (the LLM engine's 'host waiting for a launched step' does for its own).",
        "",
        *(
            f"- {item['target']} {item['mode']}, {item['concurrency']} streams: {cores_cell(item['triton_cpu_cores'])}"
            for item in measured
        ),
    ]


def floor_lines(report: dict[str, Any], staged: list[dict[str, Any]]) -> list[str]:
    """The stages against their floors on this device (:mod:`benchmarks.gpu_floors`), p50 ms."""
    floored = [item for item in staged if item.get("floors")]
    if not floored:
        return []
    lines = [
        "",
        "### Distance from the floor (p50 ms: measured / floor, and how many times the floor)",
        "",
        "| stage | " + " | ".join(f"{item['target']}, {item['concurrency']} streams" for item in floored) + " |",
        "|---|" + "---|" * len(floored),
    ]
    for stage, floor, meaning in gpu_floors.FLOORS:
        cells = []
        for item in floored:
            measured, least = item["stages"].get(stage), item["floors"].get(floor)
            if measured is None or least is None or least["p50"] <= 0:
                cells.append("-")
                continue
            cells.append(f"{measured['p50']:.1f} / {least['p50']:.2f} ({measured['p50'] / least['p50']:.0f}x)")
        lines.append(f"| {meaning} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Floors: {report['setup'].get('floors')}. The flow's floor counts the estimator over its group's rows and "
        "frames (voice prompt included) at every solver step, not the encoder; a decode step's counts the pass's "
        "streams per GPU as rows (up to the LLM's slots), each at its request's prompt plus half its speech tokens.",
    ]
    return lines


def scale_out(report: dict[str, Any]) -> list[str]:
    """Markdown: each gateway pass on one GPU against the pass on all GPUs at as many times the streams."""
    gpus = report["setup"].get("gpus", 1)
    done = [item for item in report["passes"] if item["target"] == "gateway" and not item.get("skipped")]
    one = {(item["mode"], item["concurrency"]): item for item in done if item.get("gpus", 1) == 1}
    pairs = [
        (one[item["mode"], item["concurrency"] // gpus], item)
        for item in done
        if gpus > 1 and item.get("gpus") == gpus and (item["mode"], item["concurrency"] // gpus) in one
    ]
    if not pairs:
        return []
    lines = [
        "",
        f"### Scale-out: {gpus} GPUs against one, through one gateway",
        "",
        f"One tritonserver per GPU, as the embedded default starts them; the gateway's pool spreads requests over "
        f"them. Each row compares one GPU at N streams with {gpus} GPUs at {gpus} x N. Throughput = seconds of "
        "audio per second of wall time (1 / RTF).",
        "",
        f"| mode | streams per GPU | first audio p50 ms, 1 GPU | first audio p50 ms, {gpus} GPUs | change | "
        f"throughput, 1 GPU | throughput, {gpus} GPUs | ratio | failed | gateway CPU cores, 1 / {gpus} GPUs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for single, several in pairs:
        p50 = [
            (item["first_chunk_ms"] or item["latency_ms"] or {}).get("p50")
            if item["mode"] == "stream"
            else (item["latency_ms"] or {}).get("p50")
            for item in (single, several)
        ]
        change = f"{100 * (p50[1] / p50[0] - 1):+.0f} %" if p50[0] and p50[1] else "-"
        rates = [1 / item["rtf"] if item["rtf"] else 0.0 for item in (single, several)]
        ratio = f"{rates[1] / rates[0]:.2f}x" if rates[0] else "-"
        lines.append(
            f"| {single['mode']} | {single['concurrency']} | {_ms(p50[0])} | {_ms(p50[1])} | {change} | "
            f"{rates[0]:.1f} | {rates[1]:.1f} | {ratio} | {single['failed'] + several['failed']} | "
            f"{single.get('gateway_cores')} / {several.get('gateway_cores')} |"
        )
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _triple(stats: dict[str, float] | None) -> str:
    return "-" if stats is None else f"{stats['avg']:.0f} / {stats['p50']:.0f} / {stats['p90']:.0f}"


def write_report(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = report["setup"]["report_name"]
    for name, text in (
        (f"{stem}.json", json.dumps(report, indent=2, ensure_ascii=False) + "\n"),
        (f"{stem}.md", markdown(report)),
    ):
        partial = out / f".{name}.partial"
        partial.write_text(text, encoding="utf-8")
        partial.replace(out / name)


def render(workdir: Path, profile: str, cpu: bool, extra: list[str]) -> Path:
    # The server profile has no `llm` model in Triton.
    cpu_sets = [item for item in CPU_OVERRIDES if profile == PROFILE or not item.startswith("llm.")]
    return cosyvoice2_triton.render(workdir, profile, [*(cpu_sets if cpu else ()), *extra])


def instance_counts(repository: Path) -> dict[str, int]:
    """Instances of each model of a rendered repository (one ``count:`` per config)."""
    counts = {}
    for config in sorted(repository.glob("*/config.pbtxt")):
        text = config.read_text(encoding="utf-8")
        counts[config.parent.name] = int(text.split("count:", 1)[1].split(",", 1)[0])
    return counts


def level_jobs(jobs: list[Job], level: int) -> list[Job]:
    """At least ``2 * level`` requests: the prompts again with new seeds (the prompt number is the seed)."""
    return [replace(jobs[i % len(jobs)], prompt=i) for i in range(max(len(jobs), 2 * level))]


async def measure(
    url: str,
    report: dict[str, Any],
    jobs: list[Job],
    warmup: list[Job],
    levels: list[int],
    *,
    targets: list[str],
    modes: list[str],
    gateways: dict[tuple[str, int], GatewayServer],
    gpu: bool,
    deadline: float,
    timeout_s: float,
    out: Path,
    trace_dir: Path,
    triton: EmbeddedTriton | None,
) -> bool:
    """Warm up, then run every level for each target in both modes; returns whether every request succeeded."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        client = Client(aio_grpcclient.InferenceServerClient(url), http, gateways, timeout_s, triton)
        try:
            gpu_counts = sorted({gpus for _, gpus in gateways} | {1})
            return await _measure(
                client, report, jobs, warmup, levels, targets, modes, gpu_counts, gpu, deadline, out, trace_dir
            )
        finally:
            await client.grpc.close()


async def _measure(
    client: Client,
    report: dict[str, Any],
    jobs: list[Job],
    warmup: list[Job],
    levels: list[int],
    targets: list[str],
    modes: list[str],
    gpu_counts: list[int],
    gpu: bool,
    deadline: float,
    out: Path,
    trace_dir: Path,
) -> bool:
    """Each level runs on one GPU and, where the gateway fronts several, on all of them at as many times
    the streams (``level`` streams per GPU)."""
    runs = [
        (target, mode, gpus)
        for target in targets
        for mode in modes
        for gpus in (gpu_counts if target == "gateway" else [1])
    ]
    all_ok = True
    warm = time.perf_counter()
    per_gpu = len(warmup) // max(gpu_counts)
    for target, mode, gpus in runs:
        batch = warmup[: per_gpu * gpus]
        log(f"warm-up: {len(batch)} {target} {mode} requests on {gpus} GPU(s), {max(levels) * gpus} at a time")
        result = await run_pass(client, target, mode, max(levels) * gpus, batch, gpu=False, label="warm-up", gpus=gpus)
        failed = [r.error for r in result.requests if r.error]
        if failed:
            raise RuntimeError(f"{len(failed)} warm-up requests failed, e.g. {failed[0]}")
    report["setup"]["warmup_s"] = round(time.perf_counter() - warm, 1)
    last_wall: dict[tuple[str, str, int], float] = {}
    for index, per_gpu_level in enumerate(levels):
        for target, mode, gpus in runs:
            level = per_gpu_level * gpus
            remaining = deadline - time.perf_counter()
            previous = last_wall.get((target, mode, gpus))
            if previous is not None and previous * 2 > remaining:
                reason = f"~{previous * 2:.0f} s expected, {max(0.0, remaining):.0f} s of budget left"
                log(f"{target} {mode} c={level}: skipped ({reason})")
                report["passes"].append(
                    {"target": target, "mode": mode, "gpus": gpus, "concurrency": level, "skipped": reason}
                )
                continue
            batch = level_jobs(jobs, level)
            log(f"{target} {mode} c={level} on {gpus} GPU(s): {len(batch)} requests")
            # A level given twice gets new request ids: its stage traces must not match the first pass's.
            result = await run_pass(client, target, mode, level, batch, gpu=gpu, label=f"pass{index}", gpus=gpus)
            summary = result.summary()
            if mode == "stream":
                sent = {r.request_id: (r.sent, r.first_at) for r in result.requests if r.error is None}
                summary["stages"] = gpu_stages.first_chunk_stages(trace_dir, sent)
                summary["token2wav_batch"] = gpu_stages.token2wav_batches(trace_dir, sent)
                summary["first_hop_tokens"] = gpu_stages.first_hops(trace_dir, sent)
            all_ok = all_ok and summary["failed"] == 0
            last_wall[target, mode, gpus] = result.wall_s
            report["passes"].append(summary | {"per_request": [asdict(r) for r in result.requests]})
            write_report(out, report)
            first = summary["first_chunk_ms"]
            log(
                f"{target} {mode} c={level}: wall {result.wall_s:.1f} s for {summary['audio_s']:.1f} s audio, "
                f"RTF {summary['rtf']}, first chunk p50 {first['p50'] if first else '-'} ms, "
                f"GPU peak {summary['gpu_peak_mib']} MiB, {summary['failed']} failed"
            )
    return all_ok


def run(args: argparse.Namespace) -> bool:
    started = time.perf_counter()
    deadline = started + args.budget_s
    workdir: Path = args.workdir.resolve()
    gpu = not args.cpu
    log(f"full-size random checkpoint under {workdir / 'models'} (about 2 GB, written once)")
    checkpoint, written = ensure_checkpoint(workdir / "models", full_size())
    checkpoint_s = time.perf_counter() - started
    log(f"  {'written' if written else 'reused'} in {checkpoint_s:.1f} s")
    profile = SERVER_PROFILE if args.llm_server else PROFILE
    server_sets = llm_server_overrides() if args.llm_server else []
    repository = render(workdir, profile, args.cpu, [*server_sets, *args.set])
    llm_server = LLMServer(checkpoint.llm_dir, workdir / "llm_server.log", cpu=args.cpu) if args.llm_server else None
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.llm_dir)
    voices = [gpu_sanity.load_voice(name) for name in VOICES]
    texts = list(PROMPTS[: args.prompts])

    device = "CPU rehearsal"
    if gpu:
        device = ", ".join(nvidia_smi("gpu=name,driver_version,memory.total")[0]) + " MiB"
        if args.gpus > 1:
            device = f"{args.gpus} x {device}"
    idle_mib = gpu_sanity.gpu_memory_used() if gpu else None
    trace_dir = workdir / "stage_trace"
    stage_trace.trace_servers_into(trace_dir)
    asks = load_profiles(TRITON_REPOSITORY)[profile].cuda_mps and not args.cpu
    # The servers as the gateway's embedded default starts them: one per GPU, each under its own MPS daemon.
    gpus = server_gpus("auto", profile_uses_gpu=gpu)[: args.gpus]
    if len(gpus) < args.gpus:
        raise RuntimeError(f"--gpus {args.gpus} asks for more GPUs than this process may use ({len(gpus)})")
    servers = embedded_servers(
        repository,
        workdir,
        gpus,
        cuda_mps=args.cuda_mps,
        profile_asks_mps=asks,
        startup_timeout=args.startup_timeout,
    )
    triton = servers[0]
    restarts: list[float] = []
    loading = time.perf_counter()
    if llm_server is not None:
        llm_server.start()
    fleet = EmbeddedFleet.start(servers, on_restart=lambda: restarts.append(time.perf_counter() - started))
    gateways: dict[tuple[str, int], GatewayServer] = {}
    ok = False
    try:
        startup_s = time.perf_counter() - loading
        instances = instance_counts(repository)
        log(f"{len(servers)} tritonserver(s) ready in {startup_s:.1f} s (instances {instances}; log {triton.log_path})")
        params, llm_params = model_parameters(triton.grpc_url)
        token2wav = config_parameters(triton.grpc_url, params["token2wav_model"])
        stream_model = contract.stream_model_name(MODEL)
        # The streaming model's own workers: a profile or --set may give it more than the offline model.
        stream_workers = int(config_parameters(triton.grpc_url, stream_model)["stream_workers"])
        n_timesteps = int(token2wav.get("n_timesteps") or 10)
        # The floors are of first chunks' groups, which a profile may solve in fewer steps.
        first_chunk_timesteps = int(token2wav.get("first_chunk_timesteps") or 0) or n_timesteps
        jobs = make_jobs(texts, voices, tokenizer, params)
        audio = [job.expected_tokens / 25 for job in jobs]
        report: dict[str, Any] = {
            "setup": {
                "command": shlex.join(["python", "-m", "benchmarks.gpu_cosyvoice2", *sys.argv[1:]]),
                "report_name": args.name,
                "profile": profile,
                "llm": "transformers serve (continuous batching, CUDA graphs)"
                if args.llm_server
                else "llm_torch in Triton",
                "device": device,
                "gpu_idle_mib": idle_mib,
                "torch": torch.__version__,
                "torch_cuda": torch.version.cuda,
                "instances": instances,
                "offline_slots": instances[MODEL],
                "stream_slots": instances[stream_model] * stream_workers,
                "llm_slots": instances[params["llm_model"]] * int(llm_params["max_slots"]) if llm_params else "-",
                "overrides": [*(CPU_OVERRIDES if args.cpu else ()), *server_sets, *args.set],
                "prompts": len(jobs),
                "english": sum(text.isascii() for text in texts),
                "chinese": sum(not text.isascii() for text in texts),
                "voices": list(VOICES),
                "min_token_text_ratio": float(params["min_token_text_ratio"]),
                "audio_s_per_pass": round(sum(audio), 2),
                "audio_s_min": min(audio),
                "audio_s_avg": round(sum(audio) / len(audio), 2),
                "audio_s_max": max(audio),
                "cuda_mps": triton.cuda_mps is not None and triton.cuda_mps.running,
                "gpus": args.gpus,
                "gateway_workers": args.gateway_workers,
                "checkpoint_s": round(checkpoint_s, 1),
                "startup_s": round(startup_s, 1),
                "load_timeline": load_timeline(Path(triton.log_path).read_text(encoding="utf-8", errors="replace")),
                "warmup_s": 0.0,
                "n_timesteps": n_timesteps,
                "first_chunk_timesteps": first_chunk_timesteps,
            },
            "passes": [],
        }
        log(f"{len(jobs)} prompts, {sum(audio):.1f} s of audio per pass; levels {args.levels}")
        warmup_per_gpu = args.warmup or 2 * max(args.levels)
        warmup = make_jobs([WARMUP_TEXT] * warmup_per_gpu * args.gpus, voices, tokenizer, params)
        if "gateway" in args.targets:
            for mode in args.modes:
                for gpus in sorted({1, args.gpus}):
                    suffix = f"-{gpus}gpu" if args.gpus > 1 else ""
                    gateway = GatewayServer(
                        workdir / f"gateway-{mode}{suffix}",
                        gateway_env(
                            ",".join(fleet.grpc_urls[:gpus]),
                            mode,
                            [level * gpus for level in args.levels],
                            args.timeout_s,
                            args.gateway_workers,
                        ),
                    )
                    gateway.start()
                    gateways[mode, gpus] = gateway
        ok = asyncio.run(
            measure(
                triton.grpc_url,
                report,
                jobs,
                warmup,
                args.levels,
                targets=args.targets,
                modes=args.modes,
                gateways=gateways,
                gpu=gpu,
                deadline=deadline,
                timeout_s=args.timeout_s,
                out=args.out,
                trace_dir=trace_dir,
                triton=triton,
            )
        )
        if gpu:
            report["cuda_memory_by_process_mib"] = gpu_sanity.cuda_memory_by_model(repository, triton.pid)
        for url in fleet.grpc_urls:
            for line in gpu_sanity.execution_stats(url):
                log(f"  {url} {line}")
        report["server_restarts_at_s"] = [round(at, 1) for at in restarts]
        if restarts:
            log(f"FAIL: a tritonserver was restarted during the run (at {restarts} s)")
            ok = False
        write_report(args.out, report)
    finally:
        if not ok:
            # Where every model's threads are: a hung stage shows in the server's log.
            gpu_sanity.dump_stub_stacks(repository)
        for gateway in gateways.values():
            gateway.stop()
        fleet.stop()
        if llm_server is not None:
            llm_server.stop()
        logs = workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for server in servers:
            name = "tritonserver.log" if server is triton else f"tritonserver-{server.workdir.name}.log"
            shutil.copyfile(server.log_path, logs / name)
        # Kept after the run: a request that failed through the gateway may be explained there.
        for gateway in gateways.values():
            if gateway.log_path.exists():
                shutil.copyfile(gateway.log_path, logs / f"{gateway.workdir.name}.log")
    if not ok:
        gpu_sanity.print_server_errors(triton.log_path)
    if gpu:
        # Measured once the servers are gone: the GPU is idle, and this process's own CUDA context stays out
        # of the passes.
        try:
            size = full_size()
            estimator = size.model.flow.decoder.estimator
            steps = report["setup"]["first_chunk_timesteps"]
            floors = gpu_floors.measure(torch.device("cuda"), estimator, size.llm, steps)
            slots = report["setup"]["llm_slots"]
            report["setup"]["floors"] = floors.describe()
            add_floors(report, trace_dir, floors, slots if isinstance(slots, int) else None)
            write_report(args.out, report)
        except Exception as exc:  # the report stands without them
            log(f"floors not measured: {exc!r}")
    log(markdown(report))
    elapsed = time.perf_counter() - started
    log(f"report: {args.out / args.name}.md and .json, logs in {workdir / 'logs'}; {elapsed:.0f} s in all")
    return ok


def gateway_env(triton_url: str, mode: str, levels: list[int], timeout_s: float, workers: int) -> dict[str, str]:
    """A gateway of ``workers`` processes on the benchmark's Triton: every stream admitted, in ``mode``; a
    prompt is split at sentence ends only (one of the 16 is two sentences), which overlap as by default (the
    second starts once the first has audio)."""
    return {
        "TTS_WORKERS": str(workers),
        "TTS_BACKEND_TIMEOUT": str(timeout_s),
        "TTS_BACKEND_CHUNK_TIMEOUT": str(timeout_s),
        "TTS_REQUEST_TIMEOUT": str(timeout_s),
        "TTS_TRITON_URL": triton_url,
        "TTS_BACKEND_MODE": mode,
        "TTS_MAX_CONCURRENT_SPEECH": str(2 * max(levels)),
        "TTS_SENTENCE_MAX_CHARS": "400",
        "TTS_FIRST_SENTENCE_MAX_CHARS": "400",
        # Its log comes back beside the report: at info it tells of workers uvicorn restarted, and of each request.
        "TTS_LOG_LEVEL": "info",
    }


def model_parameters(url: str) -> tuple[dict[str, str], dict[str, str]]:
    """Config parameters of the offline orchestrator (its length bounds say how long each request is) and the LLM."""
    orchestrator = config_parameters(url, MODEL)
    # An LLM on its own server (llm_urls) has no model in Triton.
    return orchestrator, config_parameters(url, orchestrator["llm_model"]) if orchestrator["llm_model"] else {}


def add_floors(report: dict[str, Any], trace_dir: Path, floors: gpu_floors.Floors, llm_slots: int | None) -> None:
    """Each streamed pass's floors (:mod:`benchmarks.gpu_floors`), its decode steps taken at its streams per GPU."""
    for item in report["passes"]:
        if item.get("mode") != "stream" or not item.get("per_request"):
            continue
        sent = {r["request_id"]: (r["sent"], r["first_at"]) for r in item["per_request"] if r["error"] is None}
        rows = item["concurrency"] // item.get("gpus", 1)
        item["floors"] = gpu_floors.stage_floors(trace_dir, sent, floors, min(rows, llm_slots or rows))


def llm_server_overrides() -> list[str]:
    """Point both orchestrators at the local ``transformers serve``.

    That server loads the checkpoint as a plain Qwen2 and drops the LLM head's bias, through which
    the random checkpoint stops at the minimum length; the maximum ratio set to the minimum keeps
    every request as long as in the in-Triton runs.
    """
    values = {
        "llm_urls": f"http://127.0.0.1:{SERVER_PORT}/v1",
        "llm_api": "transformers",
        "llm_served_model": "",
        "max_token_text_ratio": "2.0",
    }
    return [f"{model}.{key}={value}" for model in (MODEL, f"{MODEL}_stream") for key, value in values.items()]


class LLMServer:
    """``transformers serve`` over the checkpoint's LLM directory, on the GPU with continuous batching."""

    def __init__(self, llm_dir: Path, log_path: Path, *, cpu: bool) -> None:
        device = ["--device", "cpu", "--dtype", "float32"] if cpu else ["--device", "cuda:0", "--dtype", "bfloat16"]
        batching = [] if cpu else ["--continuous-batching", "--cb-use-cuda-graph"]
        self._command = [
            str(Path(sys.executable).with_name("transformers")),
            "serve",
            str(llm_dir),
            *device,
            *batching,
            "--host",
            "127.0.0.1",
            "--port",
            str(SERVER_PORT),
            "--log-level",
            "warning",
        ]
        self._log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 300.0) -> None:
        with self._log_path.open("ab") as log_file:
            self._process = subprocess.Popen(self._command, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {self._process.returncode}; see {self._log_path}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"http://127.0.0.1:{SERVER_PORT}/health", timeout=2) as response,
            ):
                if response.status == 200:
                    log(f"transformers serve ready ({' '.join(self._command[1:])})")
                    return
            time.sleep(0.5)
        raise RuntimeError(f"transformers serve not ready within {timeout_s:.0f} s; see {self._log_path}")

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="rehearse on the CPU: one instance per model")
    parser.add_argument(
        "--levels",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[1, 4, 16, 32, 64],
        help="concurrent streams, e.g. 1,4,16,32,64",
    )
    parser.add_argument(
        "--targets",
        type=lambda text: text.split(","),
        default=list(TARGETS),
        help="direct (gRPC to Triton) and/or gateway (HTTP through the gateway)",
    )
    parser.add_argument("--prompts", type=int, default=16, help=f"the first N of {len(PROMPTS)} prompts")
    parser.add_argument("--out", type=Path, default=None, help="report folder; default WORKDIR/report")
    parser.add_argument("--name", default="gpu_cosyvoice2", help="file stem of the report, e.g. gpu-h200")
    parser.add_argument("--workdir", type=Path, default=ROOT / "var" / "gpu_cosyvoice2", help="checkpoint, repo, logs")
    parser.add_argument(
        "--cuda-mps",
        choices=("auto", "on", "off"),
        default="auto",
        help="the models' processes under a CUDA MPS daemon, as the gateway's TTS_EMBEDDED_CUDA_MPS",
    )
    parser.add_argument(
        "--gateway-workers",
        type=int,
        default=4,
        help="gateway processes (TTS_WORKERS): one process's CPU is the limit from about 16 streams",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="GPUs, one tritonserver each as the gateway's embedded default runs them; with more than one, each"
        " level also runs through a gateway over all of them at level x GPUs streams (scale-out; gateway only)",
    )
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip passes that would end later than this")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="limit of one request")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for every model to load")
    parser.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE", help="profile overrides")
    parser.add_argument("--modes", type=lambda text: text.split(","), default=list(MODES), help="stream and/or offline")
    parser.add_argument("--warmup", type=int, default=0, help="warm-up requests per target and mode (0: 2 x streams)")
    parser.add_argument(
        "--llm-server",
        action="store_true",
        help=f"profile {SERVER_PROFILE}: the LLM on `transformers serve` (continuous batching) on the same GPU",
    )
    args = parser.parse_args()
    if not set(args.targets) <= set(TARGETS) or not set(args.modes) <= set(MODES):
        parser.error(f"--targets takes {', '.join(TARGETS)}; --modes takes {', '.join(MODES)}")
    if args.gpus < 1 or (args.gpus > 1 and args.targets != ["gateway"]):
        parser.error("--gpus takes a positive count; more than one measures through the gateway: --targets gateway")
    if not 1 <= args.prompts <= len(PROMPTS) or min(args.levels) < 1:
        parser.error(f"--prompts must lie in [1, {len(PROMPTS)}] and levels must be positive")
    args.out = (args.out or args.workdir / "report").resolve()
    try:
        ok = run(args)
    except (EmbeddedTritonError, InferenceServerException, RuntimeError, OSError) as exc:
        gpu_sanity.print_server_errors(args.workdir.resolve() / "tritonserver.log")
        log(f"FAIL: {type(exc).__name__}: {exc}")
        return 1
    log("PASS" if ok else "FAIL: some requests failed (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
