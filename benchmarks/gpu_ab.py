"""Settings compared on the GPUs of one host: alternated passes of ``gpu_cosyvoice2``, every arm on every GPU.

At 16 to 64 streams first audio moves by a fifth from one pass of a setup to the next, as much as the
gains being chased, so one pass per setting proves little. This runs each arm (a name and its profile
overrides) on every GPU given, each GPU with a server, work directory and MPS daemon of its own, in an
order rotated per GPU and per round, so that neither a GPU nor the time of a pass favours an arm. It
then gives each arm's first audio p50 per level over all its passes (each pass listed, their median),
its stalled streams and the median of where a first chunk's time went.

    python -m benchmarks.gpu_ab --arm base --arm fc5 token2wav.first_chunk_timesteps=5 --rounds 2
    python -m benchmarks.gpu_ab --cpu --arm base --arm n5 token2wav.n_timesteps=5 --levels 1 \\
        -- --prompts 2  # rehearsal without a GPU

Arguments after ``--`` go to every pass (``python -m benchmarks.gpu_cosyvoice2 --help``). Each pass's
report and log, and the summary (``NAME.md`` / ``NAME.json``), go under ``--out``: an A/B is an
experiment, its figures belong in the change it decides, not in ``docs/benchmarks``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from tts_gateway.gateway.embedded.gpu_devices import VISIBLE_DEVICES, cuda_ids, visible_gpus
from tts_gateway.models.model_repository import parse_overrides

ROOT: Final = Path(__file__).resolve().parent.parent
# Where a first chunk's time went, in the order of the pipeline (gpu_cosyvoice2's stage names).
STAGES: Final = ("llm_to_hop", "t2w_queue", "flow", "hift")
# gpu_cosyvoice2's options that the driver sets for every pass; given after ``--`` they would undo the A/B's layout.
DRIVER_FLAGS: Final = ("--targets", "--modes", "--levels", "--out", "--name", "--workdir", "--cpu", "--gpus")


@dataclass(frozen=True)
class Arm:
    """A setting under test: its name and the profile overrides (``MODEL.KEY=VALUE``) that make it."""

    name: str
    overrides: tuple[str, ...] = ()

    @classmethod
    def parse(cls, words: Sequence[str]) -> Arm:
        name, *overrides = words
        if not name or "=" in name or "/" in name:
            raise ValueError(f"an arm starts with its name, then its overrides: {' '.join(words)!r}")
        parse_overrides(overrides)  # the form gpu_cosyvoice2's --set takes; its TemplateError is a ValueError
        return cls(name, tuple(overrides))


@dataclass(frozen=True)
class Pass:
    """One run of ``gpu_cosyvoice2`` for ``arm`` on the chain's GPU (``None``: the CPU) in ``round``."""

    arm: Arm
    chain: int
    gpu: str | None
    round: int

    @property
    def name(self) -> str:
        return f"{self.arm.name}-{'cpu' if self.gpu is None else f'gpu{self.chain}'}-r{self.round}"


def plan(arms: Sequence[Arm], gpus: Sequence[str | None], rounds: int) -> list[list[Pass]]:
    """Each GPU's passes in order: every arm once a round, the order rotated by GPU and by round, so that
    with two arms on two GPUs one GPU runs A B while the other runs B A, and the next round turns both."""
    chains = []
    for chain, gpu in enumerate(gpus):
        passes = []
        for round_ in range(rounds):
            start = (chain + round_) % len(arms)
            passes += [Pass(arm, chain, gpu, round_) for arm in [*arms[start:], *arms[:start]]]
        chains.append(passes)
    return chains


def pass_command(run: Pass, *, levels: str, out: Path, workdir: Path, cpu: bool, extra: Sequence[str]) -> list[str]:
    """``gpu_cosyvoice2`` streaming through the gateway for one pass; its work directory is its GPU's."""
    command = [sys.executable, "-m", "benchmarks.gpu_cosyvoice2", "--targets", "gateway", "--modes", "stream"]
    command += ["--levels", levels, "--out", str(out / "passes"), "--name", run.name]
    command += ["--workdir", str(workdir / ("cpu" if run.gpu is None else f"gpu{run.chain}"))]
    command += ["--cpu"] if cpu else []
    for override in run.arm.overrides:
        command += ["--set", override]
    return [*command, *extra]


def run_chain(
    passes: Sequence[Pass], commands: dict[str, list[str]], out: Path, deadline: float, outcomes: dict[str, str]
) -> None:
    """The passes of one GPU one after another; a pass that would start after ``deadline`` is skipped."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for run in passes:
        if time.monotonic() >= deadline:
            outcomes[run.name] = "skipped (--total-s)"
            continue
        env = dict(os.environ)
        if run.gpu is not None:
            env[VISIBLE_DEVICES] = run.gpu
        # A report left by an earlier run of the same name must not pass for this one's.
        for suffix in (".json", ".md"):
            (out / "passes" / f"{run.name}{suffix}").unlink(missing_ok=True)
        started = time.monotonic()
        print(f"[{run.name}] start", flush=True)
        try:
            with (out / "logs" / f"{run.name}.log").open("w") as log:
                done = subprocess.run(commands[run.name], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            outcomes[run.name] = "ok" if done.returncode == 0 else f"exit {done.returncode}"
        except OSError as exc:
            outcomes[run.name] = f"not started: {exc}"
        print(f"[{run.name}] {outcomes[run.name]} after {time.monotonic() - started:.0f} s", flush=True)


def summarize(arms: Sequence[Arm], chains: Sequence[Sequence[Pass]], reports: dict[str, Any]) -> dict[str, Any]:
    """Per arm and level: every pass's first audio p50 (ms) and stalled streams, their median, and the median
    over passes of each stage's p50. ``reports``: the JSON reports of the passes that ran to the end, by name."""
    arms_out: dict[str, Any] = {}
    for arm in arms:
        levels: dict[int, dict[str, Any]] = {}
        for run in (run for chain in chains for run in chain if run.arm == arm):
            for result in (reports.get(run.name) or {}).get("passes", []):
                # A level the pass's budget skipped, or one whose every request failed, has no first audio.
                first = result.get("first_chunk_ms") or {}
                if result.get("target") != "gateway" or result.get("mode") != "stream" or first.get("p50") is None:
                    continue
                stages = result.get("stages") or {}
                level = levels.setdefault(int(result["concurrency"]), {"passes": []})
                level["passes"].append(
                    {
                        "pass": run.name,
                        "gpu": "cpu" if run.gpu is None else f"gpu{run.chain}",
                        "round": run.round,
                        "first_audio_p50_ms": first["p50"],
                        "stalled": result["stalled"],
                        "requests": result["requests"],
                        "behind_real_time": result["behind_real_time"],
                        "failed": result["failed"],
                        "stages_p50_ms": {stage: stages[stage]["p50"] for stage in STAGES if stage in stages},
                    }
                )
        for level in levels.values():
            level["median_p50_ms"] = _median(p["first_audio_p50_ms"] for p in level["passes"])
            level["stages_median_ms"] = {
                stage: _median(p["stages_p50_ms"].get(stage) for p in level["passes"]) for stage in STAGES
            }
        arms_out[arm.name] = {"overrides": list(arm.overrides), "levels": dict(sorted(levels.items()))}
    return {"arms": arms_out}


def _median(values: Iterable[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return round(statistics.median(present), 1) if present else None


def markdown(summary: dict[str, Any], setup: dict[str, Any]) -> str:
    """The summary as a table per level: one row per arm, its passes' p50s beside their median."""
    lines = [f"# A/B: {setup['name']}", "", f"`{setup['command']}`", ""]
    outcomes = ", ".join(f"{name} {outcome}" for name, outcome in setup["outcomes"].items())
    lines += [f"GPUs: {', '.join(setup['gpus'])}; rounds: {setup['rounds']}; passes: {outcomes}", ""]
    # Levels are numbers in process and strings once read back from JSON.
    levels = sorted({level for arm in summary["arms"].values() for level in arm["levels"]}, key=int)
    stage_heads = " | ".join(STAGES)
    for level in levels:
        lines += [f"## {level} stream{'' if int(level) == 1 else 's'}", ""]
        lines += [
            f"| arm | first audio, median p50 ms | each pass: p50 ms (stalled / requests, GPU, round) | {stage_heads} |"
        ]
        lines += ["|---|---:|---|" + "---:|" * len(STAGES)]
        for name, arm in summary["arms"].items():
            result = arm["levels"].get(level)
            if result is None:
                continue
            each = ", ".join(
                f"{p['first_audio_p50_ms']:.0f} ({p['stalled']}/{p['requests']}, {p['gpu']} r{p['round']})"
                for p in result["passes"]
            )
            stages = " | ".join(_ms(result["stages_median_ms"][stage]) for stage in STAGES)
            lines.append(f"| {name} | {_ms(result['median_p50_ms'])} | {each} | {stages} |")
        lines.append("")
    lines += [
        "Overrides: " + "; ".join(f"{n}: {' '.join(a['overrides']) or '(none)'}" for n, a in summary["arms"].items())
    ]
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    extra = given[given.index("--") + 1 :] if "--" in given else []
    own = given[: given.index("--")] if "--" in given else given
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--arm", action="append", nargs="+", required=True, metavar="NAME [MODEL.KEY=VALUE ...]", help="a setting"
    )
    parser.add_argument("--rounds", type=int, default=1, help="passes of every arm on every GPU")
    parser.add_argument("--levels", default="1,16,64", help="concurrent streams of each pass")
    parser.add_argument("--gpus", default=None, help="GPUs (indices or UUIDs, comma-separated); default: all visible")
    parser.add_argument("--cpu", action="store_true", help="rehearse on the CPU: one chain, gpu_cosyvoice2 --cpu")
    parser.add_argument("--total-s", type=float, default=1500.0, help="start no pass after this many seconds")
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "gpu_ab", help="passes, logs and the summary")
    parser.add_argument("--workdir", type=Path, default=ROOT / "var" / "gpu_ab" / "work", help="one folder per GPU")
    parser.add_argument("--name", default="summary", help="file stem of the summary")
    args = parser.parse_args(own)
    if taken := sorted({word.partition("=")[0] for word in extra} & set(DRIVER_FLAGS)):
        parser.error(f"{', '.join(taken)} after -- would override what the driver sets for each pass")
    try:
        arms = [Arm.parse(words) for words in args.arm]
    except ValueError as exc:
        parser.error(str(exc))
    if len({arm.name for arm in arms}) != len(arms) or args.rounds < 1:
        parser.error("arms need distinct names and --rounds a positive count")
    if args.cpu:
        gpus: list[str | None] = [None]
    else:
        named = [device.strip() for device in args.gpus.split(",")] if args.gpus else visible_gpus()
        if not named or len(set(named)) != len(named) or not all(named):
            parser.error("no GPU found, or one named twice or empty; --cpu rehearses without one")
        # By UUID: an index may mean another GPU to a process under an MPS daemon (cuda_mps.py).
        ids = cuda_ids(named)
        gpus = [ids[device] for device in named]
    out, workdir = args.out.resolve(), args.workdir.resolve()
    chains = plan(arms, gpus, args.rounds)
    commands = {
        run.name: pass_command(run, levels=args.levels, out=out, workdir=workdir, cpu=args.cpu, extra=extra)
        for chain in chains
        for run in chain
    }
    deadline = time.monotonic() + args.total_s
    outcomes: dict[str, str] = {}
    threads = [threading.Thread(target=run_chain, args=(chain, commands, out, deadline, outcomes)) for chain in chains]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    reports = {}
    for name in commands:
        path = out / "passes" / f"{name}.json"
        if outcomes.get(name) == "ok" and path.is_file():
            reports[name] = json.loads(path.read_text(encoding="utf-8"))
    setup = {
        "name": args.name,
        "command": shlex.join(["python", "-m", "benchmarks.gpu_ab", *given]),
        "gpus": ["cpu"] if args.cpu else [str(gpu) for gpu in gpus],
        "rounds": args.rounds,
        "outcomes": dict(sorted(outcomes.items())),
    }
    summary = {"setup": setup, **summarize(arms, chains, reports)}
    (out / f"{args.name}.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    text = markdown(summary, setup)
    (out / f"{args.name}.md").write_text(text, encoding="utf-8")
    print(text, flush=True)
    return 0 if all(outcomes.get(name) == "ok" for name in commands) else 1


if __name__ == "__main__":
    sys.exit(main())
