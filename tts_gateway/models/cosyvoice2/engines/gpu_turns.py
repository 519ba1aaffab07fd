"""First chunks before run-ahead decoding: token2wav asks the LLM's process to leave it the GPU.

The LLM and token2wav are two processes of one Triton server, and a GPU runs one process's
work at a time, in time slices (CUDA MPS shares it instead, but slows every decode step by about
a third). While a stream's first chunk is converted, the LLM keeps decoding the rest of the text
for the streams it serves, far ahead of real time when they are few: on an H100 one stream's
first chunk took token2wav 121 ms beside the decoding LLM and 57 ms alone. So token2wav marks in
a small file of shared memory when a group of first chunks is on the GPU, and the LLM engine,
when it decodes for a few requests only, all past their own first chunk, waits before its next
step while the mark stands (a request arriving ends the wait: its prefill goes first).

The mark is a ``time.monotonic_ns()`` stamp per token2wav instance (0: none); a stamp older than
``stale_s`` is ignored, so a token2wav process that died holding it does not stall the LLM, and
the LLM waits at most ``max_wait_s`` per step. Both processes are children of one tritonserver;
the file is named after it and the GPU, so separate servers or GPUs do not see each other's marks.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

_SLOTS = 8
_STAMP = struct.Struct("<q")
_SIZE = _SLOTS * _STAMP.size
_POLL_S = 0.0005


class GpuTurns:
    """The shared marks of one server's token2wav instances."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)

    @classmethod
    def of_server(cls, gpu: int, server_pid: int | None = None) -> GpuTurns:
        """The marks shared on GPU ``gpu`` by the model processes of the server ``server_pid`` (default:
        this process's parent)."""
        pid = os.getppid() if server_pid is None else server_pid
        return cls(Path(tempfile.gettempdir()) / f"tts-gpu-turns-{pid}-gpu{gpu}")

    @contextmanager
    def hold(self, instance: int = 0) -> Iterator[None]:
        """Mark the GPU as wanted by token2wav instance ``instance`` for the duration of the block."""
        offset = (instance % _SLOTS) * _STAMP.size
        _STAMP.pack_into(self._map, offset, time.monotonic_ns())
        try:
            yield
        finally:
            _STAMP.pack_into(self._map, offset, 0)

    def held(self, stale_s: float) -> bool:
        """Whether a mark younger than ``stale_s`` stands (one from the future, left by a process of an
        earlier boot in a file that survived it, does not count)."""
        now = time.monotonic_ns()
        oldest = now - int(stale_s * 1e9)
        return any(oldest < stamp <= now for (stamp,) in _STAMP.iter_unpack(self._map))

    def wait(self, max_wait_s: float, stale_s: float, stop: Callable[[], bool] = lambda: False) -> float:
        """Wait while a mark stands and ``stop()`` does not hold, at most ``max_wait_s``; returns the
        seconds waited."""
        started = time.monotonic()
        while self.held(stale_s) and not stop() and time.monotonic() - started < max_wait_s:
            time.sleep(_POLL_S)
        return time.monotonic() - started

    def close(self) -> None:
        self._map.close()

    def remove(self) -> None:
        """Delete the file (the LLM's process does, when it stops)."""
        self.close()
        self.path.unlink(missing_ok=True)


class YieldToFirstChunks:
    """The LLM engine's gate: before a decode step, wait while token2wav holds the GPU for first chunks,
    when the engine decodes for ``max_rows`` requests or fewer and every one of them made at least
    ``after_tokens`` tokens (its own first chunk's worth: pausing a request still short of it only
    moves one stream's first audio behind another's). With more requests the LLM is the bottleneck
    and never waits."""

    def __init__(
        self,
        turns: GpuTurns,
        *,
        max_rows: int = 4,
        after_tokens: int = 0,
        max_wait_s: float = 0.2,
        stale_s: float = 0.5,
    ) -> None:
        self._turns = turns
        self._max_rows = max_rows
        self._after_tokens = after_tokens
        self._max_wait_s = max_wait_s
        self._stale_s = stale_s

    def busy(self, produced: Sequence[int]) -> bool:
        return (
            0 < len(produced) <= self._max_rows
            and min(produced) >= self._after_tokens
            and self._turns.held(self._stale_s)
        )

    def wait(self, stop: Callable[[], bool]) -> float:
        return self._turns.wait(self._max_wait_s, self._stale_s, stop)
