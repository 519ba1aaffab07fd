"""glibc ``malloc`` settings for processes that move audio-sized buffers: the gateway, tritonserver, model stubs.

A 5 s response passes through a ~0.5 MB float32 array and ~0.25 MB of bytes several times. By default
glibc serves blocks above its mmap threshold (128 KiB at start, raised as such blocks are freed) with
fresh ``mmap`` calls, and returns the top of the heap to the kernel once more than twice that is free
there. Each request then faulted its buffers in anew, page by page: on the 2-core benchmark machine
encoding 5 s of wav took ~0.75 ms in the gateway against ~0.25 ms with the thresholds below, and the
whole response ~1 ms longer (``benchmarks/bench.py``, concurrency 1). Fixed thresholds keep such
blocks in the heap; memory freed at the top of it is returned once 32 MiB have gathered there.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Final, cast

logger = logging.getLogger(__name__)

# mallopt(3) parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
_M_ARENA_MAX: Final = -8
MMAP_THRESHOLD: Final = 4 * 1024 * 1024
TRIM_THRESHOLD: Final = 32 * 1024 * 1024
GATEWAY_ARENAS: Final = 1
# tritonserver (Triton's C++, which this project cannot make call ``mallopt``) takes glibc's settings
# from its environment. By default glibc serves every buffer up to the largest one freed so far from
# a heap, one per thread up to 8 per core, and returns a heap's free top only once it passes twice
# that size: the server's memory at rest followed the longest responses of the last minutes (68-73 MiB
# on the CPU default under the memory soak's load, moving by a few MiB from one rest to the next).
# Output buffers from 1 MiB up mapped on their own and two heaps kept it at 46-47 MiB. The trim
# threshold stays at glibc's starting value: with 4 MiB free at a heap's top the memory at rest still
# moved by half a MiB from one rest to the next (+1.2 % in a 30-minute soak), with 128 KiB +0.3 %.
SERVER_MALLOC_ENV: Final[Mapping[str, str]] = {
    "MALLOC_ARENA_MAX": "2",
    "MALLOC_MMAP_THRESHOLD_": str(1024 * 1024),
    "MALLOC_TRIM_THRESHOLD_": str(128 * 1024),
}
# The model processes inherit the server's environment. With a 1 MiB mmap threshold a model on the CPU
# would map and fault in every tensor of a MiB or more anew (Piper's voice took about 40 % more CPU per
# sentence that way); the values glibc's own thresholds rise to for such blocks keep them in the heap.
MODEL_MMAP_THRESHOLD: Final = 32 * 1024 * 1024
MODEL_TRIM_THRESHOLD: Final = 64 * 1024 * 1024


def server_malloc_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings of :data:`SERVER_MALLOC_ENV` that ``environ`` leaves open: an operator's own values
    win, and an operator who tunes ``malloc`` through ``GLIBC_TUNABLES`` gets none of them."""
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return {}
    return {name: value for name, value in SERVER_MALLOC_ENV.items() if name not in environ}


def worker_malloc_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``MALLOC_ARENA_MAX`` for the gateway's spawned worker processes, unless ``environ`` tunes it already.

    uvicorn starts a thread in each worker (its answer to the supervisor's pings) before the app exists, so
    :func:`limit_malloc_arenas` in ``create_app`` came after that thread had been given a heap of its own.
    The worker's later threads were then dealt to both heaps (4-27 MiB of a worker's memory at rest was in
    the second), and ``malloc_trim`` cannot return the free top of any heap but the main one, which keeps up
    to the 32 MiB trim threshold. On 2 cores, 4 workers at concurrency 64, a worker's anonymous memory at
    rest grew by 0.4-2.1 % over 3 min of load with the second heap, by 0-0.7 % over 4.5 min with one. glibc
    reads its environment as the process starts, before any thread exists.
    """
    if "MALLOC_ARENA_MAX" in environ or "glibc.malloc.arena_max" in environ.get("GLIBC_TUNABLES", ""):
        return {}
    return {"MALLOC_ARENA_MAX": str(GATEWAY_ARENAS)}


def keep_audio_buffers_in_heap() -> bool:
    """Set the thresholds for this process; ``False`` where the C library has no glibc ``mallopt``."""
    return set_malloc_thresholds(mmap_threshold=MMAP_THRESHOLD, trim_threshold=TRIM_THRESHOLD)


def keep_tensors_in_heap() -> bool:
    """Set a model process's thresholds (:data:`MODEL_MMAP_THRESHOLD`); ``False`` without glibc ``mallopt``."""
    return set_malloc_thresholds(mmap_threshold=MODEL_MMAP_THRESHOLD, trim_threshold=MODEL_TRIM_THRESHOLD)


def limit_malloc_arenas(arenas: int = GATEWAY_ARENAS) -> bool:
    """Let glibc create at most ``arenas`` heaps for this process's threads.

    glibc gives each thread that allocates a heap of its own, up to 8 per core. :func:`release_free_memory`
    returns the free pages inside every heap, but the free top of the main heap only: a thread's heap
    keeps its top (up to the trim threshold, 32 MiB here) and the fragments of the audio-sized blocks
    that passed through it. The gateway's resident memory at rest then followed which of its threads
    (gRPC's, the encoders', the normaliser's) had handled the last responses, and crept up from one
    batch of requests to the next. With one heap all of it is within the trim's reach; the gateway's
    Python code runs one thread at a time anyway. glibc fixes its limit for good once it has made more
    than eight heaps: call this early. ``False`` where the C library has no glibc ``mallopt``.
    """
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(_M_ARENA_MAX, arenas))


def set_malloc_thresholds(*, mmap_threshold: int, trim_threshold: int | None = None) -> bool:
    """Fix glibc's mmap threshold (and the trim threshold, if given) for this process.

    A fixed threshold also stops glibc from raising it as large blocks are freed. ``False`` where
    the C library has no glibc ``mallopt`` or it refused a value.
    """
    mallopt = _mallopt()
    if mallopt is None:
        return False
    applied = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold))
    if trim_threshold is not None:
        applied = applied and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    if not applied:
        logger.debug("mallopt refused the heap thresholds; the allocator keeps its defaults")
    return applied


def release_free_memory() -> bool:
    """Give the pages of the free blocks in every heap back to the kernel (glibc ``malloc_trim(0)``).

    The free top of a thread's own heap stays (up to the trim threshold). ``False`` where there is
    no glibc ``malloc_trim`` or nothing was returned.
    """
    malloc_trim = _malloc_trim()
    return malloc_trim is not None and bool(malloc_trim(0))


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return cast("Callable[[int, int], int]", mallopt)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, looked up once: a Piper stub calls it after every request."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    malloc_trim.argtypes = (ctypes.c_size_t,)
    malloc_trim.restype = ctypes.c_int
    return cast("Callable[[int], int]", malloc_trim)
