"""The heap thresholds: the gateway keeps audio-sized blocks in its heap; the Piper stub gives
large blocks back to the kernel, also once glibc's own threshold would have risen past them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tts_gateway.allocator import MMAP_THRESHOLD

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# Run in a fresh interpreter, whose allocator still has glibc's defaults: prints whether a 2 MiB
# block got an anonymous mapping of its own (mmap, unmapped when freed) rather than a place in the
# heap. ``argv[2] == "after-free"`` first frees an 8 MiB block, which raises glibc's default
# threshold above 8 MiB.
_PROBE = textwrap.dedent(
    """
    import sys
    from tts_gateway.allocator import keep_audio_buffers_in_heap
    from tts_gateway.models.piper.onnx_memory import return_freed_blocks

    if sys.argv[1] == "gateway":
        assert keep_audio_buffers_in_heap()
    elif sys.argv[1] == "piper":
        assert return_freed_blocks()

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
    block = bytearray(2 * 1024 * 1024)
    print(any(size(line) >= len(block) for line in mappings() - before))
    """
)


def _own_mapping(tuning: str, history: str = "fresh") -> bool:
    result = subprocess.run([sys.executable, "-c", _PROBE, tuning, history], capture_output=True, text=True, check=True)
    return result.stdout.strip() == "True"


def test_an_audio_sized_block_comes_from_the_heap_once_tuned() -> None:
    assert MMAP_THRESHOLD > 2 * 1024 * 1024
    assert _own_mapping("default"), "glibc's default threshold (128 KiB) should map a 2 MiB block by itself"
    assert not _own_mapping("gateway")


def test_the_piper_stub_maps_large_blocks_also_after_larger_ones_were_freed() -> None:
    assert not _own_mapping("default", "after-free"), "glibc's risen threshold should put the block in the heap"
    assert _own_mapping("piper", "after-free")
