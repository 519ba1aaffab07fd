"""Free heap handed back to the kernel once the gateway falls idle.

:func:`tts_gateway.allocator.keep_audio_buffers_in_heap` lets each heap keep up to 32 MiB free, so
that responses reuse their buffers instead of faulting them in anew. At rest that memory serves
nobody, and how much of it there is depends on the last responses: on the CPU default, RSS at rest
moved between 164 and 185 MiB from one batch of requests to the next, and ``malloc_trim`` took
15-20 MiB off every time, to within a few MiB of one floor. So shortly after the last response ends,
with none begun since, the free pages go back; under load nothing is trimmed.

Before the trim, Python's cyclic garbage is collected. A response that ends by an exception (a client
that leaves, a timeout) leaves its frames in reference cycles through the exception's traceback, and
with them its encoder's FFmpeg state and its audio; only a full pass of the cyclic collector frees
them, and at rest, allocating nothing, the interpreter never starts one. On the CPU profile driven past
its capacity (64 listeners, two cores), a gateway worker at rest held 4,326 such objects, among them 28
cancellations with 428 tracebacks and 344 frames, 94 async generators and 40 FFmpeg filters. What the
gateway made while starting is frozen out of those passes (:func:`freeze_startup_objects`): a full
pass over it took about 50 ms, and 1 ms without it in a running gateway.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable

from tts_gateway.allocator import release_free_memory

logger = logging.getLogger(__name__)

# Long enough that back-to-back requests never trim between them, short enough that a gateway
# at rest is at its floor by the time anyone looks.
IDLE_DELAY_S = 2.0


def freeze_startup_objects() -> None:
    """Keep what exists now (the app, its services, the grammars) out of every later collection.

    A full pass over these ~95,000 objects held the event loop for about 50 ms. The price: one of them
    that later becomes cyclic garbage (a Triton client retired when the pool resolves its names again)
    is never freed; that is bounded by what starting made, once. :func:`gc.unfreeze` at shutdown hands
    them back.
    """
    gc.collect()
    gc.freeze()


class IdleMemoryRelease:
    """Counts responses in progress; ``delay_s`` after the count drops to zero and stays there, collects
    the cyclic garbage once and then runs ``release`` on a worker thread (a trim walks every heap:
    milliseconds, not for the event loop). The collection runs on the loop's thread: it holds the GIL
    wherever it runs, and there the finalizers it calls (a coroutine's ``finally``, a gRPC call's
    teardown) run where their objects live."""

    def __init__(
        self,
        delay_s: float = IDLE_DELAY_S,
        release: Callable[[], object] = release_free_memory,
        collect: Callable[[], object] = gc.collect,
    ) -> None:
        self._delay_s = delay_s
        self._release = release
        self._collect = collect
        self._active = 0
        self._timer: asyncio.TimerHandle | None = None

    @property
    def active(self) -> int:
        return self._active

    def begin(self) -> None:
        """A response starts: no trim until every response has ended."""
        self._active += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def end(self) -> None:
        """A response ended (finished, failed or cancelled)."""
        self._active -= 1
        if self._active:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # a response closed by the garbage collector, outside the loop: the next one trims
        self._timer = loop.call_later(self._delay_s, self._idle)

    def _idle(self) -> None:
        self._timer = None
        if self._active:
            return
        self._collect()
        asyncio.get_running_loop().run_in_executor(None, self._run_release)

    def _run_release(self) -> None:
        try:
            self._release()
        except Exception:
            logger.exception("returning free memory to the kernel failed")
