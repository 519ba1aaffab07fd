"""The stack a benchmark runs on: the embedded Triton for a profile, and gateway processes."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.models.model_repository import parse_overrides, render_repository
from tts_gateway.paths import TRITON_REPOSITORY

ROOT = Path(__file__).resolve().parents[1]
_PR_SET_PDEATHSIG = 1


def parse_cpus(value: str) -> set[int]:
    """A CPU list as taskset and /proc write them, ``0-3,8``; each CPU one this process may use."""
    cpus: set[int] = set()
    for item in value.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if match is None:
            raise ValueError(f"{value!r} is not a CPU list such as 0-3,8")
        low, high = int(match[1]), int(match[2] or match[1])
        if low > high:
            raise ValueError(f"{item.strip()!r}: a range runs from low to high")
        cpus.update(range(low, high + 1))
    usable = os.sched_getaffinity(0)
    if not cpus <= usable:
        raise ValueError(f"CPUs {format_cpus(cpus - usable)} are not usable here (these are: {format_cpus(usable)})")
    return cpus


def format_cpus(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 3, 8}`` as ``0-3,8``."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in ranges)


def cpus_of(pid: int) -> str | None:
    """The CPUs ``pid`` may run on, as ``0-3,8``; None once it is gone."""
    try:
        return format_cpus(os.sched_getaffinity(pid))
    except OSError:
        return None


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """The calling thread on ``cpus`` meanwhile (None: as it is): what it starts meanwhile inherits them."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def embedded_triton(
    workdir: Path,
    *,
    profile: str,
    overrides: list[str],
    repository: Path | None = None,
    cores: set[int] | None = None,
    only: Collection[str] | None = None,
) -> Iterator[EmbeddedTriton]:
    """Triton serving ``repository``, or ``profile`` of triton_repo/ rendered with ``MODEL.KEY=VALUE`` overrides.

    ``cores`` pins the server; the Python backend stubs it starts inherit them. ``only`` deploys
    just those models of the profile, e.g. to leave out one whose packages this machine lacks.
    """
    if repository is None:
        repository = workdir / "repository"
        render_repository(TRITON_REPOSITORY, profile, repository, parse_overrides(overrides), only)
    server = EmbeddedTriton(repository, workdir=workdir, startup_timeout=300.0)
    with pinned(cores):
        server.start()
    try:
        yield server
    finally:
        server.stop(grace=5.0)


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (of each of its threads), from ``/proc``."""
    found = []
    with contextlib.suppress(FileNotFoundError):  # the process, or one of its threads, ended meanwhile
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                found += [int(child) for child in (task / "children").read_text().split()]
    return found


class GatewayServer:
    """``python -m tts_gateway serve`` as a child process, as users run it, ready once /health says so.

    ``env`` adds ``TTS_*`` settings; without ``TTS_TRITON_URL`` the gateway starts its own embedded
    Triton. ``cores`` pins the gateway and everything it starts to those CPUs.
    """

    def __init__(self, workdir: Path, env: Mapping[str, str], cores: set[int] | None = None) -> None:
        self.workdir = workdir
        self.log_path = workdir / "gateway.log"
        self._env = dict(env)
        self._cores = cores
        self._process: subprocess.Popen[bytes] | None = None
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the gateway is not running")
        return self._process.pid

    def start(self, timeout: float = 300.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "TTS_LOG_LEVEL": "warning",
            "TTS_VOICES_DIR": str(self.workdir / "voices"),
            "TTS_EMBEDDED_WORKDIR": str(self.workdir / "embedded"),
            **self._env,
        }
        with self.log_path.open("ab") as log, pinned(self._cores):
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tts_gateway", "serve", "--port", str(self.port)],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=functools.partial(_child_setup, os.getpid()),
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self._process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the gateway was not healthy within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        log = self.log_path
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _child_setup(parent: int) -> None:
    """Runs in the gateway process before exec: have it killed when the benchmark dies."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
