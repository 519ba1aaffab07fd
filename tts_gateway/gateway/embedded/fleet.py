"""The embedded Triton servers of a gateway: one per GPU for a GPU profile, else one; each supervised.

The profile is rendered once and every server serves that repository. A server given one GPU of
several sees it alone (``CUDA_VISIBLE_DEVICES``, by UUID) and gets its own CUDA MPS daemon pinned to it, so a
fault on one GPU (or in its daemon) leaves the others serving, and its supervisor restarts it on
the same ports. The servers start together (a GPU profile takes minutes to load), each on its
supervisor's thread, which is what the kernel ties its life to.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from contextlib import AsyncExitStack, ExitStack
from pathlib import Path

from tts_gateway.gateway.embedded.cuda_mps import CudaMps
from tts_gateway.gateway.embedded.gpu_devices import VISIBLE_DEVICES, cuda_ids, server_gpus
from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.gateway.embedded.supervisor import TritonSupervisor
from tts_gateway.gateway.settings import MpsMode, Settings
from tts_gateway.models.model_repository import (
    deployment_overrides,
    load_profile,
    parse_overrides,
    render_repository,
)

logger = logging.getLogger(__name__)


class EmbeddedFleet:
    """Supervised embedded servers, started and stopped together."""

    def __init__(self, supervisors: list[TritonSupervisor]) -> None:
        self.supervisors = supervisors

    @classmethod
    def start(cls, servers: list[EmbeddedTriton], on_restart: Callable[[], None] = lambda: None) -> EmbeddedFleet:
        """Start every server under a supervisor of its own, all at once; returns when all are ready.

        ``on_restart`` runs each time a supervisor replaces a server that exited or hung. A server
        that fails its first start stops the others and raises.
        """
        fleet = cls([TritonSupervisor(server, on_restart=on_restart) for server in servers])
        for supervisor in fleet.supervisors:
            supervisor.launch()
        errors: list[BaseException] = []
        for supervisor in fleet.supervisors:
            try:
                supervisor.wait_started()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            fleet.stop()
            raise errors[0]
        return fleet

    @property
    def servers(self) -> list[EmbeddedTriton]:
        return [supervisor.server for supervisor in self.supervisors]

    @property
    def grpc_urls(self) -> list[str]:
        return [server.grpc_url for server in self.servers]

    def stop(self) -> None:
        """Stop every server, in parallel: each may take its shutdown grace."""
        stopping = [threading.Thread(target=supervisor.stop) for supervisor in self.supervisors]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()


def embedded_servers(
    repository: Path,
    workdir: Path,
    gpus: list[str | None],
    *,
    cuda_mps: MpsMode,
    profile_asks_mps: bool,
    startup_timeout: float,
) -> list[EmbeddedTriton]:
    """A server over ``repository`` for each entry of ``gpus`` (see :func:`server_gpus`); one alone lives in
    ``workdir``, several in ``workdir/gpu-ID``, each with its MPS daemon's directories there."""
    ids = cuda_ids([gpu for gpu in gpus if gpu is not None])
    servers = []
    for gpu in gpus:
        home = workdir if len(gpus) == 1 else workdir / f"gpu-{gpu}"
        device = None if gpu is None else ids[gpu]
        servers.append(
            EmbeddedTriton(
                repository,
                workdir=home,
                startup_timeout=startup_timeout,
                log_path=home / "tritonserver.log",
                cuda_mps=CudaMps.for_mode(cuda_mps, home / "mps", profile_asks=profile_asks_mps, device=device),
                env=None if device is None else {VISIBLE_DEVICES: device},
            )
        )
    return servers


def start_embedded_fleet(
    settings: Settings, stack: ExitStack | AsyncExitStack, on_restart: Callable[[], None]
) -> EmbeddedFleet:
    """Render the embedded profile and start its servers over it (blocking until all are ready).

    ``stack`` removes the temporary work directory; stopping the fleet is the caller's.
    """
    if settings.embedded_workdir is not None:
        workdir = settings.embedded_workdir
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="tts-gateway-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
    repository = workdir / "model_repository"
    profile = load_profile(settings.triton_repository, settings.embedded_profile)
    overrides = deployment_overrides(
        profile,
        models_root=settings.models_root,
        llm_urls=settings.llm_urls,
        explicit=parse_overrides(settings.embedded_overrides),
    )
    names = render_repository(settings.triton_repository, settings.embedded_profile, repository, overrides)
    gpus = server_gpus(settings.embedded_gpus, profile_uses_gpu=profile.gpu)
    where = "" if gpus == [None] else f" on GPUs {', '.join(str(gpu) for gpu in gpus)}, one server each"
    logger.info("starting embedded Triton (profile %s: %s)%s", settings.embedded_profile, ", ".join(names), where)
    servers = embedded_servers(
        repository,
        workdir,
        gpus,
        cuda_mps=settings.embedded_cuda_mps,
        profile_asks_mps=profile.cuda_mps,
        startup_timeout=settings.embedded_startup_timeout,
    )
    return EmbeddedFleet.start(servers, on_restart)
