"""The heap tuning: the gateway keeps audio-sized blocks in its heap and few heaps for its threads; the
Piper stub keeps tensor-sized blocks in its heap too, and gives the pages of the freed ones back when a
request ends; tritonserver's environment maps large blocks on their own and limits the heaps, and a
model process that inherits it keeps its tensors in the heap again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping

import pytest

from tts_gateway.allocator import GATEWAY_ARENAS, MMAP_THRESHOLD, SERVER_MALLOC_ENV, worker_malloc_env
from tts_gateway.gateway import cli
from tts_gateway.gateway.settings import Settings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# Run in a fresh interpreter, whose allocator still has glibc's defaults: prints whether a 2 MiB
# block of ``argv[3]`` MiB got an anonymous mapping of its own (mmap, unmapped when freed) rather
# than a place in the heap. ``argv[2] == "after-free"`` first frees an 8 MiB block, which raises
# glibc's default threshold above 8 MiB.
_PROBE = textwrap.dedent(
    """
    import sys
    from tts_gateway.allocator import keep_audio_buffers_in_heap, keep_tensors_in_heap
    from tts_gateway.models.piper.onnx_memory import tune_heap

    if sys.argv[1] == "gateway":
        assert keep_audio_buffers_in_heap()
    elif sys.argv[1] == "piper":
        assert tune_heap()
    elif sys.argv[1] == "model":
        assert keep_tensors_in_heap()

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
    block = bytearray(int(sys.argv[3]) * 1024 * 1024)
    print(any(size(line) >= len(block) for line in mappings() - before))
    """
)


def _own_mapping(tuning: str, history: str = "fresh", mib: int = 2, env: Mapping[str, str] | None = None) -> bool:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, tuning, history, str(mib)],
        capture_output=True,
        text=True,
        check=True,
        env={**_glibc_defaults(), **(env or {})},
    )
    return result.stdout.strip() == "True"


def _glibc_defaults() -> dict[str, str]:
    """This environment without any malloc settings of its own."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}


def test_an_audio_sized_block_comes_from_the_heap_once_tuned() -> None:
    assert MMAP_THRESHOLD > 2 * 1024 * 1024
    assert _own_mapping("default"), "glibc's default threshold (128 KiB) should map a 2 MiB block by itself"
    assert not _own_mapping("gateway")


def test_the_servers_environment_maps_large_blocks_and_a_model_process_takes_them_back_into_its_heap() -> None:
    assert not _own_mapping("default", "after-free", mib=4), "glibc's default threshold rises as blocks are freed"
    assert _own_mapping("default", "after-free", mib=4, env=SERVER_MALLOC_ENV)
    assert not _own_mapping("model", "after-free", mib=4, env=SERVER_MALLOC_ENV)


def test_the_piper_stub_keeps_tensor_sized_blocks_in_its_heap() -> None:
    assert _own_mapping("default", mib=16), "glibc's default threshold should map a 16 MiB block by itself"
    assert not _own_mapping("piper", "after-free", mib=16)


# In a fresh interpreter: the main thread, then a new thread (which glibc gives an arena of its
# own), each fills a 16 MiB block and frees it; prints by how many KiB the resident memory grew
# once release_free_memory() has run.
_RELEASE_PROBE = textwrap.dedent(
    """
    import sys
    import threading
    from tts_gateway.allocator import release_free_memory, set_malloc_thresholds
    from tts_gateway.models.piper.onnx_memory import MMAP_THRESHOLD, tune_heap

    if sys.argv[1] == "piper":
        assert tune_heap()
    else:  # the same, but a heap keeps up to 32 MiB free at its top
        assert set_malloc_thresholds(mmap_threshold=MMAP_THRESHOLD, trim_threshold=32 * 1024 * 1024)

    def rss_kib():
        status = open("/proc/self/status").read().splitlines()
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))

    def fill_and_free():
        block = bytearray(16 * 1024 * 1024)
        block[:] = b"\x01" * len(block)
        del block

    before = rss_kib()
    fill_and_free()
    worker = threading.Thread(target=fill_and_free)
    worker.start()
    worker.join()
    release_free_memory()
    print(rss_kib() - before)
    """
)


def _kept_kib(tuning: str) -> int:
    result = subprocess.run([sys.executable, "-c", _RELEASE_PROBE, tuning], capture_output=True, text=True, check=True)
    return int(result.stdout)


def test_the_piper_stub_gives_freed_pages_back_from_every_thread() -> None:
    assert _kept_kib("keep-top") >= 12 * 1024, "a 32 MiB trim threshold keeps a thread's freed 16 MiB"
    assert _kept_kib("piper") < 4 * 1024


# In a fresh interpreter: twelve threads, alive at once, each allocate through the C library (glibc
# gives each new thread a heap of its own while it may create more); prints the number of heaps
# glibc's malloc_info then lists. ``late-gateway``: one thread has allocated before the heaps are
# limited, as uvicorn's worker starts one before the app exists.
_ARENA_PROBE = textwrap.dedent(
    """
    import ctypes
    import sys
    import tempfile
    import threading
    from tts_gateway.allocator import limit_malloc_arenas

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    if sys.argv[1] == "late-gateway":
        allocated = threading.Event()

        def early():
            libc.malloc(4096)
            allocated.set()
            threading.Event().wait()

        threading.Thread(target=early, daemon=True).start()
        allocated.wait()
    if sys.argv[1] in ("gateway", "late-gateway"):
        assert limit_malloc_arenas()
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
    libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.fclose.argtypes = (ctypes.c_void_p,)
    together = threading.Barrier(13)

    def allocate():
        libc.malloc(4096)  # never freed: the block keeps its heap in use
        together.wait()
        together.wait()

    threads = [threading.Thread(target=allocate) for _ in range(12)]
    for thread in threads:
        thread.start()
    together.wait()
    with tempfile.NamedTemporaryFile(suffix=".xml") as report:
        stream = libc.fopen(report.name.encode(), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        heaps = open(report.name).read().count("<heap nr=")
    together.wait()
    for thread in threads:
        thread.join()
    print(heaps)
    """
)


def _heaps(tuning: str, env: Mapping[str, str] | None = None) -> int:
    result = subprocess.run(
        [sys.executable, "-c", _ARENA_PROBE, tuning],
        capture_output=True,
        text=True,
        check=True,
        env={**_glibc_defaults(), **(env or {})},
    )
    return int(result.stdout)


def test_the_gateways_threads_share_few_heaps() -> None:
    assert _heaps("default") > GATEWAY_ARENAS + 4, "glibc gives each of the first eight threads a heap by default"
    assert _heaps("gateway") <= GATEWAY_ARENAS


def test_the_servers_threads_share_two_heaps() -> None:
    assert _heaps("default", env=SERVER_MALLOC_ENV) <= int(SERVER_MALLOC_ENV["MALLOC_ARENA_MAX"])


def test_a_gateway_workers_threads_share_one_heap_though_one_allocated_before_the_app(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _heaps("late-gateway") > GATEWAY_ARENAS, "a thread that allocates before the limit keeps a heap of its own"
    # What _serve_workers puts in the environment stays in this copy of it.
    monkeypatch.setattr(os, "environ", _glibc_defaults())
    spawned: dict[str, str] = {}
    monkeypatch.setattr(cli.uvicorn, "run", lambda *args, **kwargs: spawned.update(os.environ))
    cli._serve_workers(Settings(triton_url="127.0.0.1:8001", workers=2), {})
    worker_env = {name: value for name, value in spawned.items() if name.startswith("MALLOC_")}
    assert _heaps("late-gateway", env=worker_env) <= GATEWAY_ARENAS


def test_an_operators_own_arena_setting_reaches_the_workers_unchanged() -> None:
    assert worker_malloc_env({}) == {"MALLOC_ARENA_MAX": str(GATEWAY_ARENAS)}
    assert worker_malloc_env({"MALLOC_ARENA_MAX": "4"}) == {}
    assert worker_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}) == {}
