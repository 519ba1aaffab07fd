"""The heap thresholds: an audio-sized block comes from the heap, not from a mapping of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tts_gateway.gateway.allocator import MMAP_THRESHOLD

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# Run in a fresh interpreter, whose allocator still has glibc's defaults: prints whether a 2 MiB
# block got an anonymous mapping of its own (mmap) rather than a place in the heap.
_PROBE = textwrap.dedent(
    """
    import sys
    from tts_gateway.gateway.allocator import keep_audio_buffers_in_heap

    if sys.argv[1] == "tuned":
        assert keep_audio_buffers_in_heap()

    def mappings():
        lines = open("/proc/self/maps").read().splitlines()
        return {line for line in lines if "[heap]" not in line}

    def size(line):
        start, end = line.split()[0].split("-")
        return int(end, 16) - int(start, 16)

    before = mappings()
    block = bytearray(2 * 1024 * 1024)
    print(any(size(line) >= len(block) for line in mappings() - before))
    """
)


def _own_mapping(mode: str) -> bool:
    result = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return result.stdout.strip() == "True"


def test_an_audio_sized_block_comes_from_the_heap_once_tuned() -> None:
    assert MMAP_THRESHOLD > 2 * 1024 * 1024
    assert _own_mapping("default"), "glibc's default threshold (128 KiB) should map a 2 MiB block by itself"
    assert not _own_mapping("tuned")
