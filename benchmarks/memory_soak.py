"""Memory over a long run of the embedded CPU default (``tts-gateway serve``, Piper).

Starts the gateway as users run it (it starts its own Triton on the ``cpu`` profile), sends
requests at ``--concurrency`` for ``--minutes``, inputs of mixed length up to 4,096 characters
in every response format, streamed and whole, and samples the resident memory of every process:
the gateway, tritonserver, and each Python backend stub by the model it serves (`` shmem``: the
part shared with Triton). The load pauses for a rest after the warm-up (``--warmup`` minutes) and
at the end; the report is each process's RSS at those two rests, the growth between (the target:
under 1 %), and its peak under load. Under load the RSS follows the longest sentences being
synthesised at that moment, so only memory at rest tells growth from work in progress.

    python -m benchmarks.memory_soak [--minutes 10] [--warmup 5] [--concurrency 8] [--cores 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.bench_load import gateway_session
from benchmarks.bench_stack import GatewayServer, children
from benchmarks.cpu_default import pinned_cores

MODEL = "piper"
FORMATS = ("pcm", "wav", "mp3", "opus", "flac", "aac")
MAX_CHARS = 4096
SAMPLE_EVERY_S = 5.0
# Idle time after each load phase: memory at rest is what the comparison reads (the last sample).
REST_S = 30.0
REQUEST_TIMEOUT_S = 600.0

_SENTENCES = (
    "The morning train left the station a few minutes late.",
    "Most passengers were reading, or looking out at the fields.",
    "A child near the window counted the cows as they passed, one by one, and lost count twice.",
    "Nobody minded the delay.",
    "By noon the sky had cleared, and the river shone like a ribbon of silver between the hills,"
    " winding past farms, mills and the old stone bridge that nobody crossed any more.",
)


def soak_text(rng: random.Random) -> str:
    """Sentences up to a length drawn log-uniformly between 20 and 4,096 characters."""
    limit = int(20 * (MAX_CHARS / 20) ** rng.random())
    text = rng.choice(_SENTENCES)
    while len(text) < limit:
        text += " " + rng.choice(_SENTENCES)
    return text[:MAX_CHARS]


def process_tree(root: int) -> dict[str, int]:
    """Label -> pid of ``root`` and its descendants: gateway, tritonserver, stub:MODEL."""
    labels: dict[str, int] = {}
    pending = [(root, "gateway")]
    while pending:
        pid, label = pending.pop()
        labels[label] = pid
        for child in children(pid):
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            name = Path(argv[0].decode(errors="replace")).name
            if name == "triton_python_backend_stub":
                # argv: stub, model path, shm region, ... ; the model path ends in NAME/VERSION/model.py
                model = Path(argv[1].decode(errors="replace")).parent.parent.name
                pending.append((child, f"stub:{model}"))
            else:
                pending.append((child, name or str(child)))
    return labels


def rss_mib(pid: int) -> dict[str, float]:
    """``VmRSS`` of ``pid``, and the part of it that is shared memory (a stub's tensors with Triton)."""
    fields = {"VmRSS": "", "RssShmem": " shmem"}
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            found[fields[key]] = int(value.split()[0]) / 1024
    return found


async def _load(url: str, concurrency: int, until: float, rng: random.Random, counts: dict[str, int]) -> None:
    async def worker(http: aiohttp.ClientSession) -> None:
        while time.monotonic() < until:
            body = {
                "model": MODEL,
                "voice": "alloy",
                "input": soak_text(rng),
                "response_format": rng.choice(FORMATS),
            }
            if rng.random() < 0.5:
                body["stream_format"] = "sse"
            try:
                async with http.post(f"{url}/v1/audio/speech", json=body) as response:
                    async for _ in response.content.iter_any():
                        pass
                    outcome = "ok" if response.status == 200 else f"status {response.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcome = type(exc).__name__
            counts[outcome] = counts.get(outcome, 0) + 1

    async with gateway_session(concurrency, REQUEST_TIMEOUT_S) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))


async def _sample(root: int, phase: list[str], samples: list[dict[str, Any]]) -> None:
    started = time.monotonic()
    while True:
        row: dict[str, Any] = {"t_s": round(time.monotonic() - started, 1), "phase": phase[0]}
        for label, pid in process_tree(root).items():
            try:
                memory = rss_mib(pid)
            except FileNotFoundError:
                continue
            row.update({label + suffix: round(mib, 1) for suffix, mib in memory.items()})
        samples.append(row)
        await asyncio.sleep(SAMPLE_EVERY_S)


async def _soak(gateway: GatewayServer, minutes: float, warmup: float, concurrency: int) -> dict[str, Any]:
    """Load for ``warmup`` minutes, rest, load for the remaining minutes, rest; sampling throughout."""
    samples: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    rng = random.Random(0)
    phase = ["warmup"]
    sampler = asyncio.create_task(_sample(gateway.pid, phase, samples))
    for name, load_minutes in (("warmup", warmup), ("soak", minutes - warmup)):
        phase[0] = name
        await _load(gateway.url, concurrency, time.monotonic() + load_minutes * 60, rng, counts)
        phase[0] = f"{name} rest"
        await asyncio.sleep(REST_S)
    sampler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sampler
    return {"requests": counts, "samples": samples}


def growth(samples: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per process: RSS at rest after the warm-up and at the end, the growth between in %, and the peak."""
    report = {}
    for label in sorted({key for row in samples for key in row} - {"t_s", "phase"}):
        rested = {row["phase"]: row[label] for row in samples if label in row and row["phase"].endswith(" rest")}
        if len(rested) < 2:
            continue
        start, end = rested["warmup rest"], rested["soak rest"]
        report[label] = {
            "rss_first_mib": next(row[label] for row in samples if label in row),
            "rss_rest_after_warmup_mib": start,
            "rss_rest_at_end_mib": end,
            "rss_peak_mib": max(row[label] for row in samples if label in row),
            "growth_after_warmup_pct": round(100 * (end - start) / start, 2) if start else 0.0,
        }
    return report


def measure(workdir: Path, minutes: float, warmup: float, concurrency: int, cores: int) -> dict[str, Any]:
    with GatewayServer(workdir, {"TTS_TRITON_URL": ""}, cores=pinned_cores(cores)) as gateway:
        result = asyncio.run(_soak(gateway, minutes, warmup, concurrency))
    return {
        "minutes": minutes,
        "warmup_minutes": warmup,
        "concurrency": concurrency,
        "cores": cores,
        "requests": result["requests"],
        "processes": growth(result["samples"]),
        "samples": result["samples"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the run")
    parser.add_argument("--warmup", type=float, default=5.0, help="minutes before growth is counted")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cores", type=int, default=2, help="CPUs the gateway and its Triton may use")
    parser.add_argument("--output", type=Path, help="write the full report (with every sample) here as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = measure(Path(tmp), args.minutes, args.warmup, args.concurrency, args.cores)
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    print(json.dumps({key: value for key, value in report.items() if key != "samples"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
