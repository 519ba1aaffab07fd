"""Own memory by kind of mapping: the layout rules on a written smaps, and a live process read as it grows."""

from __future__ import annotations

import mmap
import os
import threading

import pytest

from benchmarks.memory_maps import KINDS, own_by_kind, own_memory_by_kind, parse_smaps
from benchmarks.memory_soak import rss_mib

MIB = 1024 * 1024
ARENA = 0x7F0000000000  # aligned to 64 MiB


def smaps_entry(start: int, end: int, perms: str, anonymous_kib: int, name: str = "") -> str:
    return (
        f"{start:x}-{end:x} {perms} 00000000 00:00 0          {name}\n"
        f"Size:           {(end - start) // 1024} kB\n"
        f"Rss:            {anonymous_kib} kB\n"
        f"Anonymous:      {anonymous_kib} kB\n"
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
        # A thread's stack above its guard page.
        smaps_entry(0x7F1000000000, 0x7F1000001000, "---p", 0),
        smaps_entry(0x7F1000001000, 0x7F1000801000, "rw-p", 256),
        # Memory mapped outside malloc, though followed by an inaccessible mapping: not aligned as a heap.
        smaps_entry(0x7F2000001000, 0x7F2000101000, "rw-p", 512),
        smaps_entry(0x7F2000101000, 0x7F2000201000, "---p", 0),
        smaps_entry(0x7F3000000000, 0x7F3000010000, "rw-p", 3072, "/opt/lib dir/libfoo.so"),
        smaps_entry(0x7FFC00000000, 0x7FFC00021000, "rw-p", 132, "[stack]"),
    ]
)


def test_each_mapping_is_counted_by_the_layout_that_tells_its_kind() -> None:
    mappings = parse_smaps(SMAPS)
    assert len(mappings) == 11
    assert mappings[-2].name == "/opt/lib dir/libfoo.so"
    assert own_by_kind(mappings) == {
        "malloc heap": 1.0,
        "malloc arenas": 6.0,
        "thread stacks": 0.2,
        "other anonymous": 0.5,
        "file copies": 3.0,
        "main stack": 0.1,
    }


def test_a_live_process_memory_is_split_without_losing_any() -> None:
    kinds = own_memory_by_kind(os.getpid())
    assert tuple(kinds) == KINDS
    assert sum(kinds.values()) == pytest.approx(rss_mib(os.getpid())[" own"], abs=4)


def test_memory_mapped_outside_malloc_grows_other_anonymous() -> None:
    before = own_memory_by_kind(os.getpid())
    private = mmap.mmap(-1, 48 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        private.write(b"x" * len(private))
        after = own_memory_by_kind(os.getpid())
    finally:
        private.close()
    assert after["other anonymous"] - before["other anonymous"] == pytest.approx(48, abs=4)
    assert after["malloc arenas"] - before["malloc arenas"] < 4


def test_what_a_thread_allocates_through_malloc_lands_in_malloc_memory() -> None:
    before = own_memory_by_kind(os.getpid())
    grown: dict[str, float] = {}

    def allocate() -> None:
        # Over CPython's small-object limit, so each buffer comes from malloc (this thread's arena).
        buffers = [bytearray(2000) for _ in range(40_000)]
        grown.update(own_memory_by_kind(os.getpid()))
        del buffers

    thread = threading.Thread(target=allocate)
    thread.start()
    thread.join()
    in_malloc = sum(grown[kind] - before[kind] for kind in ("malloc heap", "malloc arenas"))
    assert in_malloc == pytest.approx(80, abs=12)
    assert grown["other anonymous"] - before["other anonymous"] < 8
