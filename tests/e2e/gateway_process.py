"""The gateway as a real server process, as users run it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def processes_under(directory: Path) -> list[int]:
    """Live (not zombie) processes whose command line mentions ``directory``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if str(directory) in cmdline and state != "Z":
            pids.append(int(proc.name))
    return pids


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class GatewayProcess:
    def __init__(self, log_path: Path, env: dict[str, str], args: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_path = log_path
        self._env = env
        self._args = args or []
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, *, expect_healthy: bool = True, timeout: float = 120.0) -> None:
        env = {**os.environ, "TTS_LOG_LEVEL": "info", **self._env}
        with self._log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "app", "serve", "--port", str(self.port), *self._args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"gateway exited with {self._process.returncode}:\n{self.log_tail()}")
            try:
                response = httpx.get(f"{self.url}/health", timeout=2.0)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            if response.status_code == 200 or not expect_healthy:
                return
            time.sleep(0.2)
        raise RuntimeError(f"gateway did not become healthy:\n{self.log_tail()}")

    def stop(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def log_tail(self, lines: int = 40) -> str:
        text = self._log_path.read_text(errors="replace") if self._log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])
