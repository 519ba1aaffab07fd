"""The heap tuning: the gateway keeps audio-sized blocks in its heap; the Piper stub keeps tensor-sized
blocks of every thread in its one heap, and gives their pages back when asked."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tts_gateway.allocator import MMAP_THRESHOLD

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# Run in a fresh interpreter, whose allocator still has glibc's defaults: prints whether a
# block got an anonymous mapping of its own (mmap, unmapped when freed, or a thread's own arena)
# rather than a place in the heap. ``argv[2] == "after-free"`` first frees an 8 MiB block, which
# raises glibc's default threshold above 8 MiB; ``argv[3]`` is the block's size in MiB, allocated
# by a new thread when ``argv[4] == "thread"``.
_PROBE = textwrap.dedent(
    """
    import sys
    import threading
    from tts_gateway.allocator import keep_audio_buffers_in_heap, set_malloc_thresholds
    from tts_gateway.models.piper.onnx_memory import MMAP_THRESHOLD, TRIM_THRESHOLD, use_one_heap

    if sys.argv[1] == "gateway":
        assert keep_audio_buffers_in_heap()
    elif sys.argv[1] == "piper":
        assert use_one_heap()
    elif sys.argv[1] == "two-arenas":  # the Piper stub's thresholds, but an arena per thread
        assert set_malloc_thresholds(mmap_threshold=MMAP_THRESHOLD, trim_threshold=TRIM_THRESHOLD)

    def mappings():
        lines = open("/proc/self/maps").read().splitlines()
        return {line for line in lines if "[heap]" not in line}

    def size(line):
        start, end = line.split()[0].split("-")
        return int(end, 16) - int(start, 16)

    if sys.argv[2] == "after-free":
        freed = bytearray(8 * 1024 * 1024)
        del freed
    before = mappings()
    blocks = []
    allocate = lambda: blocks.append(bytearray(int(sys.argv[3]) * 1024 * 1024))
    if sys.argv[4] == "thread":
        worker = threading.Thread(target=allocate)
        worker.start()
        worker.join()
    else:
        allocate()
    print(any(size(line) >= len(blocks[0]) for line in mappings() - before))
    """
)


def _own_mapping(tuning: str, history: str = "fresh", mib: int = 2, thread: str = "main") -> bool:
    command = [sys.executable, "-c", _PROBE, tuning, history, str(mib), thread]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return result.stdout.strip() == "True"


def test_an_audio_sized_block_comes_from_the_heap_once_tuned() -> None:
    assert MMAP_THRESHOLD > 2 * 1024 * 1024
    assert _own_mapping("default"), "glibc's default threshold (128 KiB) should map a 2 MiB block by itself"
    assert not _own_mapping("gateway")


def test_the_piper_stub_keeps_a_threads_tensor_sized_block_in_its_heap() -> None:
    # Larger than a thread's stack (8 MiB), which is a new mapping too.
    assert _own_mapping("default", mib=16, thread="thread"), "glibc maps a 16 MiB block by itself"
    assert _own_mapping("two-arenas", mib=16, thread="thread"), "a new thread gets an arena of its own"
    assert not _own_mapping("piper", "after-free", mib=16, thread="thread")


# Frees a 16 MiB block at the top of the heap, which the trim threshold keeps, and prints how many
# KiB of the heap are resident before and after release_free_memory().
_RELEASE_PROBE = textwrap.dedent(
    """
    from tts_gateway.allocator import release_free_memory
    from tts_gateway.models.piper.onnx_memory import use_one_heap

    assert use_one_heap()

    def heap_kib():
        lines = open("/proc/self/smaps").read().splitlines()
        start = next(i for i, line in enumerate(lines) if line.endswith("[heap]"))
        return next(int(line.split()[1]) for line in lines[start:] if line.startswith("Rss:"))

    block = bytearray(16 * 1024 * 1024)
    del block
    kept = heap_kib()
    release_free_memory()
    print(kept, heap_kib())
    """
)


def test_release_free_memory_gives_the_freed_pages_back() -> None:
    result = subprocess.run([sys.executable, "-c", _RELEASE_PROBE], capture_output=True, text=True, check=True)
    kept, released = map(int, result.stdout.split())
    assert kept - released >= 15 * 1024
