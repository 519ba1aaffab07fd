"""Start and stop the ``tritonserver`` shipped in the ``nvidia-pytriton`` wheel.

The wheel carries a complete Triton Inference Server with its Python backend, so the
gateway can serve the CPU default (Piper) with nothing installed but ``pip`` packages.
The wheel's layout is not a Triton install, so :meth:`EmbeddedTriton.start` assembles
one: a backend directory holding the Python backend and the stub built for this
interpreter, ``LD_LIBRARY_PATH`` pointing at the wheel's bundled libraries and this
interpreter's libpython, and this
interpreter's ``bin`` first on ``PATH`` so that the models import this environment's
packages. The stub does not read ``PYTHONPATH``: the project must be installed into the
environment (``pip install -e .`` or ``pip install .``), as the install commands do.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Final, Self

import numpy

from tts_gateway.allocator import server_malloc_env
from tts_gateway.gateway.embedded.cuda_mps import CudaMps, CudaMpsError
from tts_gateway.models import contract

logger = logging.getLogger(__name__)

INSTALL_HINT: Final = "pip install 'tts-gateway[embedded]'"
_PR_SET_PDEATHSIG: Final = 1
_TAIL_LINES: Final = 20
# Triton logs in glog format; error lines start with "E" and the date, e.g. "E1121 10:38:40.96".
_ERROR_LINE: Final = re.compile(r"E\d{4} ")
_POLL_INTERVAL: Final = 0.2
# How tritonserver reports that one of its ports was bound by someone else first.
_PORT_TAKEN: Final = re.compile(r"failed to start \w+ service: .*already in use", re.IGNORECASE)
# Where the Python backend keeps the shared memory it exchanges with each model's stub process.
_SHM_DIR: Final = Path("/dev/shm")
_SHM_PREFIX: Final = b"triton_python_backend_shm_region_"


# Triton's gRPC endpoint keeps up to 8 finished requests' response objects for reuse by default, each
# with the capacity of the largest output it carried: the server's own memory at rest then held the
# last few long responses (over 100 MiB more after 2-16 MiB outputs eight at a time, tests/triton/
# test_server_memory.py). A new object per request costs nothing next to synthesising its audio.
SERVER_MEMORY_OPTIONS: Final = ("--grpc-infer-allocation-pool-size=0",)


class EmbeddedTritonError(RuntimeError):
    """The embedded Triton server is missing, failed to start or is not running."""


class EmbeddedTriton:
    """One ``tritonserver`` child process serving ``repository``, with gRPC, HTTP and metrics."""

    def __init__(
        self,
        repository: Path,
        *,
        workdir: Path,
        host: str = "127.0.0.1",
        startup_timeout: float = 120.0,
        log_path: Path | None = None,
        ports: tuple[int, int, int] | None = None,
        cuda_mps: CudaMps | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``ports`` (gRPC, HTTP, metrics) fixes where the server listens, so that a server
        started again, or started after its clients, is found at the same address; by
        default three free ports are picked at each start. ``cuda_mps``: a daemon started
        before each server and quit after it, so that the model processes share the GPU.
        ``env``: variables the server and its models get on top of this process's environment
        (``CUDA_VISIBLE_DEVICES`` for a server of one GPU).
        """
        self.repository = repository
        self.workdir = workdir
        self.host = host
        self.startup_timeout = startup_timeout
        self.log_path = log_path or workdir / "tritonserver.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._fixed_ports = ports
        self._ports: tuple[int, int, int] | None = None  # grpc, http, metrics
        self._mps = cuda_mps
        # glibc's settings for the server as this process's environment has them now: a gateway that
        # then sets its workers' own MALLOC_ARENA_MAX (cli.py) leaves a restarted server's as they were.
        self._env = {**server_malloc_env(os.environ), **(env or {})}

    @property
    def cuda_mps(self) -> CudaMps | None:
        """The MPS daemon started with the server, if any."""
        return self._mps

    @property
    def grpc_url(self) -> str:
        """``host:port``, the form ``tritonclient.grpc`` takes."""
        return f"{self.host}:{self._started_ports()[0]}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self._started_ports()[1]}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self._started_ports()[2]}/metrics"

    def start(self) -> None:
        """Launch the server and return once every model is ready.

        Linux sends the server SIGKILL when the *thread* that started it exits, so call
        this from a thread that lives as long as the server should (e.g. the main thread).
        """
        if self.is_running():
            raise EmbeddedTritonError("the embedded Triton server is already running")
        self.stop()  # forget a previous run that ended on its own
        _check_numpy()
        layout = _find_wheel_layout()
        backends = self._prepare_backends(layout)
        try:
            self._launch(layout, backends)
        except _AddressInUse:
            if self._fixed_ports is not None:
                raise
            logger.info("a chosen port was taken before Triton bound it; retrying with new ports")
            self._launch(layout, backends)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the server, SIGKILL its process group after ``grace`` seconds; idempotent.

        A clean stop takes about 3 s. After a client cancelled a stream whose responses were not
        all delivered, tritonserver 2.51 never finishes unloading that model: waiting longer
        than a few seconds gains nothing.
        """
        process, self._process, self._ports = self._process, None, None
        if process is not None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    logger.warning("tritonserver did not stop within %.0f s; killing it", grace)
            # The Python backend stubs share the server's process group; take any stragglers,
            # also those of a server that died on its own. A stub killed leaves its shared-memory
            # region behind (a clean shutdown removes it), so note the regions first.
            regions = _stub_shm_regions(process.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            for region in regions:
                region.unlink(missing_ok=True)
        if self._mps is not None:
            self._mps.stop()
        if self._log is not None:
            self._log.close()
            self._log = None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit status of a server that ended on its own; ``None`` while it runs or when none was started."""
        return self._process.poll() if self._process is not None else None

    def answers(self, timeout: float = 2.0) -> bool:
        """Whether the running server answers its liveness endpoint within ``timeout`` seconds."""
        return self._ports is not None and _is_ready(f"{self.http_url}/v2/health/live", timeout)

    def keep_ports(self) -> None:
        """Listen on the ports of the running server at every later start, so clients find it again."""
        self._fixed_ports = self._started_ports()

    @property
    def pid(self) -> int | None:
        """Process id of the running server, ``None`` before start and after stop."""
        return self._process.pid if self._process is not None else None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _started_ports(self) -> tuple[int, int, int]:
        if self._ports is None:
            raise EmbeddedTritonError("the embedded Triton server is not running")
        return self._ports

    def _prepare_backends(self, layout: _WheelLayout) -> Path:
        """Build ``workdir/backends/python``: the wheel's Python backend plus the stub for this Python."""
        python_backend = self.workdir / "backends" / "python"
        python_backend.mkdir(parents=True, exist_ok=True)
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            link = python_backend / name
            link.unlink(missing_ok=True)
            link.symlink_to(layout.python_backend / name)
        # Copied, not linked: the Python backend runs the stub found in its own directory. Copied aside
        # and renamed into place: stubs of a crashed previous run may still be executing the old file.
        staged = python_backend / f".{layout.stub.name}.new"
        shutil.copy2(layout.stub, staged)
        staged.replace(python_backend / layout.stub.name)
        return python_backend.parent

    def _libpython_dir(self) -> Path | None:
        """A directory holding only this interpreter's libpython, for the stub's library path.

        The stub embeds libpython and must load this interpreter's, not another Python of the same
        version on the system path (a mismatch breaks C extensions such as ssl). Putting the
        interpreter's whole ``LIBDIR`` first would do that too, but for a system Python that is
        ``/usr/lib/<arch>``, and every library there would then shadow the ones the models' packages
        load through their own run paths: on the H100 machine (Ubuntu's Python 3.12) the LLM's decode
        step took 6.2 ms in its stub that way and 3.4 ms with this directory alone.
        """
        libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
        if not libdir or not soname or not (Path(libdir) / soname).is_file():
            return None
        directory = self.workdir / "libpython"
        directory.mkdir(parents=True, exist_ok=True)
        link = directory / soname
        link.unlink(missing_ok=True)
        link.symlink_to(Path(libdir) / soname)
        return directory

    def _launch(self, layout: _WheelLayout, backends: Path) -> None:
        ports = self._fixed_ports or _free_ports(self.host)
        if self._mps is not None:
            try:
                self._mps.start()
            except CudaMpsError as exc:
                raise EmbeddedTritonError(str(exc)) from exc
        command = [
            str(layout.server),
            f"--model-repository={self.repository}",
            f"--backend-directory={backends}",
            "--model-control-mode=none",
            "--strict-readiness=true",
            "--exit-on-error=true",
            "--log-verbose=0",
            "--allow-gpu-metrics=false",
            *SERVER_MEMORY_OPTIONS,
            f"--grpc-address={self.host}",
            f"--grpc-port={ports[0]}",
            f"--http-address={self.host}",
            f"--http-port={ports[1]}",
            f"--metrics-address={self.host}",
            f"--metrics-port={ports[2]}",
        ]
        env = {**os.environ, **self._env}
        # Where a model reaches another model of this server over gRPC (see tts_gateway.models.contract).
        env[contract.OWN_GRPC_URL_ENV] = f"{_connect_host(self.host)}:{ports[0]}"
        env["LD_LIBRARY_PATH"] = _prepend_path(str(layout.libs), env.get("LD_LIBRARY_PATH"))
        libpython = self._libpython_dir()
        if libpython is not None:
            env["LD_LIBRARY_PATH"] = _prepend_path(str(libpython), env["LD_LIBRARY_PATH"])
        env["PATH"] = _prepend_path(str(Path(sys.executable).parent), env.get("PATH"))
        if self._mps is not None:
            env.update(self._mps.env())
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        logger.info("starting tritonserver on gRPC %s:%d (log: %s)", self.host, ports[0], self.log_path)
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.workdir,
            process_group=0,
            preexec_fn=functools.partial(_die_with_parent, os.getpid()),
        )
        self._ports = ports
        try:
            self._wait_until_ready(self._process)
        except BaseException:
            self.stop(grace=2.0)
            raise

    def _wait_until_ready(self, process: subprocess.Popen[bytes]) -> None:
        ready_url = f"{self.http_url}/v2/health/ready"
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            returncode = process.poll()
            if returncode is not None:
                tail = self.log_tail()
                error = _AddressInUse if _PORT_TAKEN.search(tail) else EmbeddedTritonError
                raise error(f"tritonserver exited with status {returncode}:\n{tail}")
            if _is_ready(ready_url):
                logger.info("tritonserver ready (pid %d)", process.pid)
                return
            time.sleep(_POLL_INTERVAL)
        raise EmbeddedTritonError(f"tritonserver was not ready within {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        """The server's error lines and its last lines: what a failed start or a crash needs explaining."""
        if self._log is not None:
            self._log.flush()
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError as exc:
            return f"(log {self.log_path} unreadable: {exc})"
        errors = [line for line in lines if _ERROR_LINE.match(line)]
        # Leave out the wide status tables Triton prints at start-up and shutdown.
        last = [line for line in lines if line and not line.startswith(("|", "+"))]
        return "\n".join([*errors[-_TAIL_LINES:], "...", *last[-_TAIL_LINES:]])


class _AddressInUse(EmbeddedTritonError):
    """Another process bound one of the chosen ports between picking and Triton's bind."""


class _WheelLayout:
    """Where the parts of the server live inside the installed ``nvidia-pytriton`` wheel."""

    def __init__(self, package_dir: Path) -> None:
        root = package_dir / "tritonserver"
        self.server = root / "bin" / "tritonserver"
        self.python_backend = root / "backends" / "python"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        self.stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
        # auditwheel puts the server's shared libraries next to the package.
        self.libs = package_dir.parent / "nvidia_pytriton.libs"


def _find_wheel_layout() -> _WheelLayout:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedTritonError(f"the embedded Triton server needs nvidia-pytriton: {INSTALL_HINT}")
    layout = _WheelLayout(Path(next(iter(spec.submodule_search_locations))))
    for part in (layout.server, layout.python_backend, layout.libs):
        if not part.exists():
            raise EmbeddedTritonError(f"nvidia-pytriton is incomplete, {part} is missing: {INSTALL_HINT}")
    if not layout.stub.exists():
        raise EmbeddedTritonError(
            f"nvidia-pytriton ships no Python backend stub for Python {sys.version_info.major}."
            f"{sys.version_info.minor} ({layout.stub} is missing)"
        )
    return layout


def _check_numpy() -> None:
    """The wheel's Python backend stub was built against NumPy 1's C API; under NumPy 2 it corrupts tensors."""
    if int(numpy.__version__.split(".", 1)[0]) >= 2:
        raise EmbeddedTritonError(
            f"the embedded Triton's Python backend needs numpy<2, this environment has numpy {numpy.__version__}"
            f" (reinstall with {INSTALL_HINT!r}, which pins it)"
        )


def _connect_host(host: str) -> str:
    """How this machine reaches a server listening on ``host``: not at a wildcard; IPv6 in brackets."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def _free_ports(host: str) -> tuple[int, int, int]:
    """Three ports free now; another process may take one before Triton binds it (start retries)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(3)]
        for sock in socks:
            sock.bind((host, 0))
        grpc, http, metrics = (int(sock.getsockname()[1]) for sock in socks)
    return grpc, http, metrics


def _stub_shm_regions(group: int) -> list[Path]:
    """The shared-memory files of the Python backend stubs in process group ``group``.

    Each stub is told the name of its region on its command line.
    """
    regions = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.getpgid(int(proc.name)) != group:
                continue
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        regions += [_SHM_DIR / arg.decode() for arg in args if arg.startswith(_SHM_PREFIX)]
    return regions


def _is_ready(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _prepend_path(entry: str, current: str | None) -> str:
    return f"{entry}{os.pathsep}{current}" if current else entry


def _die_with_parent(parent_pid: int) -> None:
    """Runs in the child before exec: have the kernel kill it when the parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # The parent may have died before prctl took effect.
    if os.getppid() != parent_pid:
        os._exit(1)
