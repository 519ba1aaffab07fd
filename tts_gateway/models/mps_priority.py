"""The priority of a model process's GPU work beside the other clients of its CUDA MPS server.

Under MPS the LLM's and token2wav's processes run their kernels side by side
(``gateway/embedded/cuda_mps.py``). The LLM decodes in steps of a few hundred short kernels that
each need only a few multiprocessors; token2wav's flow fills the GPU with large products. At one priority the GPU hands
freed multiprocessors to whichever client waits, so decode steps queue behind the flow's blocks (at
64 streams 4.0-4.8 ms a step under MPS against 2.6-2.7 without it, docs/TUNING.md), and every
stream's first chunk waits for its tokens. ``CUDA_MPS_CLIENT_PRIORITY`` (0 normal, 1 below
normal; NVIDIA's MPS guide) ranks a client's work under the others', which then take freed
multiprocessors first.

The driver reads the variable when the process initialises CUDA, so a model sets it in its own
environment before it loads (:class:`~tts_gateway.models.triton_model.TritonModel`); it has no
effect without MPS.
"""

from __future__ import annotations

import ctypes
import os
from typing import Final

VARIABLE: Final = "CUDA_MPS_CLIENT_PRIORITY"
LEVELS: Final = {"normal": "0", "below_normal": "1"}
# cuDeviceGetCount's answer before cuInit: CUDA is not initialised yet in this process.
_CUDA_ERROR_NOT_INITIALIZED: Final = 3


def set_client_priority(level: str) -> bool:
    """Give this process's GPU work ``level`` (``normal``, ``below_normal``) among its MPS server's clients.

    Returns False where CUDA was initialised in the process already, so that the level comes too
    late (the driver read the variable then); ValueError names the levels for another value.
    """
    if level not in LEVELS:
        raise ValueError(f"mps_client_priority must be one of {', '.join(LEVELS)}, not {level!r}")
    os.environ[VARIABLE] = LEVELS[level]
    return not cuda_initialised()


def cuda_initialised() -> bool:
    """Whether this process initialised the CUDA driver (False where there is no driver)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return int(driver.cuDeviceGetCount(ctypes.byref(count))) != _CUDA_ERROR_NOT_INITIALIZED
