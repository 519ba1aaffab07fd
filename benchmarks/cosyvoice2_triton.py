"""A CosyVoice2 Triton for a benchmark: a random checkpoint, a profile rendered over it, the embedded server.

GPU profiles (``gpu-*``) run on the full-size checkpoint (:func:`random_checkpoint.full_size`, what
``tts-models random-full`` writes); the others (``cosyvoice2-cpu``, a rehearsal on two cores) on tiny
shapes with the full size's LLM head, so that their LLM ends requests and text streams as the full
size's does. The checkpoint is written once under ``WORKDIR/models`` and reused; the repository is
rendered into ``WORKDIR/repository`` as ``tts-models render --models-root`` renders it; the server
runs under a CUDA MPS daemon where the profile asks for one and the machine has it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tts_gateway.gateway.embedded.fleet import embedded_servers
from tts_gateway.gateway.embedded.gpu_devices import server_gpus
from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.models.cosyvoice2.checkpoints.random_checkpoint import CheckpointSize, ensure_checkpoint, full_size
from tts_gateway.models.cosyvoice2.checkpoints.tiny_checkpoint import tiny_size
from tts_gateway.models.model_repository import load_profiles
from tts_gateway.paths import TRITON_REPOSITORY
from tts_gateway.tools import model_prep


@dataclass
class StackSetup:
    """How the server came up, for the report."""

    profile: str
    checkpoint: str
    checkpoint_written: bool
    checkpoint_s: float
    startup_s: float
    overrides: list[str]
    cuda_mps: bool


def checkpoint_size(profile: str) -> CheckpointSize:
    """Full size on a GPU profile; tiny shapes with the full size's LLM head elsewhere."""
    if profile.startswith("gpu-"):
        return full_size()
    full = full_size()
    return dataclasses.replace(
        tiny_size(), name="tiny-full-head", stop_logit=full.stop_logit, fill_logit=full.fill_logit
    )


def render(workdir: Path, profile: str, overrides: list[str]) -> Path:
    """``WORKDIR/repository``: ``profile`` rendered afresh over ``WORKDIR/models`` with ``MODEL.KEY=VALUE`` sets."""
    repository = workdir / "repository"
    shutil.rmtree(repository, ignore_errors=True)
    args = ["render", "--profile", profile, "--dest", str(repository), "--models-root", str(workdir / "models")]
    if model_prep.main([*args, *(item for value in overrides for item in ("--set", value))]) != 0:
        raise RuntimeError(f"rendering profile {profile} failed")
    return repository


@contextlib.contextmanager
def cosyvoice2_triton(
    workdir: Path, profile: str, overrides: list[str], *, startup_timeout: float
) -> Iterator[tuple[EmbeddedTriton, StackSetup]]:
    """``profile`` served over its random checkpoint until the block ends; its log stays in ``workdir``."""
    started = time.perf_counter()
    size = checkpoint_size(profile)
    _, written = ensure_checkpoint(workdir / "models", size)
    checkpoint_s = time.perf_counter() - started
    repository = render(workdir, profile, overrides)
    served = load_profiles(TRITON_REPOSITORY)[profile]
    # One server, started as the gateway's embedded default starts it: on the first GPU this process may
    # use, which CUDA_VISIBLE_DEVICES names by UUID to it and its MPS daemon.
    (server,) = embedded_servers(
        repository,
        workdir,
        server_gpus("auto", profile_uses_gpu=served.gpu)[:1],
        cuda_mps="auto",
        profile_asks_mps=served.cuda_mps,
        startup_timeout=startup_timeout,
    )
    mps = server.cuda_mps
    loading = time.perf_counter()
    server.start()
    try:
        setup = StackSetup(
            profile=profile,
            checkpoint=size.name,
            checkpoint_written=written,
            checkpoint_s=round(checkpoint_s, 1),
            startup_s=round(time.perf_counter() - loading, 1),
            overrides=overrides,
            cuda_mps=mps is not None and mps.running,
        )
        yield server, setup
    finally:
        server.stop()
