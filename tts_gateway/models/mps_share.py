"""The share of the GPU's multiprocessors a model process may fill beside the other clients of its MPS server.

Under CUDA MPS the LLM's and token2wav's processes run their kernels side by side
(``gateway/embedded/cuda_mps.py``). The LLM decodes in steps of a few hundred short kernels that
each need only a few multiprocessors; token2wav's flow launches products large enough to fill every
multiprocessor, and a kernel that finds them full waits until blocks end. On one H200 under MPS, a
graph of decoder-sized kernels that replays in 1.0 ms alone took 13.3 ms beside a process running
large fp16 products back to back, and 2.6 ms once that process was held to 80 % of the
multiprocessors (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, NVIDIA's MPS guide), for 16 % of its own
throughput. Ranking that process's work lower instead (``CUDA_MPS_CLIENT_PRIORITY=1``) changed
nothing there (16.1 ms).

The driver reads the variable when the process initialises CUDA, so a model sets it in its own
environment before it loads (:class:`~tts_gateway.models.triton_model.TritonModel`); without MPS it
has no effect.
"""

from __future__ import annotations

import ctypes
import os
from typing import Final

VARIABLE: Final = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
# cuDeviceGetCount's answer before cuInit: CUDA is not initialised yet in this process.
_CUDA_ERROR_NOT_INITIALIZED: Final = 3


def parse_percentage(value: str) -> int:
    """A whole percentage from 1 to 100; ValueError otherwise."""
    try:
        percent = int(value)
    except ValueError:
        percent = 0
    if not 1 <= percent <= 100:
        raise ValueError(f"mps_active_thread_percentage must be a whole number from 1 to 100, not {value!r}")
    return percent


def limit_active_threads(value: str) -> bool:
    """Hold this process's kernels to ``value`` percent of the GPU's multiprocessors under MPS (100: all of them).

    Returns False where CUDA was initialised in the process already, so that the limit comes too
    late (the driver read the variable then); ValueError for a value that is not a percentage.
    """
    os.environ[VARIABLE] = str(parse_percentage(value))
    return not cuda_initialised()


def cuda_initialised() -> bool:
    """Whether this process initialised the CUDA driver (False where there is no driver)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return int(driver.cuDeviceGetCount(ctypes.byref(count))) != _CUDA_ERROR_NOT_INITIALIZED
