"""The GPU A/B driver: which pass runs where and when, how the passes run, and what the summary makes of them."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.gpu_ab import Arm, Pass, main, markdown, pass_command, plan, run_chain, summarize
from benchmarks.gpu_cosyvoice2 import PassResult, RequestResult

BASE = Arm("base")
FAST = Arm("fc5", ("token2wav.first_chunk_timesteps=5",))


def test_every_arm_runs_on_every_gpu_in_an_order_turned_by_gpu_and_round() -> None:
    chains = plan([BASE, FAST], ["GPU-a", "GPU-b"], rounds=2)
    orders = [[run.arm.name for run in chain] for chain in chains]
    assert orders == [["base", "fc5", "fc5", "base"], ["fc5", "base", "base", "fc5"]]
    # At every position the two GPUs run different arms, so neither arm gets one time of the lease.
    assert all(a != b for a, b in zip(*orders, strict=True))
    assert [run.gpu for run in chains[1]] == ["GPU-b"] * 4
    names = [run.name for chain in chains for run in chain]
    assert len(set(names)) == len(names)
    three = plan([BASE, FAST, Arm("n5")], [None], rounds=3)
    assert [[run.arm.name for run in chain] for chain in three] == [
        ["base", "fc5", "n5", "fc5", "n5", "base", "n5", "base", "fc5"]
    ]
    assert three[0][0].name == "base-cpu-r0"


def test_an_arm_is_a_name_and_overrides() -> None:
    assert Arm.parse(["fc5", "token2wav.first_chunk_timesteps=5"]) == FAST
    for words in (["token2wav.n_timesteps=5"], ["n5", "n_timesteps=5"], ["n5", "token2wav.n_timesteps"]):
        with pytest.raises(ValueError):
            Arm.parse(words)


def test_a_pass_runs_the_gateway_stream_benchmark_in_its_gpus_work_directory(tmp_path: Path) -> None:
    run = Pass(FAST, chain=1, gpu="GPU-b", round=0)
    command = pass_command(run, levels="16,64", out=tmp_path, workdir=tmp_path / "work", cpu=False, extra=["--x"])
    assert command[1:3] == ["-m", "benchmarks.gpu_cosyvoice2"]
    joined = " ".join(command)
    assert "--targets gateway --modes stream --levels 16,64" in joined
    assert f"--workdir {tmp_path / 'work' / 'gpu1'}" in joined
    assert "--name fc5-gpu1-r0 " in joined and "--set token2wav.first_chunk_timesteps=5" in joined
    assert command[-1] == "--x" and "--cpu" not in command


def report(first_ms: list[float], concurrency: int, flow_ms: float, stall_ms: float = 0.0) -> dict[str, Any]:
    """A pass's report as gpu_cosyvoice2 writes it: one gateway streaming pass at ``concurrency``."""
    requests = [
        RequestResult(prompt=i, voice="v", audio_s=3.0, first_chunk_ms=ms, total_ms=900.0, chunks=3, stall_ms=stall_ms)
        for i, ms in enumerate(first_ms)
    ]
    summary = PassResult("gateway", "stream", concurrency, 2.0, None, requests).summary()
    summary["stages"] = {"flow": {"p50": flow_ms, "p90": flow_ms}, "t2w_queue": {"p50": 10.0, "p90": 20.0}}
    offline = PassResult("gateway", "offline", concurrency, 2.0, None, requests).summary()
    return {"setup": {}, "passes": [summary, offline]}


def test_run_chain_runs_each_pass_on_its_gpu_in_turn_and_skips_what_the_deadline_leaves_out(tmp_path: Path) -> None:
    """Stand-in passes record the GPU they were given and when they ran."""
    chain = plan([BASE, FAST], ["GPU-b", "GPU-c"], rounds=1)[1]
    script = textwrap.dedent(
        """
        import os, sys, time
        print(os.environ.get("CUDA_VISIBLE_DEVICES"), time.monotonic(), flush=True)
        time.sleep(0.2)
        sys.exit(int(sys.argv[1]))
        """
    )
    commands = {chain[0].name: [sys.executable, "-c", script, "0"], chain[1].name: [sys.executable, "-c", script, "3"]}
    stale = tmp_path / "passes" / f"{chain[0].name}.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")  # an earlier run's report of the same name
    outcomes: dict[str, str] = {}
    run_chain(chain, commands, tmp_path, time.monotonic() + 60, outcomes)
    assert not stale.exists()
    assert outcomes == {"fc5-gpu1-r0": "ok", "base-gpu1-r0": "exit 3"}
    seen = [(tmp_path / "logs" / f"{run.name}.log").read_text().split() for run in chain]
    assert [gpu for gpu, _ in seen] == ["GPU-c", "GPU-c"]
    assert float(seen[0][1]) + 0.2 <= float(seen[1][1])  # one after the other
    late: dict[str, str] = {}
    run_chain(chain, commands, tmp_path / "late", time.monotonic(), late)
    assert late == {name: "skipped (--total-s)" for name in commands}


def test_the_summary_gives_each_arms_passes_and_their_median_per_level() -> None:
    chains = plan([BASE, FAST], ["GPU-a", "GPU-b"], rounds=1)
    reports = {
        "base-gpu0-r0": report([200.0, 220.0, 240.0], 16, flow_ms=80.0),
        "base-gpu1-r0": report([230.0, 250.0, 270.0], 16, flow_ms=70.0, stall_ms=50.0),
        "fc5-gpu0-r0": report([170.0, 180.0, 190.0], 16, flow_ms=40.0),
        # fc5-gpu1-r0 did not run
    }
    summary = summarize([BASE, FAST], chains, reports)
    base = summary["arms"]["base"]["levels"][16]
    assert [p["first_audio_p50_ms"] for p in base["passes"]] == [220.0, 250.0]
    assert [p["stalled"] for p in base["passes"]] == [0, 3]
    assert base["median_p50_ms"] == 235.0
    assert base["stages_median_ms"]["flow"] == 75.0 and base["stages_median_ms"]["llm_to_hop"] is None
    fast = summary["arms"]["fc5"]["levels"][16]
    assert [p["pass"] for p in fast["passes"]] == ["fc5-gpu0-r0"] and fast["median_p50_ms"] == 180.0
    assert summary["arms"]["fc5"]["overrides"] == ["token2wav.first_chunk_timesteps=5"]
    setup = {"name": "t", "command": "python -m benchmarks.gpu_ab", "gpus": ["GPU-a"], "rounds": 1, "outcomes": {}}
    text = markdown(json.loads(json.dumps(summary)), setup)
    assert "| base | 235 | 220 (0/3, gpu0 r0), 250 (3/3, gpu1 r0) | - | 10 | 75 | - |" in text
    assert "| fc5 | 180 | 180 (0/3, gpu0 r0) |" in text


def test_levels_without_first_audio_are_left_out_of_the_summary() -> None:
    """A level the pass's budget skipped (as gpu_cosyvoice2 reports it) and one whose every request failed."""
    chains = plan([BASE], ["GPU-a"], rounds=1)
    measured = report([200.0], 1, flow_ms=30.0)
    skipped = {"target": "gateway", "mode": "stream", "gpus": 1, "concurrency": 64, "skipped": "budget"}
    failed = PassResult("gateway", "stream", 16, 2.0, None, [RequestResult(0, "v", 0.0, 0.0, 0.0, 0, "boom")]).summary()
    reports = {"base-gpu0-r0": {"passes": [*measured["passes"], skipped, failed]}}

    levels = summarize([BASE], chains, reports)["arms"]["base"]["levels"]

    assert list(levels) == [1]


def test_options_the_driver_sets_cannot_be_overridden_after_the_separator() -> None:
    with pytest.raises(SystemExit):
        main(["--arm", "base", "--cpu", "--", "--workdir", "shared"])
    with pytest.raises(SystemExit):
        main(["--arm", "base", "--cpu", "--", "--levels=128"])
