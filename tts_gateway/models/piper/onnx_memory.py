"""Memory of a process that runs a Piper voice: back to its idle size after every request.

A Piper voice's tensors grow with the sentence, up to hundreds of MiB for a long one. ONNX
Runtime's default arena keeps them; shrinking it at the end of each run frees only the regions
with nothing left in them, and the run's output is still alive then: the region that holds it,
often one of the largest, stays until a later run. Memory at rest is then whatever the last
sentences left behind, up to a few hundred MiB. :func:`session_options` turns the arena off: a
tensor goes back to ``malloc`` as soon as ONNX Runtime is done with it. It also turns off memory
patterns: ONNX Runtime keeps one allocation plan per set of input shapes it has seen, and every
sentence length is a new shape (40 new lengths left 2.2 MiB allocated with them, 0.2 MiB
without). Runs took no longer without them.

:func:`tune_heap` then tunes glibc for the process. Blocks up to 32 MiB stay in the heap and are
reused within a run: mapping each large tensor anew and faulting its pages in took about 40 %
more CPU per sentence. :func:`~tts_gateway.allocator.release_free_memory`, called when a request
ends, gives the free pages inside the heaps back, and the main heap's free top; the free top of a
thread's own heap (glibc gives threads that allocate heaps of their own, two at most as the server
starts it: ``SERVER_MALLOC_ENV``)
is out of its reach, and goes back as blocks are freed once it passes the trim threshold, kept
small for that reason (a larger one saved ~4 % of the CPU).
"""

from __future__ import annotations

from typing import Final

import onnxruntime

from tts_gateway.allocator import set_malloc_thresholds

# Blocks from here up are mmap'ed and unmapped on free; glibc takes no larger value.
MMAP_THRESHOLD: Final = 32 * 1024 * 1024
# Free memory kept at the top of a heap; what ``malloc_trim`` cannot reach at rest.
TRIM_THRESHOLD: Final = 1024 * 1024


def session_options() -> onnxruntime.SessionOptions:
    """Options for a voice's session: no CPU arena and no memory patterns, so tensors are freed when done
    with and nothing is kept per sentence length."""
    options = onnxruntime.SessionOptions()
    options.enable_cpu_mem_arena = False
    options.enable_mem_pattern = False
    return options


def tune_heap() -> bool:
    """Tune glibc for this process as above; ``False`` where there is no glibc ``mallopt``."""
    return set_malloc_thresholds(mmap_threshold=MMAP_THRESHOLD, trim_threshold=TRIM_THRESHOLD)
