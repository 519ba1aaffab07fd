"""Which GPUs the embedded servers spread over: one ``tritonserver`` per GPU.

A Triton server's Python-backend models each hold a CUDA context, a copy of their weights and
their own batching engine, so a server drives one GPU well and several badly; one server per GPU,
with the gateway's pool spreading requests over them, scales with the GPUs (nearly 2x on two).
A GPU is named as ``CUDA_VISIBLE_DEVICES`` names it (an index or a UUID), so that the server
given it sees that one GPU as device 0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Final

VISIBLE_DEVICES: Final = "CUDA_VISIBLE_DEVICES"
_NVIDIA_SMI_TIMEOUT_S: Final = 30.0


def visible_gpus() -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` where it is set, else every GPU ``nvidia-smi``
    lists; none without an NVIDIA driver."""
    visible = os.environ.get(VISIBLE_DEVICES)
    if visible is not None:
        devices = []
        for device in (entry.strip() for entry in visible.split(",")):
            # CUDA stops at the first entry that is not a device (an empty one, -1).
            if not device or device.startswith("-"):
                break
            devices.append(device)
        return devices
    return [row[0] for row in _nvidia_smi("index")]


def cuda_ids(devices: list[str]) -> dict[str, str]:
    """Each device as its UUID where ``nvidia-smi`` knows its index (a UUID or an unknown index stays as given).

    A server is handed its GPU by UUID: an index means one GPU to ``nvidia-smi`` and possibly another to a
    process whose devices an MPS daemon narrows down, a UUID the same GPU to both.
    """
    uuids = {row[0]: row[1] for row in _nvidia_smi("index,uuid") if len(row) == 2}
    return {device: uuids.get(device, device) for device in devices}


def _nvidia_smi(fields: str) -> list[list[str]]:
    """``nvidia-smi``'s rows of ``fields`` for every GPU; none without an NVIDIA driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listed = subprocess.run(
            [smi, f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=_NVIDIA_SMI_TIMEOUT_S,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [[field.strip() for field in line.split(",")] for line in listed.stdout.splitlines() if line.strip()]


def server_gpus(setting: str, *, profile_uses_gpu: bool) -> list[str | None]:
    """One entry per server to start: the GPU it is given, or ``None`` for a server left to see every device.

    ``auto`` gives a GPU profile one server per visible GPU and anything else one server; ``none``
    one server; a list one server per listed GPU. A GPU that ``CUDA_VISIBLE_DEVICES`` names is given
    to its server also when it is the only one: the server then names it by UUID, where the index
    would name another GPU (or none) to the models under the server's MPS daemon, which sees that GPU
    alone.
    """
    if setting == "none" or (setting == "auto" and not profile_uses_gpu):
        return [None]
    if setting == "auto":
        gpus = visible_gpus()
        return list(gpus) if len(gpus) > 1 or (gpus and VISIBLE_DEVICES in os.environ) else [None]
    return list(setting.split(","))
