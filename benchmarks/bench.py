"""Benchmark the gateway against direct Triton, side by side, in one run.

For each model and backend mode (offline, stream) and each concurrency level, the same
requests go to Triton directly over gRPC (the contract inputs the gateway would send) and
to the gateway (``POST /v1/audio/speech``): time to first audio byte and total latency
(p50/p90/p99), aggregate RTF, requests/s, errors, the gateway's peak RSS, and the ratios.
The benchmark fixture model (``bench_fixture``: a tone, no compute) shows the gateway's own
overhead; Piper gives real-compute figures. Also measured: the streaming encoders' CPU cost
(``encoding_cost.py``) and the embedded CPU default (``cpu_default.py``). The project's targets
are checked against the figures. Writes NAME.json, NAME.md and NAME.png into ``--out`` (``--name``,
default ``bench``; ``--out docs/benchmarks --name cpu-2core`` updates the published report in place).

By default it starts its own stack: the embedded Triton on the ``bench`` profile and, per mode,
a gateway process pointed at it (``TTS_BACKEND_MODE``), with access logging off.

    python -m benchmarks.bench --out var/bench
    python -m benchmarks.bench --parts sweep --models bench_fixture --levels 1,32 --modes offline
    python -m benchmarks.bench --triton-url HOST:8001 --gateway-url http://HOST:8080 --gateway-mode stream \\
        --models cosyvoice2 --parts sweep

On a machine with cores to spare, give Triton, the gateway and the load generator their own
(the load generator in several processes, the gateway in several workers):

    python -m benchmarks.bench --parts sweep --triton-cores 0-3 --gateway-cores 4-9 --gateway-workers 4 \\
        --client-cores 10-15 --client-processes 6
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shlex
import signal
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from benchmarks import bench_report
from benchmarks.bench_load import (
    ClientProcesses,
    DirectSpec,
    GatewaySpec,
    InProcessLoad,
    LevelRun,
    LoadGenerator,
    TargetSpec,
    client_processes,
    direct_plan,
    merge_runs,
    process_tree,
)
from benchmarks.bench_stack import GatewayServer, cpus_of, embedded_triton, format_cpus, parse_cpus, pinned
from benchmarks.bench_stats import ratios, summarize
from tts_gateway.gateway.settings import Settings

Mode = Literal["offline", "stream"]
MODES: tuple[Mode, ...] = get_args(Mode)
PARTS = ("sweep", "encoding", "cpu-default")
FIXTURE = "bench_fixture"


def _csv(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _modes(value: str) -> list[Mode]:
    modes = _csv(value)
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    return [m for m in MODES if m in modes]


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {number}")
    return number


def _levels(value: str) -> list[int]:
    levels = [int(item) for item in _csv(value)]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels are positive integers")
    return levels


def _cpus(value: str) -> set[int]:
    try:
        return parse_cpus(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("var/bench"), help="where NAME.json/.md/.png go")
    parser.add_argument(
        "--name", default="bench", help="file stem of the report, e.g. cpu-2core to update docs/benchmarks/ in place"
    )
    parser.add_argument("--parts", type=_csv, default=list(PARTS), help=f"of {','.join(PARTS)} (default: all)")
    what = parser.add_argument_group("sweep")
    what.add_argument("--models", type=_csv, default=[FIXTURE, "piper"], help="speech models (default: %(default)s)")
    what.add_argument("--modes", type=_modes, default=list(MODES), help="backend modes (default: offline,stream)")
    what.add_argument("--levels", type=_levels, default=[1, 2, 4, 8, 16, 32, 64], help="concurrency of the fixture")
    what.add_argument("--model-levels", type=_levels, default=[1, 2, 4], help="concurrency of the other models")
    what.add_argument("--texts", type=_csv, help="text names of bench_texts.py (default: all the model speaks)")
    what.add_argument("--requests", type=_positive, default=20, help="requests per level at least (default: 20)")
    what.add_argument("--rounds", type=_positive, default=3, help="requests per worker at least (default: 3)")
    what.add_argument("--passes", type=_positive, default=2, help="turns each target takes per level (default: 2)")
    what.add_argument("--warmup", type=int, default=2, help="unmeasured requests per text and target")
    what.add_argument("--voice", default="alloy", help="voice of every request (default: alloy)")
    what.add_argument("--offline-format", default="wav", choices=("wav", "pcm"))
    what.add_argument("--stream-format", default="pcm", choices=("wav", "pcm"))
    what.add_argument("--overhead-model", default=FIXTURE, help="model the gateway-overhead targets are read on")
    what.add_argument(
        "--client-processes",
        type=_positive,
        default=1,
        help="processes generating each level's load together (default: 1, this process)",
    )
    stack = parser.add_argument_group("stack (default: started here)")
    stack.add_argument("--profile", default="bench", help="profile of the embedded Triton (default: bench)")
    stack.add_argument("--set", dest="overrides", action="append", default=[], metavar="MODEL.KEY=VALUE")
    stack.add_argument("--deploy", type=_csv, help="deploy only these Triton models of the profile (default: all)")
    stack.add_argument("--repository", type=Path, help="serve this rendered repository instead of a profile")
    stack.add_argument("--triton-url", help="use this Triton (gRPC host:port) instead of starting one")
    stack.add_argument("--gateway-url", help="use this gateway instead of starting them (needs --triton-url)")
    stack.add_argument("--gateway-mode", choices=MODES, default="stream", help="TTS_BACKEND_MODE of --gateway-url")
    stack.add_argument("--gateway-pid", type=int, help="process of --gateway-url, for its RSS")
    stack.add_argument("--gateway-env", action="append", default=[], metavar="TTS_KEY=VALUE")
    stack.add_argument("--gateway-workers", type=_positive, default=1, help="TTS_WORKERS of the gateways started")
    cores = parser.add_argument_group("CPU pinning of the sweep (CPU lists such as 0-3,8; default: not pinned)")
    cores.add_argument("--triton-cores", type=_cpus, help="the Triton started here and its model processes")
    cores.add_argument("--gateway-cores", type=_cpus, help="the gateways started here and their workers")
    cores.add_argument("--client-cores", type=_cpus, help="the load generator (this process and its clients)")
    other = parser.add_argument_group("encoding and CPU default")
    other.add_argument("--encoding-seconds", type=float, default=60.0)
    other.add_argument("--cores", type=int, default=2, help="CPUs of the embedded CPU default run")
    other.add_argument("--cpu-rounds", type=int, default=3)
    return parser


@dataclass(frozen=True)
class Stack:
    triton_url: str
    workdir: Path


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "load_average": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def _gateway_env(args: argparse.Namespace, triton_url: str, mode: Mode) -> dict[str, str]:
    """The gateway's settings: this Triton and mode, admission control wide enough for every level."""
    slots = str(max(*args.levels, *args.model_levels))
    env = {
        "TTS_TRITON_URL": triton_url,
        "TTS_BACKEND_MODE": mode,
        "TTS_MAX_CONCURRENT_SPEECH": slots,
        "TTS_MAX_QUEUED_SPEECH": slots,
    }
    for item in args.gateway_env:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("TTS_"):
            raise SystemExit(f"--gateway-env {item!r} is not TTS_KEY=VALUE")
        if key == "TTS_WORKERS":
            raise SystemExit("--gateway-env TTS_WORKERS: use --gateway-workers (the report states it)")
        env[key] = value
    env["TTS_WORKERS"] = str(args.gateway_workers)
    return env


@contextlib.contextmanager
def _gateway(args: argparse.Namespace, stack: Stack, mode: Mode, cores: set[int]) -> Iterator[tuple[str, int | None]]:
    """URL and process id of a gateway serving ``mode``; one started here runs on ``cores``."""
    if args.gateway_url:
        yield args.gateway_url, args.gateway_pid
        return
    env = _gateway_env(args, stack.triton_url, mode)
    with GatewayServer(stack.workdir / f"gateway-{mode}", env, cores) as gateway:
        yield gateway.url, gateway.pid


async def _sweep(
    args: argparse.Namespace,
    stack: Stack,
    model: str,
    mode: Mode,
    gateway_url: str,
    gateway_pid: int | None,
    clients: ClientProcesses | None,
) -> dict[str, Any]:
    settings = Settings(backend_mode=mode)
    plan = await direct_plan(stack.triton_url, settings, model, args.voice, args.texts, stack.workdir)
    texts = plan.texts
    if not texts:
        raise SystemExit(f"model {model} speaks none of the languages of the chosen texts")
    response_format = args.offline_format if mode == "offline" else args.stream_format
    levels = args.levels if model == args.overhead_model else args.model_levels
    targets: dict[str, TargetSpec] = {
        "direct": DirectSpec(stack.triton_url, plan, settings.synthesis_parallelism, settings.backend_timeout),
        "gateway": GatewaySpec(
            gateway_url, model, args.voice, response_format, max(levels), settings.backend_timeout * 2
        ),
    }
    load: LoadGenerator = clients or InProcessLoad()
    try:
        await load.open(targets, texts * args.warmup)
        results = []
        for level in levels:
            # Direct and gateway take turns, a share of the requests at a time: load that drifts
            # (a shared machine) then weighs on both alike.
            share = -(-max(args.requests, level * args.rounds) // args.passes)
            runs: dict[str, list[LevelRun]] = {"direct": [], "gateway": []}
            for _ in range(args.passes):
                runs["direct"].append(await load.run("direct", texts, level, share))
                runs["gateway"].append(await load.run("gateway", texts, level, share, gateway_pid))
            direct = summarize(merge_runs(runs["direct"]))
            gateway = summarize(merge_runs(runs["gateway"]))
            results.append(
                {"concurrency": level, "direct": direct, "gateway": gateway, "ratio": ratios(gateway, direct)}
            )
            print(
                f"{model} {mode} c={level}: total p50 direct {direct['total_ms']['p50']} ms,"
                f" gateway {gateway['total_ms']['p50']} ms; errors {direct['errors']}/{gateway['errors']}",
                file=sys.stderr,
            )
    finally:
        await load.close()
    return {
        "model": model,
        "mode": mode,
        "triton_model": plan.triton_model,
        "response_format": response_format,
        "texts": [t.name for t in texts],
        # With several workers: the gateway's supervisor, its workers and anything else they started.
        "gateway_processes": len(process_tree(gateway_pid)) if gateway_pid is not None else None,
        "levels": results,
    }


def _sweeps(args: argparse.Namespace, workdir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The sweeps, and how the stack they ran on was laid out (the CPUs read back from its processes)."""
    if args.gateway_url and not args.triton_url:
        raise SystemExit("--gateway-url needs --triton-url: the direct target is Triton")
    if args.triton_url and args.triton_cores:
        raise SystemExit("--triton-cores pins the Triton started here: not with --triton-url")
    if args.gateway_url and (args.gateway_cores or args.gateway_workers != 1):
        raise SystemExit("--gateway-cores and --gateway-workers apply to gateways started here: not with --gateway-url")
    modes = [args.gateway_mode] if args.gateway_url else args.modes
    # What is not pinned runs where this process could before it pinned itself to the client CPUs.
    everywhere = os.sched_getaffinity(0)
    layout: dict[str, Any] = {
        "gateway_workers": None if args.gateway_url else args.gateway_workers,
        "client_processes": args.client_processes,
        "cpus": {},
    }
    cpus = layout["cpus"]
    with contextlib.ExitStack() as stack, pinned(args.client_cores):
        cpus["clients"] = format_cpus(os.sched_getaffinity(0))
        clients = None
        if args.client_processes > 1:
            clients = stack.enter_context(client_processes(args.client_processes, args.client_cores))
            cpus["clients"] = ", ".join(sorted({cpus_of(pid) or "gone" for pid in clients.pids}))
        triton_url = args.triton_url
        if triton_url is None:
            server = stack.enter_context(
                embedded_triton(
                    workdir / "triton",
                    profile=args.profile,
                    overrides=args.overrides,
                    repository=args.repository,
                    cores=args.triton_cores or everywhere,
                    only=args.deploy,
                )
            )
            triton_url = server.grpc_url
            cpus["triton"] = cpus_of(server.pid) if server.pid is not None else None
        sweeps = []
        gateway_cores = args.gateway_cores or everywhere
        for mode in modes:
            with _gateway(args, Stack(triton_url, workdir), mode, gateway_cores) as (url, pid):
                if pid is not None:
                    cpus["gateway"] = cpus_of(pid)
                for model in args.models:
                    sweep = _sweep(args, Stack(triton_url, workdir), model, mode, url, pid, clients)
                    sweeps.append(asyncio.run(sweep))
    return sweeps, layout


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Every part asked for; the report dict that bench.json holds."""
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    report: dict[str, Any] = {
        "command": command,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
    }
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        workdir = Path(tmp)
        if "sweep" in args.parts:
            report["sweeps"], report["stack"] = _sweeps(args, workdir)
        if "encoding" in args.parts:
            # Imported here: these parts need Piper installed, the sweep of other models does not.
            from benchmarks import encoding_cost

            report["encoding"] = encoding_cost.measure(args.encoding_seconds)
        if "cpu-default" in args.parts:
            from benchmarks import cpu_default

            report["cpu_default"] = cpu_default.measure(workdir / "cpu-default", args.cores, args.cpu_rounds)
    report["targets"] = bench_report.targets_json(bench_report.check_targets(report, args.overhead_model))
    return report


def write(report: dict[str, Any], out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
    (out / f"{name}.md").write_text(bench_report.markdown(report), encoding="utf-8")
    if report.get("sweeps"):
        bench_report.plot(report, out / f"{name}.png")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    # A terminated run still stops its servers and removes its temporary files.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    report = run(args, shlex.join(["python", "-m", "benchmarks.bench", *argv]))
    write(report, args.out, args.name)
    print(bench_report.markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
