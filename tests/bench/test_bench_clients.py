"""Load from several client processes, CPU pinning and process-tree RSS, on real processes and Triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_load import DirectPlan, DirectSpec, client_processes, rss_mb, split, tree_rss_mb
from benchmarks.bench_stack import format_cpus, parse_cpus, pinned
from benchmarks.bench_stats import summarize
from benchmarks.bench_texts import BenchText
from tests.bench.conftest import FIXTURE_VALUES, STREAM_FIRST_CHUNK_DELAY_MS
from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.models import contract

TEXT = BenchText("one", "en", "Hello there.")
SENTENCE = {contract.TARGET_TEXT: TEXT.text, contract.VOICE: "tone"}
AUDIO_SECONDS = float(FIXTURE_VALUES["audio_seconds"])


def _cpus_allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


def test_split_shares_in_proportion() -> None:
    assert split(5, [1, 1]) == [3, 2]
    assert split(5, [2, 1]) == [3, 2]
    assert split(3, [1, 1, 1, 1]) == [1, 1, 1, 0]
    # A process with no workers at a level gets no requests.
    assert split(4, [1, 0]) == [4, 0]


@pytest.mark.triton
async def test_two_client_processes_merge_their_samples(bench_triton: EmbeddedTriton) -> None:
    plan = DirectPlan("bench_fixture_stream", True, 24_000, (TEXT,), {TEXT.name: [SENTENCE]})
    spec = DirectSpec(bench_triton.grpc_url, plan, parallelism=2, timeout=30)
    with client_processes(2) as clients:
        assert len(set(clients.pids)) == 2
        await clients.open({"direct": spec}, [TEXT])
        # The same processes serve every level: one worker each, then one of them idle.
        both = await clients.run("direct", [TEXT], concurrency=2, requests=6)
        one = await clients.run("direct", [TEXT], concurrency=1, requests=3)
        await clients.close()
    for run, requests in ((both, 6), (one, 3)):
        assert len(run.samples) == requests
        assert all(sample.error is None for sample in run.samples), run.samples
        assert all(sample.audio_seconds == pytest.approx(AUDIO_SECONDS) for sample in run.samples)
        assert all(sample.total >= STREAM_FIRST_CHUNK_DELAY_MS / 1000 for sample in run.samples)
        assert run.wall == pytest.approx(run.ended - run.started)
    # Together, the processes' windows overlap: the union window is shorter than the requests one
    # after another. One process alone makes its requests one after another.
    assert both.wall < sum(sample.total for sample in both.samples)
    assert one.wall >= sum(sample.total for sample in one.samples)
    stats = summarize(both)
    assert stats["requests_per_s"] == pytest.approx(6 / both.wall, rel=0.01)
    assert stats["audio_s"] == pytest.approx(6 * AUDIO_SECONDS)


def test_client_processes_run_on_their_cores() -> None:
    with client_processes(1, cores={0}) as clients:
        assert [_cpus_allowed(pid) for pid in clients.pids] == ["0"]


def test_cpu_lists_parse_and_format() -> None:
    usable = os.sched_getaffinity(0)
    assert parse_cpus(format_cpus(usable)) == usable
    assert format_cpus({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    for wrong in ("", "1-0", "a", "0-", "0-1-2", str(max(usable) + 1000)):
        with pytest.raises(ValueError):
            parse_cpus(wrong)


def test_pinned_applies_to_what_starts_meanwhile() -> None:
    before = os.sched_getaffinity(0)
    with pinned({0}):
        child = subprocess.Popen(["sleep", "30"])
    try:
        assert _cpus_allowed(child.pid) == "0"
        assert os.sched_getaffinity(0) == before
    finally:
        child.kill()
        child.wait()


# Waits for a line, then holds 64 MiB of touched memory until stdin closes.
_ALLOCATE = "import sys; sys.stdin.readline(); held = b'x' * (64 << 20); print('held', flush=True); sys.stdin.read()"


def test_rss_of_a_process_counts_its_descendants() -> None:
    # A parent that only waits for its child; the child allocates.
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {_ALLOCATE!r}])"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdin is not None and parent.stdout is not None
    try:
        before = rss_mb(parent.pid)
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline() == "held\n"
        after = rss_mb(parent.pid)
        alone = tree_rss_mb([parent.pid])
        assert before is not None and after is not None and alone is not None
        assert after - before >= 60
        assert after - alone >= 60
    finally:
        parent.stdin.close()
        parent.wait(timeout=30)
    assert rss_mb(parent.pid) is None
