"""Memory over a long run of the embedded CPU default, or of a CosyVoice2 profile on its own Triton.

Starts the gateway as users run it (on the embedded CPU default it starts its own Triton on the
``cpu`` profile; with ``--profile`` a Triton is started here on that CosyVoice2 profile over a
random checkpoint, ``benchmarks/cosyvoice2_triton.py``, and the gateway is pointed at it), sends
requests at ``--concurrency`` for ``--minutes``, inputs of mixed length up to 4,096 characters in
every response format, streamed and whole, and samples the resident memory of every process: the
gateway, tritonserver, and each Python backend stub by the model it serves (`` shmem``: the part
shared between Triton and a stub, the Python backend's pool for tensors, which keeps the size of the
largest tensors in flight at once; `` own``: its anonymous memory, neither shared nor mapped from
files; `` cuda``: CUDA memory, where ``nvidia-smi`` answers) and its thread count. The load pauses
for a rest after the warm-up (``--warmup`` minutes) and after each part of the remaining load (equal
parts of at most ``--rest-every`` minutes; one part without it), the last at the end; the report is
each process's memory at those rests, the growth from the first to the last (the target: under 1 %),
its peak under load, and the threads at the first rest and the last. The rests between tell a leak
(memory that climbs from rest to rest) from a heap or pool that wanders with what the load last left
in it. At each rest every process's own memory is also split by the kind of mapping that holds it
(:mod:`benchmarks.memory_maps`: malloc's heap and arenas, thread stacks, memory mapped outside malloc),
and the report says which kinds grew in each process whose own memory grew 1 % or more or rose at
every rest: a leak of malloc's from one outside it (a driver's host buffers, Python's object arenas).

The warm-up's first third sends only the longest input, from every listener at once: the pools (the
tensor pool, CUDA's caching allocator, malloc's arenas) grow toward what the heaviest load needs
before growth is counted, so that growth after it is less often a pool still filling; a pool can
still step up when the random load later packs more work onto one process than the warm-up did. Under
load the RSS follows the longest sentences being synthesised at that moment, so only memory at rest
tells growth from work in progress. With a profile the report also quotes the lines in which a model
logged its CUDA memory stepping up (token2wav names the calls that took it), so a step has a cause.
Each response's first byte is timed too, by phase: what the load's listeners waited through the run.

    python -m benchmarks.memory_soak [--minutes 10] [--warmup 5] [--concurrency 8] [--cores 2] [--out DIR --name NAME]
    # CosyVoice2 on one GPU, 64 streams, a rest every 5 minutes:
    python -m benchmarks.memory_soak --profile gpu-torch --concurrency 64 --cores 0 --minutes 18 --warmup 3 \\
        --rest-every 5

With ``--out``, writes ``NAME.md`` (the table) and ``NAME.json`` (with every sample) there.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

from benchmarks import bench
from benchmarks.bench_load import gateway_session
from benchmarks.bench_stack import GatewayServer
from benchmarks.bench_stats import percentiles_ms
from benchmarks.cpu_default import pinned_cores
from benchmarks.gpu_query import cuda_mib_by_pid, nvidia_smi, used_mib_by_gpu
from benchmarks.memory_maps import own_memory_by_kind
from benchmarks.server_processes import labelled_processes

FORMATS = ("pcm", "wav", "mp3", "opus", "flac", "aac")
MAX_CHARS = 4096
SAMPLE_EVERY_S = 5.0
# Idle time after each load phase: memory at rest is what the comparison reads (the last sample).
REST_S = 30.0
REQUEST_TIMEOUT_S = 600.0
# The suffix of a process's thread count among its samples.
THREADS = " threads"
# The row of the GPUs' memory in use, whoever holds it.
DEVICE_LABEL = "all GPUs"
# The share of the warm-up that sends only the longest input.
LONGEST_SHARE = 1 / 3
# The time glog (Triton's log) puts before each line: I MMDD HH:MM:SS.micro.
_LOG_TIME = re.compile(r"^[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{1,6})")

_SENTENCES = (
    "The morning train left the station a few minutes late.",
    "Most passengers were reading, or looking out at the fields.",
    "A child near the window counted the cows as they passed, one by one, and lost count twice.",
    "Nobody minded the delay.",
    "By noon the sky had cleared, and the river shone like a ribbon of silver between the hills,"
    " winding past farms, mills and the old stone bridge that nobody crossed any more.",
)


class Speech(NamedTuple):
    """What the load asks for: the model and voice, and the longest input."""

    model: str
    voice: str
    max_chars: int


def soak_text(rng: random.Random, max_chars: int = MAX_CHARS, *, longest: bool = False) -> str:
    """Sentences up to a length drawn log-uniformly between 20 and ``max_chars`` characters
    (``max_chars`` itself with ``longest``)."""
    limit = max_chars if longest else int(20 * (max_chars / 20) ** rng.random())
    text = rng.choice(_SENTENCES)
    while len(text) < limit:
        text += " " + rng.choice(_SENTENCES)
    return text[:max_chars]


def rss_mib(pid: int) -> dict[str, float]:
    """``VmRSS`` of ``pid``, its own anonymous memory, and the part that is shared memory (a stub's
    tensors with Triton)."""
    fields = {"VmRSS": "", "RssAnon": " own", "RssShmem": " shmem"}
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            found[fields[key]] = int(value.split()[0]) / 1024
    return found


def thread_count(pid: int) -> int:
    """The threads of ``pid``: each keeps the deepest stack it touched resident."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "Threads":
            return int(value)
    raise ValueError(f"no thread count for process {pid}")


def cuda_mib() -> tuple[dict[int, int], int | None]:
    """Pid -> MiB of CUDA memory, and the MiB in use on all GPUs together (a CUDA MPS server's
    included, which is no process's child here); empty and None where ``nvidia-smi`` is missing
    or does not answer."""
    if shutil.which("nvidia-smi") is None:
        return {}, None
    try:
        used = sum(used_mib_by_gpu(timeout_s=30))
        return cuda_mib_by_pid(timeout_s=30), used
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, ValueError):
        return {}, None


async def _load(
    url: str,
    speech: Speech,
    concurrency: int,
    until: float,
    longest_until: float,
    rng: random.Random,
    counts: dict[str, int],
    first_byte_s: list[float],
) -> None:
    async def worker(http: aiohttp.ClientSession) -> None:
        while time.monotonic() < until:
            body = {
                "model": speech.model,
                "voice": speech.voice,
                "input": soak_text(rng, speech.max_chars, longest=time.monotonic() < longest_until),
                "response_format": rng.choice(FORMATS),
            }
            if rng.random() < 0.5:
                body["stream_format"] = "sse"
            sent = time.monotonic()
            try:
                async with http.post(f"{url}/v1/audio/speech", json=body) as response:
                    first = None
                    async for _ in response.content.iter_any():
                        first = first or time.monotonic()
                    outcome = "ok" if response.status == 200 else f"status {response.status}"
                    if outcome == "ok" and first is not None:
                        first_byte_s.append(first - sent)
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcome = type(exc).__name__
            counts[outcome] = counts.get(outcome, 0) + 1

    # A connection per request: kept-alive connections stay with the gateway worker that accepted them,
    # and the warm-up's could all land on two of four workers, leaving the others unmeasured until later.
    async with gateway_session(concurrency, REQUEST_TIMEOUT_S, keep_alive=False) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))


async def _sample(roots: dict[int, str], phase: list[str], samples: list[dict[str, Any]]) -> None:
    started = time.monotonic()
    while True:
        taken_in = phase[0]
        row: dict[str, Any] = {"t_s": round(time.monotonic() - started, 1), "phase": taken_in}
        cuda, device_used = await asyncio.to_thread(cuda_mib)
        if device_used is not None:
            row[f"{DEVICE_LABEL} cuda"] = device_used
        for root, root_label in roots.items():
            for label, pid in labelled_processes(root, root_label).items():
                try:
                    memory = rss_mib(pid)
                    memory[THREADS] = thread_count(pid)
                except (FileNotFoundError, ProcessLookupError):
                    continue
                if pid in cuda:
                    memory[" cuda"] = cuda[pid]
                row.update({label + suffix: round(mib, 1) for suffix, mib in memory.items()})
        if phase[0] == taken_in:  # else the load came back while the row was read: it belongs to neither
            samples.append(row)
        await asyncio.sleep(SAMPLE_EVERY_S)


async def _soak(
    url: str,
    roots: dict[int, str],
    speech: Speech,
    minutes: float,
    warmup: float,
    concurrency: int,
    rest_every: float = 0.0,
) -> dict[str, Any]:
    """The loads and rests of :func:`soak_schedule`, sampling throughout."""
    samples: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    first_byte_s: dict[str, list[float]] = {"warmup": [], "soak": []}
    rng = random.Random(0)
    phase = ["warmup"]
    at_rests: dict[str, dict[str, dict[str, float]]] = {}
    started = datetime.datetime.now(datetime.UTC)
    sampler = asyncio.create_task(_sample(roots, phase, samples))
    for name, load_minutes, rest in soak_schedule(minutes, warmup, rest_every):
        phase[0] = name
        if sampler.done():  # it failed: say so now rather than after the run
            sampler.result()
        start = time.monotonic()
        until = start + load_minutes * 60
        longest_until = start + LONGEST_SHARE * load_minutes * 60 if name == "warmup" else start
        await _load(url, speech, concurrency, until, longest_until, rng, counts, first_byte_s[name])
        phase[0] = rest
        await asyncio.sleep(REST_S)
        at_rests[rest] = await asyncio.to_thread(_own_memory_of_each, roots)
    sampler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sampler
    return {
        "started": started,
        "requests": counts,
        "first_byte_ms": {name: percentiles_ms(values) for name, values in first_byte_s.items()},
        "samples": samples,
        "own_by_kind": at_rests,
    }


def _own_memory_of_each(roots: dict[int, str]) -> dict[str, dict[str, float]]:
    """Each process's own memory by the kind of mapping holding it (:mod:`benchmarks.memory_maps`); a
    process gone or not readable is left out rather than ending a soak that ran for minutes."""
    found = {}
    for root, root_label in roots.items():
        for label, pid in labelled_processes(root, root_label).items():
            with contextlib.suppress(OSError):
                kinds = own_memory_by_kind(pid)
                if any(kinds.values()):  # else an exited child not yet reaped: it maps nothing
                    found[label] = kinds
    return found


def soak_schedule(minutes: float, warmup: float, rest_every: float) -> list[tuple[str, float, str]]:
    """(load phase, its minutes, the rest after it): the warm-up, then the remaining minutes of load in
    :func:`soak_segments`."""
    soak = soak_segments(minutes - warmup, rest_every)
    return [("warmup", warmup, "warmup rest")] + [
        ("soak", part, f"soak rest {number}") for number, part in enumerate(soak, 1)
    ]


def soak_segments(minutes: float, rest_every: float) -> list[float]:
    """``minutes`` of load (none where negative) cut into equal parts of at most ``rest_every`` minutes
    (one part for 0)."""
    minutes = max(minutes, 0.0)
    parts = max(math.ceil(minutes / rest_every - 1e-9), 1) if rest_every > 0 else 1
    return [minutes / parts] * parts


def growth(samples: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per process at every rest of the run from the warm-up's on: its memory (the rest's last sample;
    None at a rest between where it was not read), the growth from the first rest to the last in %,
    and the peak. A process missing at the first or the last rest is left out."""
    rests: list[str] = []  # the run's rests, in the order they came
    for row in samples:
        if " rest" in row["phase"] and row["phase"] not in rests:
            rests.append(row["phase"])
    if "warmup rest" not in rests:
        return {}
    rests = rests[rests.index("warmup rest") :]
    if len(rests) < 2:
        return {}
    report = {}
    for label in sorted({key for row in samples for key in row} - {"t_s", "phase"}):
        rested = {row["phase"]: row[label] for row in samples if label in row and row["phase"] in rests}
        if rests[0] not in rested or rests[-1] not in rested:
            continue
        start, end = rested[rests[0]], rested[rests[-1]]
        peak = max(row[label] for row in samples if label in row)
        report[label] = {
            "rss_first_mib": next(row[label] for row in samples if label in row),
            "rss_rest_after_warmup_mib": start,
            "rss_rests_between_mib": [rested.get(rest) for rest in rests[1:-1]],
            "rss_rest_at_end_mib": end,
            "rss_peak_mib": peak,
            # A leak peaks near the end; a pool's high-water mark where the load first needed it.
            "peak_first_at_s": next(row["t_s"] for row in samples if row.get(label) == peak),
            "growth_after_warmup_pct": round(100 * (end - start) / start, 2) if start else 0.0,
        }
    return report


def memory_steps(log: Path, mark: str, started: datetime.datetime) -> list[dict[str, Any]]:
    """The lines of a Triton log that contain ``mark`` (a model saying its CUDA memory stepped up, and
    why), each with the minute of the run it came at (None where Triton put no time before it)."""
    if not log.exists():
        return []
    lines = (line.strip() for line in log.read_text(errors="replace").splitlines() if mark in line)
    return [{"at_min": _run_minute(line, started), "line": line} for line in lines]


def _run_minute(line: str, started: datetime.datetime) -> float | None:
    found = _LOG_TIME.match(line)
    if found is None:
        return None
    month, day, hour, minute, second = (int(part) for part in found.groups()[:5])
    micro = int(found.group(6).ljust(6, "0"))
    at = started.replace(month=month, day=day, hour=hour, minute=minute, second=second, microsecond=micro)
    return round((at - started).total_seconds() / 60, 1)


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The soak as ``args`` ask; ``workdir`` holds the gateway's files (and the Triton's, with a profile)."""
    cores = pinned_cores(args.cores) if args.cores else None
    with contextlib.ExitStack() as stack:
        if args.profile:
            # Imported here: it needs torch (the CosyVoice2 extra), which the CPU default's soak does not.
            from benchmarks.cosyvoice2_triton import cosyvoice2_triton

            server, setup = stack.enter_context(
                cosyvoice2_triton(workdir / "triton", args.profile, args.set, startup_timeout=args.startup_timeout)
            )
            if server.pid is None:
                raise RuntimeError("the Triton for the profile did not start")
            roots = {server.pid: "tritonserver"}
            triton_log: Path | None = server.log_path
            env = {
                "TTS_TRITON_URL": server.grpc_url,
                "TTS_WORKERS": str(args.gateway_workers),
                "TTS_MAX_CONCURRENT_SPEECH": str(2 * args.concurrency),
            }
            speech = Speech("tts-1", args.voice or "lumen", args.max_chars)
            stack_setup: dict[str, Any] | None = dataclasses.asdict(setup)
        else:
            roots, env, stack_setup, triton_log = {}, {"TTS_TRITON_URL": ""}, None, None
            speech = Speech("piper", args.voice or "alloy", args.max_chars)
        gateway = stack.enter_context(GatewayServer(workdir / "gateway", env, cores=cores))
        roots[gateway.pid] = "gateway"
        result = asyncio.run(
            _soak(gateway.url, roots, speech, args.minutes, args.warmup, args.concurrency, args.rest_every)
        )
        steps = None
        if triton_log is not None:
            # Imported here, as cosyvoice2_triton above: it needs torch.
            from tts_gateway.models.cosyvoice2.engines.cuda_memory import STEP_LOG_PREFIX

            steps = memory_steps(triton_log, STEP_LOG_PREFIX, result["started"])
    rests = growth(result["samples"])
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "minutes": args.minutes,
        "warmup_minutes": args.warmup,
        "warmup_longest_minutes": round(LONGEST_SHARE * args.warmup, 2),
        "rest_every_minutes": rest_interval(args.minutes - args.warmup, args.rest_every),
        "concurrency": args.concurrency,
        "cores": args.cores,
        "stack": stack_setup,
        "speech": speech._asdict(),
        "started": result["started"].isoformat(timespec="seconds"),
        "requests": result["requests"],
        "first_byte_ms": result["first_byte_ms"],
        "processes": {name: row for name, row in rests.items() if not name.endswith(THREADS)},
        "threads": {
            name.removesuffix(THREADS): {
                "rest_after_warmup": row["rss_rest_after_warmup_mib"],
                "rest_at_end": row["rss_rest_at_end_mib"],
                "peak": row["rss_peak_mib"],
            }
            for name, row in rests.items()
            if name.endswith(THREADS)
        },
        "memory_steps": steps,
        "own_by_kind": result["own_by_kind"],
        "samples": result["samples"],
    }


def rest_interval(minutes: float, rest_every: float) -> float:
    """The minutes of load between two rests after the warm-up; 0 where there is one rest, at the end."""
    parts = soak_segments(minutes, rest_every)
    return round(parts[0], 2) if len(parts) > 1 else 0.0


def machine() -> str:
    """This machine in a line: processor, CPUs, Python, and the GPUs where ``nvidia-smi`` answers."""
    host = bench.machine()
    line = f"{host['cpu']}, {host['cpus']} CPUs, Python {host['python']}"
    try:
        gpus = [row[0] for row in nvidia_smi("gpu=name", timeout_s=30)] if shutil.which("nvidia-smi") else []
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        gpus = []
    return line + "".join(f", {count} x {name}" for name, count in collections.Counter(gpus).items())


def report(results: dict[str, Any], command: str) -> str:
    """The soak as Markdown: the run, then each process's memory at the rests and its peak."""
    requests = ", ".join(f"{count} {outcome}" for outcome, count in sorted(results["requests"].items()))
    lines = [
        "# Memory over a long run",
        "",
        f"`{command}`",
        "",
        f"{results['date']}, {results['machine']}. {results['minutes']:g} minutes at concurrency "
        f"{results['concurrency']} ({results['speech']['model']}, voice {results['speech']['voice']}, inputs up to "
        f"{results['speech']['max_chars']:,} characters, every response format, streamed and whole): {requests}.",
        "",
        "First byte of a response (ms, p50 / p90 / p99): "
        + "; ".join(
            f"{phase} {' / '.join('-' if v is None else f'{v:.0f}' for v in figures.values())}"
            for phase, figures in results["first_byte_ms"].items()
        )
        + ".",
        "",
        f"Memory at rest (after {REST_S:g} s without requests) once the first {results['warmup_minutes']:g} minutes "
        f"have passed{_longest_first(results)}, {_rests_between(results)}and at the end; the target is growth under "
        "1 %. A leak climbs from rest to rest; memory at rest that goes up and down from one rest to the next, "
        "without a trend, is a pool or heap settling. *up at every rest* marks memory that rose at each of three "
        "or more rests: what a leak looks like however small its growth, though a pool reaching new peaks climbs "
        "too (see when its peak came). "
        "*own*: anonymous memory, neither shared nor "
        "mapped from files; *shared*: the Python backend's tensor pool, mapped by tritonserver and the stub alike, "
        "which keeps the size of the largest tensors in flight at once; *CUDA*: the process's GPU memory. Peaks "
        "are under load; when a peak was first reached tells a leak (near the end) from a pool that grew to what "
        "the load once needed and kept it (CUDA's caching allocator, the tensor pool, malloc's arenas).",
        "",
        "| process | memory | first MiB | rest after warm-up MiB | rests between MiB | rest at end MiB | growth "
        "| peak MiB | peak first at min |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    kinds = {"": "RSS", " own": "own", " shmem": "shared", " cuda": "CUDA"}
    processes = results["processes"]
    suffixes = tuple(suffix for suffix in kinds if suffix)
    labels = {next((name.removesuffix(s) for s in suffixes if name.endswith(s)), name) for name in processes}
    for label in sorted(labels):
        for suffix, kind in kinds.items():
            row = processes.get(label + suffix)
            if row is None or (suffix == " shmem" and row["rss_peak_mib"] == 0):
                continue
            lines.append(
                f"| {label} | {kind} | {row['rss_first_mib']:g} | {row['rss_rest_after_warmup_mib']:g} "
                f"| {_rests(row.get('rss_rests_between_mib'))} | {row['rss_rest_at_end_mib']:g} "
                f"| {row['growth_after_warmup_pct']:+.2f} %{', up at every rest' if climbs(row) else ''} "
                f"| {row['rss_peak_mib']:g} | {_minutes(row.get('peak_first_at_s'))} |"
            )
    threads = [
        f"{name} {row['rest_after_warmup']:g} → {row['rest_at_end']:g}"
        for name, row in sorted(results.get("threads", {}).items())
    ]
    if threads:
        lines += ["", "Threads at the rest after the warm-up and at the end: " + "; ".join(threads) + "."]
    lines += _own_growth_lines(results)
    steps = results.get("memory_steps")
    if steps is not None:
        lines += ["", "What the models logged of their CUDA memory stepping up, with the work that took it:", ""]
        lines += [_step_line(step) for step in steps] or ["- nothing"]
    return "\n".join(lines) + "\n"


def _own_growth_lines(results: dict[str, Any]) -> list[str]:
    """Where the own memory of each process that grew 1 % or more, or rose at every rest, grew by kind of
    mapping, from the first rest to the last; nothing for a run that did not read the mappings."""
    by_rest: dict[str, dict[str, dict[str, float]]] = results.get("own_by_kind") or {}
    if len(by_rest) < 2:
        return []
    at_first, at_last = by_rest[next(iter(by_rest))], by_rest[list(by_rest)[-1]]
    grown = sorted(
        name.removesuffix(" own")
        for name, row in results["processes"].items()
        if name.endswith(" own") and (row["growth_after_warmup_pct"] >= 1.0 or climbs(row))
    )
    lines = []
    for label in grown:
        first, last = at_first.get(label), at_last.get(label)
        if first is None or last is None:
            continue
        moved = sorted(((last[kind] - first[kind], kind) for kind in first if kind in last), key=lambda m: -m[0])
        parts = [
            f"{kind} {first[kind]:,.1f} → {last[kind]:,.1f} ({change:+.1f})"
            for change, kind in moved
            if abs(round(change, 1)) >= 0.1
        ]
        lines.append(f"- {label}: " + ("; ".join(parts) if parts else "no kind moved by 0.1 MiB or more"))
    if not lines:
        return []
    return [
        "",
        "Where own memory grew, from the rest after the warm-up to the last (MiB of anonymous pages by the kind of "
        "mapping holding them, `benchmarks/memory_maps.py`), in each process whose own memory grew 1 % or more or "
        "rose at every rest:",
        "",
        *lines,
    ]


def climbs(row: dict[str, Any]) -> bool:
    """Whether a process's memory rose from each rest to the next; False with fewer than three rests or
    where a rest was not read."""
    rests = [row["rss_rest_after_warmup_mib"], *(row.get("rss_rests_between_mib") or []), row["rss_rest_at_end_mib"]]
    return len(rests) >= 3 and None not in rests and all(a < b for a, b in itertools.pairwise(rests))


def _step_line(step: dict[str, Any]) -> str:
    return f"- `{step['line']}`" if step["at_min"] is None else f"- min {step['at_min']:.1f}: `{step['line']}`"


def _longest_first(results: dict[str, Any]) -> str:
    longest = results.get("warmup_longest_minutes")
    return f" (of which the first {longest:g} min sent only the longest input)" if longest else ""


def _rests_between(results: dict[str, Any]) -> str:
    every = results.get("rest_every_minutes")
    return f"after every {every:g} minutes of load from then on, " if every else ""


def _rests(values: list[float | None] | None) -> str:
    return " / ".join("-" if value is None else f"{value:g}" for value in values) if values else "-"


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the run")
    parser.add_argument("--warmup", type=float, default=5.0, help="minutes before growth is counted")
    parser.add_argument(
        "--rest-every",
        type=float,
        default=0.0,
        help="cut the load after the warm-up into equal parts of at most this many minutes, each followed by a"
        f" {REST_S:g} s rest (0: one part, one rest at the end)",
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cores", type=int, default=2, help="CPUs the gateway (and its Triton) may use; 0: all")
    parser.add_argument("--out", type=Path, help="write NAME.md and NAME.json (with every sample) here")
    parser.add_argument("--name", default="memory-soak", help="the report's name in --out")
    parser.add_argument(
        "--profile", help="start a Triton on this CosyVoice2 profile (random checkpoint), then a gateway"
    )
    parser.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE", help="profile overrides")
    parser.add_argument("--max-chars", type=int, default=MAX_CHARS, help="longest input (at most 4,096)")
    parser.add_argument("--voice", help="voice (default: alloy on the embedded default, else lumen)")
    parser.add_argument("--gateway-workers", type=int, default=4, help="gateway processes, with --profile")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for the stack to start")
    parser.add_argument(
        "--workdir", type=Path, help="with --profile: checkpoint and repository, kept and reused (default: temporary)"
    )
    args = parser.parse_args(argv)
    if args.set and not args.profile:
        parser.error("--set goes with --profile")
    if args.rest_every < 0:
        parser.error("--rest-every must be 0 or more")
    if not 20 <= args.max_chars <= MAX_CHARS:
        parser.error(f"--max-chars must be within 20..{MAX_CHARS}")
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(args, (args.workdir or Path(tmp)).resolve())
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")
        command = shlex.join(["python", "-m", "benchmarks.memory_soak", *(sys.argv[1:] if argv is None else argv)])
        (args.out / f"{args.name}.md").write_text(report(results, command))
    print(json.dumps({key: value for key, value in results.items() if key != "samples"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
