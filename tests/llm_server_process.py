"""``transformers serve`` as a real OpenAI-compatible LLM server process, serving a CosyVoice2 HF LLM directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.bench_load import process_tree

# The console script next to the interpreter running the tests (the project's virtual environment).
TRANSFORMERS_CLI = Path(sys.executable).with_name("transformers")


def established_connections(port: int, pid: int | None = None) -> int:
    """TCP connections in state ESTABLISHED to 127.0.0.1:``port``, of process ``pid`` when given."""
    inodes: set[str] | None = None
    if pid is not None:
        inodes = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] == "01" and (inodes is None or fields[9] in inodes):
                count += 1
    return count


class LLMServerProcess:
    """One ``transformers serve`` process on a fixed port that tests start, kill and start again."""

    def __init__(self, llm_dir: Path, port: int, log_path: Path) -> None:
        self.llm_dir = llm_dir
        self.port = port
        self.url = f"http://127.0.0.1:{port}/v1"
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def pids(self) -> list[int]:
        """The server's process and its descendants: from transformers 5.25 on, ``serve`` generates in a
        process of its own (its ``model`` process), and the one started here only serves HTTP."""
        return process_tree(self.pid)

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float = 180.0) -> None:
        if self.is_running():
            return
        command = [
            str(TRANSFORMERS_CLI),
            "serve",
            str(self.llm_dir),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {self._process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"transformers serve not ready after {timeout} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL, as a crash would end it."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
        self._process.wait(timeout=30)

    def stop(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
