"""Own memory by kind of mapping: the layout rules on a written smaps, and live processes read as they grow.

The live checks run in a child process of their own: a thread's malloc arena is trimmed as the thread
exits, after ``join()`` returns, and arenas left by earlier tests would take a new thread's allocations, so
in the test process the figures would move with whatever ran before.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.memory_maps import KINDS, parse_smaps, split_by_kind

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
ARENA = 0x7F0000000000  # aligned to 64 MiB


def smaps_entry(start: int, end: int, perms: str, anonymous_kib: int, name: str = "") -> str:
    return (
        f"{start:x}-{end:x} {perms} 00000000 00:00 0          {name}\n"
        f"Size:           {(end - start) // 1024} kB\n"
        f"Rss:            {anonymous_kib} kB\n"
        f"Anonymous:      {anonymous_kib} kB\n"
        "THPeligible:    0\n"
        "VmFlags: rd wr mr mw me ac\n"
    )


SMAPS = "".join(
    [
        smaps_entry(0x55D000000000, 0x55D000400000, "rw-p", 1024, "[heap]"),
        # A thread's arena: 32 MiB of its heap in use, the rest of the 64 MiB reserved after it.
        smaps_entry(ARENA, ARENA + 32 * MIB, "rw-p", 2048),
        smaps_entry(ARENA + 32 * MIB, ARENA + 64 * MIB, "---p", 0),
        # Two heaps of another arena side by side: one whole, the next partly in use.
        smaps_entry(ARENA + 64 * MIB, ARENA + 144 * MIB, "rw-p", 4096),
        smaps_entry(ARENA + 144 * MIB, ARENA + 192 * MIB, "---p", 0),
        # A whole heap: nothing reserved after it.
        smaps_entry(ARENA + 192 * MIB, ARENA + 256 * MIB, "rw-p", 1024),
        # A region reserved as a driver does, aligned but with a rest that does not end at 64 MiB.
        smaps_entry(ARENA + 256 * MIB, ARENA + 258 * MIB, "rw-p", 512),
        smaps_entry(ARENA + 258 * MIB, ARENA + 290 * MIB, "---p", 0),
        # A thread's stack above its guard page.
        smaps_entry(0x7F1000000000, 0x7F1000001000, "---p", 0),
        smaps_entry(0x7F1000001000, 0x7F1000801000, "rw-p", 256),
        # Above an inaccessible region far larger than a guard page: not a stack.
        smaps_entry(0x7F2000001000, 0x7F2000101000, "rw-p", 512),
        smaps_entry(0x7F2000101000, 0x7F2010101000, "---p", 0),
        smaps_entry(0x7F2010101000, 0x7F2010201000, "rw-p", 1024),
        smaps_entry(0x7F2100000000, 0x7F2100100000, "rw-p", 1024, "[anon:glibc: loader malloc]"),
        # Above a guard-sized gap, but read-only: not a stack.
        smaps_entry(0x7F2200000000, 0x7F2200001000, "---p", 0),
        smaps_entry(0x7F2200001000, 0x7F2200101000, "r--p", 1024),
        # A library's zeroed data right above an inaccessible part of its file: not a stack.
        smaps_entry(0x7F2300000000, 0x7F2300001000, "---p", 0, "/opt/lib dir/libbar.so"),
        smaps_entry(0x7F2300001000, 0x7F2300101000, "rw-p", 1024),
        smaps_entry(0x7F3000000000, 0x7F3000010000, "rw-p", 3072, "/opt/lib dir/libfoo.so"),
        smaps_entry(0x7FFC00000000, 0x7FFC00021000, "rw-p", 132, "[stack]"),
    ]
)


def test_each_mapping_is_counted_by_the_layout_that_tells_its_kind() -> None:
    mappings = parse_smaps(SMAPS)
    assert len(mappings) == 20
    assert mappings[-2].name == "/opt/lib dir/libfoo.so"
    assert split_by_kind(mappings) == {
        "malloc heap": 1.0,
        "malloc arenas": 7.0,
        "thread stacks": 0.2,
        "other anonymous": 5.0,
        "file copies": 3.0,
        "main stack": 0.1,
    }


def in_child(body: str) -> dict[str, dict[str, float]]:
    """Run ``body`` in a fresh interpreter; it sets ``readings``, a dict of own_memory_by_kind results."""
    script = "import json, os\nfrom benchmarks.memory_maps import own_memory_by_kind\nreadings = {}\n"
    script += textwrap.dedent(body) + "\nprint(json.dumps(readings))\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_live_process_memory_is_split_without_losing_any() -> None:
    readings = in_child(
        """
        from benchmarks.memory_soak import rss_mib
        readings["kinds"] = own_memory_by_kind(os.getpid())
        readings["own"] = {"rss": rss_mib(os.getpid())[" own"]}
        """
    )
    assert tuple(readings["kinds"]) == KINDS
    # smaps walks the page tables; the status file's RssAnon is a counter the kernel updates in batches.
    assert sum(readings["kinds"].values()) == pytest.approx(readings["own"]["rss"], abs=4)


def test_memory_mapped_outside_malloc_grows_other_anonymous() -> None:
    readings = in_child(
        """
        import mmap
        readings["before"] = own_memory_by_kind(os.getpid())
        private = mmap.mmap(-1, 48 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        private.write(b"x" * len(private))
        readings["after"] = own_memory_by_kind(os.getpid())
        """
    )
    before, after = readings["before"], readings["after"]
    assert after["other anonymous"] - before["other anonymous"] == pytest.approx(48, abs=2)
    assert after["malloc arenas"] - before["malloc arenas"] < 1


def test_what_a_thread_allocates_through_malloc_lands_in_its_arena() -> None:
    readings = in_child(
        """
        import threading
        readings["before"] = own_memory_by_kind(os.getpid())

        def allocate():
            # Over CPython's small-object limit, so each buffer comes from malloc: this thread's arena.
            buffers = [bytearray(2000) for _ in range(40_000)]
            readings["during"] = own_memory_by_kind(os.getpid())

        thread = threading.Thread(target=allocate)
        thread.start()
        thread.join()
        """
    )
    before, during = readings["before"], readings["during"]
    assert during["malloc arenas"] - before["malloc arenas"] == pytest.approx(80, abs=8)
    assert during["other anonymous"] - before["other anonymous"] < 4
