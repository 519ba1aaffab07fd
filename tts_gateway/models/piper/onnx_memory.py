"""An ONNX Runtime session whose memory returns to its idle size after each run.

ONNX Runtime serves a session's tensors from an arena that grows to the largest input seen
(by powers of two) and by default keeps it for the life of the session. A Piper voice's
tensors grow with the sentence, so a long-running server's memory climbed with every longer
sentence and never came back, looking like a leak. :data:`RUN_OPTIONS` asks the arena to
release what it grew beyond its first block at the end of every run; :func:`return_freed_blocks`
makes glibc hand such large blocks straight back to the kernel rather than keep them in the
heap, which its default (a threshold that rises as large blocks are freed) ends up doing.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import onnxruntime

from tts_gateway.allocator import set_malloc_thresholds

# Arena shrinkage at the end of each run, for the CPU arena (device 0).
SHRINK_CONFIG_KEY: Final = "memory.enable_memory_arena_shrinkage"
SHRINK_CONFIG_VALUE: Final = "cpu:0"

# Blocks from here up are mmap'ed and unmapped on free; smaller ones are reused from the heap.
MMAP_THRESHOLD: Final = 1024 * 1024


def run_options() -> onnxruntime.RunOptions:
    """Options for every run of the session: the arena shrinks back when the run ends."""
    options = onnxruntime.RunOptions()
    options.add_run_config_entry(SHRINK_CONFIG_KEY, SHRINK_CONFIG_VALUE)
    return options


class ShrinkingSession:
    """An ``InferenceSession`` whose ``run`` always passes :func:`run_options`.

    Piper's ``PiperVoice`` calls ``session.run(outputs, feeds)``; this stands in for its session.
    """

    def __init__(self, session: onnxruntime.InferenceSession) -> None:
        self.session = session
        self.run_options = run_options()

    def run(self, output_names: list[str] | None, input_feed: dict[str, np.ndarray]) -> list[Any]:
        return self.session.run(output_names, input_feed, self.run_options)


def return_freed_blocks() -> bool:
    """Fix glibc's mmap threshold for this process; ``False`` where there is no glibc ``mallopt``."""
    return set_malloc_thresholds(mmap_threshold=MMAP_THRESHOLD)
