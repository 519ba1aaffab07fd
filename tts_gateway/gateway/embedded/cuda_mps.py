"""CUDA MPS for a Triton server: its model processes share the GPU instead of taking turns on it.

Triton runs every Python-backend model instance as a process of its own, each with its own CUDA
context, and without MPS a GPU runs one context at a time, switching between them in time slices:
while the LLM decodes in one process, token2wav's flow in another waits for its turn (on an H100 a
first chunk's token2wav took 123 ms inside the pipeline against 57 ms alone). Under NVIDIA's
Multi-Process Service the processes' kernels run on the GPU side by side.

The daemon started here belongs to one server: its pipe and log directories live in a directory
of that server's, so it neither joins nor disturbs an MPS daemon that someone else runs. A server
given one GPU of several gets a daemon pinned to that GPU (``CUDA_VISIBLE_DEVICES`` in the
daemon's environment, as NVIDIA's MPS guide has it), and keeps naming that GPU by its UUID itself:
a client of such a daemon that named no device was seen to give its models the host's second GPU
as device 1 while torch in them saw one device. A process already under MPS
(``CUDA_MPS_PIPE_DIRECTORY`` set, as a Kubernetes device plugin that shares GPUs through MPS
does) starts none. Two servers given the same directory would quit each other's daemon (a start
first quits one a crashed owner left behind), so the directory is locked while a daemon of this
process runs there, and a second server is refused.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Final

from tts_gateway.gateway.embedded.gpu_devices import VISIBLE_DEVICES

if TYPE_CHECKING:
    # A type only: an embedded server also starts where only the model side's dependencies are
    # installed (the Python 3.12 test environment), without pydantic-settings.
    from tts_gateway.gateway.settings import MpsMode

logger = logging.getLogger(__name__)

CONTROL: Final = "nvidia-cuda-mps-control"
PIPE_VARIABLE: Final = "CUDA_MPS_PIPE_DIRECTORY"
LOG_VARIABLE: Final = "CUDA_MPS_LOG_DIRECTORY"
LOCK_FILENAME: Final = "owner.lock"
_TIMEOUT_S: Final = 30.0


class CudaMpsError(RuntimeError):
    """MPS was asked for and could not be started."""


class CudaMps:
    """One MPS control daemon with its pipe and log directories under ``directory``."""

    def __init__(self, directory: Path, control: str, *, required: bool = True, device: str | None = None) -> None:
        """``required``: a daemon that fails to start is an error; otherwise the server runs without MPS.
        ``device``: the one GPU (a ``CUDA_VISIBLE_DEVICES`` entry) the daemon serves; ``None``: every GPU."""
        self.pipe_dir = directory / "pipe"
        self.log_dir = directory / "log"
        self._lock_path = directory / LOCK_FILENAME
        self._lock: int | None = None
        self.required = required
        self.device = device
        self.running = False
        self._control = control

    @classmethod
    def for_mode(
        cls, mode: MpsMode, directory: Path, *, profile_asks: bool, device: str | None = None
    ) -> CudaMps | None:
        """The daemon ``mode`` asks for: ``auto`` when the served profile asks for MPS (``profile_asks``,
        its ``cuda_mps``: measured to gain by it), the control program is installed and this process
        is not under MPS already; ``on`` always (an error without the program); ``off`` none."""
        if mode == "off":
            return None
        control = shutil.which(CONTROL)
        if mode == "auto":
            if not profile_asks or control is None or os.environ.get(PIPE_VARIABLE):
                return None
        elif control is None:
            raise CudaMpsError(f"CUDA MPS is on but {CONTROL} is not on PATH (it comes with the NVIDIA driver)")
        return cls(directory, control, required=mode == "on", device=device)

    def env(self) -> dict[str, str]:
        """What a client process needs in its environment to reach the running daemon (nothing without one)."""
        if not self.running:
            return {}
        return {PIPE_VARIABLE: str(self.pipe_dir), LOG_VARIABLE: str(self.log_dir)}

    def start(self) -> None:
        """Start the daemon (it forks and returns at once); one left running in these directories is quit first.

        A daemon that does not start raises :class:`CudaMpsError` when ``required``, else the
        server goes on without MPS (logged). Directories another live process holds always raise it:
        quitting that process's daemon would take its server's models off the GPU.
        """
        self.running = False
        self._acquire()
        try:
            # Held, the directories' daemon (if any) is one a crashed owner left: quit it before starting ours.
            self._quit()
            self.pipe_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            done = self._run("-d")
            if done.returncode != 0:
                raise CudaMpsError(f"{CONTROL} -d exited with status {done.returncode}: {done.stdout.strip()}")
        except (CudaMpsError, OSError) as exc:
            self._release()
            if self.required:
                raise CudaMpsError(str(exc)) from exc
            logger.warning("running without CUDA MPS: %s", exc)
            return
        self.running = True
        logger.info("CUDA MPS daemon started (pipes in %s)", self.pipe_dir)

    def stop(self) -> None:
        """Ask this process's daemon to quit and let go of its directories; nothing happens without one."""
        self.running = False
        try:
            if self._lock is not None:
                self._quit()
        finally:
            self._release()

    def keep_across_exec(self) -> None:
        """Let the directory's lock pass to a program this process ``exec``s into (it then owns the daemon).

        The program's own children inherit it too (tritonserver's Python-backend stubs): the directories
        stay held until the last of them ends, and none of them outlives the daemon's use."""
        if self._lock is not None:
            os.set_inheritable(self._lock, True)

    def _quit(self) -> None:
        if not self.pipe_dir.exists():
            return
        try:
            done = self._run(stdin="quit\n")
        except CudaMpsError as exc:
            logger.warning("stopping the CUDA MPS daemon: %s", exc)
            return
        if done.returncode == 0:
            logger.info("CUDA MPS daemon stopped")

    def _acquire(self) -> None:
        if self._lock is not None:
            return
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise CudaMpsError(
                f"another running server's CUDA MPS daemon uses {self._lock_path.parent}; "
                "give each server a directory of its own"
            ) from None
        self._lock = descriptor

    def _release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _daemon_env(self) -> dict[str, str]:
        env = {**os.environ, PIPE_VARIABLE: str(self.pipe_dir), LOG_VARIABLE: str(self.log_dir)}
        if self.device is not None:
            env[VISIBLE_DEVICES] = self.device
        return env

    def _run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [self._control, *args],
                input=stdin if stdin is not None else "",
                env=self._daemon_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CudaMpsError(f"{self._control} failed: {exc}") from exc
