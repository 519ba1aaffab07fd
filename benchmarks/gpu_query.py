"""What ``nvidia-smi`` says about the GPUs and the processes on them, for the benchmarks.

Kept apart from the CUDA benchmarks' own modules so that a tool which only samples memory (the
memory soak) does not import their model-side dependencies.
"""

from __future__ import annotations

import os
import subprocess

from tts_gateway.gateway.embedded.gpu_devices import VISIBLE_DEVICES, visible_gpus


def nvidia_smi(query: str, timeout_s: float | None = None) -> list[list[str]]:
    """Rows of ``nvidia-smi --query-QUERY`` as CSV fields, without units.

    A query of the GPUs themselves (``gpu=...``) answers for the GPUs ``CUDA_VISIBLE_DEVICES`` gives
    this process where it is set, as CUDA does: a benchmark on one GPU of a host reads that GPU's
    name and memory, not those of whatever runs on the others. Indices are the host's, as
    ``nvidia-smi`` numbers GPUs; a UUID names the same GPU to both."""
    selection = []
    if query.startswith("gpu=") and VISIBLE_DEVICES in os.environ:
        gpus = visible_gpus()
        if not gpus:
            return []
        selection = [f"--id={','.join(gpus)}"]
    answer = subprocess.run(
        ["nvidia-smi", f"--query-{query}", *selection, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=timeout_s,
    )
    return [[field.strip() for field in row.split(",")] for row in answer.stdout.splitlines() if row.strip()]


def used_mib_by_gpu(timeout_s: float | None = None) -> list[int]:
    """MiB in use on each GPU, whoever holds it."""
    return [int(row[0]) for row in nvidia_smi("gpu=memory.used", timeout_s)]


def cuda_mib_by_pid(timeout_s: float | None = None) -> dict[int, int]:
    """Pid -> MiB of CUDA memory the process holds (rows without a figure are left out), on the GPUs
    ``CUDA_VISIBLE_DEVICES`` gives this process where it is set: another benchmark's stack on another GPU
    of the host is none of this one's."""
    given = {row[0] for row in nvidia_smi("gpu=uuid", timeout_s)} if VISIBLE_DEVICES in os.environ else None
    held: dict[int, int] = {}
    for row in nvidia_smi("compute-apps=pid,used_memory,gpu_uuid", timeout_s):
        if len(row) != 3 or (given is not None and row[2] not in given):
            continue
        pid, used = row[0], row[1]
        if pid.isdigit() and used.isdigit():
            held[int(pid)] = held.get(int(pid), 0) + int(used)
    return held
