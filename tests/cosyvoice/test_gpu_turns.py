"""The marks token2wav leaves for the LLM's process: seen across processes, bounded, and ignored once stale."""

from __future__ import annotations

import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tts_gateway.models.cosyvoice2.engines.gpu_turns import GpuTurns, YieldToFirstChunks


def test_a_mark_held_in_another_process_is_seen_and_waited_for(tmp_path: Path) -> None:
    path = tmp_path / "turns"
    turns = GpuTurns(path)
    assert not turns.held(stale_s=1.0)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import sys, time
                from pathlib import Path
                from tts_gateway.models.cosyvoice2.engines.gpu_turns import GpuTurns
                with GpuTurns(Path({str(path)!r})).hold(3):
                    print("holding", flush=True)
                    time.sleep(0.3)
            """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    assert turns.held(stale_s=5.0)
    waited = turns.wait(max_wait_s=5.0, stale_s=5.0)
    holder.wait(10)
    assert 0.1 < waited < 2.0  # until the holder let go, not the 5 s bound
    assert not turns.held(stale_s=5.0)
    turns.remove()
    assert not path.exists()


def test_waiting_is_bounded_and_a_stale_mark_is_ignored(tmp_path: Path) -> None:
    turns = GpuTurns(tmp_path / "turns")
    with turns.hold():
        started = time.monotonic()
        assert 0.05 <= turns.wait(max_wait_s=0.05, stale_s=5.0) < 1.0
        time.sleep(0.06)
        # A holder that died keeps its mark forever; past stale_s it no longer counts.
        assert not turns.held(stale_s=0.05)
        assert turns.wait(max_wait_s=5.0, stale_s=0.05) < 0.05
        assert time.monotonic() - started < 1.0
    turns.close()


def test_the_llm_yields_only_while_it_decodes_for_a_few_requests(tmp_path: Path) -> None:
    turns = GpuTurns(tmp_path / "turns")
    gate = YieldToFirstChunks(turns, max_rows=4, max_wait_s=0.01)
    assert not gate.busy([3])
    with turns.hold():
        assert gate.busy([3]) and gate.busy([3, 0, 9, 1])
        assert not gate.busy([3, 0, 9, 1, 5])
    assert not gate.busy([3])
    turns.close()


def test_a_servers_processes_share_one_file_per_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    a, b = GpuTurns.of_server(0, server_pid=4242), GpuTurns.of_server(0, server_pid=4242)
    other_gpu, other_server = GpuTurns.of_server(1, server_pid=4242), GpuTurns.of_server(0, server_pid=4243)
    assert a.path == b.path and a.path.parent == tmp_path
    with a.hold():
        assert b.held(stale_s=5.0)
        assert not other_gpu.held(stale_s=5.0) and not other_server.held(stale_s=5.0)
    for turns in (a, b, other_gpu, other_server):
        turns.remove()


def test_a_mark_from_the_future_does_not_count(tmp_path: Path) -> None:
    # A stamp of a process from an earlier boot, in a file that survived it, lies ahead of this boot's clock.
    turns = GpuTurns(tmp_path / "turns")
    struct.pack_into("<q", turns._map, 8, time.monotonic_ns() + 3600 * 10**9)
    assert not turns.held(stale_s=5.0)
    assert turns.wait(max_wait_s=1.0, stale_s=5.0) < 0.5
    turns.close()


def test_the_llm_yields_only_once_every_request_made_its_first_chunks_tokens(tmp_path: Path) -> None:
    turns = GpuTurns(tmp_path / "turns")
    gate = YieldToFirstChunks(turns, max_rows=4, after_tokens=18, max_wait_s=5.0)
    with turns.hold():
        assert gate.busy([18, 40]) and not gate.busy([17, 40]) and not gate.busy([])
        # A request arriving (stop) ends the wait long before its bound.
        assert gate.wait(lambda: True) < 1.0
    turns.close()
