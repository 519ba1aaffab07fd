"""Steps of the CUDA memory a process holds, worth a log line each.

torch's caching allocator keeps what a process's largest work took and does not hand it back, so
a model's CUDA memory climbs when its load first needs more and then stays there: a high-water
mark, not a leak. Logging each step with the work that took it shows which it is, and which work
sets the mark an operator has to size the GPU for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import torch

# Smaller rises go unlogged (the allocator reserves in segments of a few MiB while a load builds up).
MIN_STEP_BYTES: Final = 64 << 20
# How a step's log line begins: the memory soak's report collects the lines by it.
STEP_LOG_PREFIX: Final = "CUDA memory reserved rose"


def describe_step(rise: tuple[int, int]) -> str:
    """The start of a step's log line: what the memory rose from and to, in MiB."""
    return f"{STEP_LOG_PREFIX} from {rise[0] >> 20} to {rise[1] >> 20} MiB"


class ReservedMemoryWatch:
    """The most memory ``read`` has reported, and each rise of at least ``min_step`` bytes above it."""

    def __init__(self, read: Callable[[], int], *, min_step: int = MIN_STEP_BYTES) -> None:
        self._read = read
        self._min_step = min_step
        self.high = read()

    @classmethod
    def for_device(cls, device: torch.device) -> ReservedMemoryWatch | None:
        """A watch over the memory torch has reserved on a CUDA ``device``; None elsewhere."""
        if device.type != "cuda":
            return None
        return cls(lambda: torch.cuda.memory_reserved(device))

    def rise(self) -> tuple[int, int] | None:
        """(before, now) in bytes when the memory rose by ``min_step`` or more since the last rise."""
        now = self._read()
        if now - self.high < self._min_step:
            return None
        before, self.high = self.high, now
        return before, now
