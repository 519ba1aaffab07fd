"""The gateway as a real server process, as users run it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import tritonclient.grpc as grpcclient

from tts_gateway.gateway.embedded.server import EmbeddedTriton


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


def model_processes(directory: Path) -> list[int]:
    """The Python backend stubs (one per model instance) of the Triton whose workdir is ``directory``."""
    return [pid for pid in processes_under(directory) if b"triton_python_backend_stub" in cmdline(pid)]


def tritonserver_pid(directory: Path) -> int:
    """The one ``tritonserver`` whose workdir is ``directory``."""
    servers = [pid for pid in processes_under(directory) if cmdline(pid).split(b"\0")[0].endswith(b"/tritonserver")]
    assert len(servers) == 1, servers
    return servers[0]


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU time the processes have used so far (a process gone counts 0)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
    return total / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"process {pid} reports no VmRSS")


def stream_requests_seen(triton_url: str, model: str = "piper_stream") -> int:
    """Requests Triton has handed to ``model`` so far, successful or not (its own statistics).

    A decoupled Python model's request counts once ``execute`` has taken it, not when its stream ends.
    """
    client = grpcclient.InferenceServerClient(triton_url)
    try:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
    finally:
        client.close()
    return sum(int(stats[kind].get("count", 0)) for kind in ("success", "fail"))


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def crash(server: EmbeddedTriton) -> None:
    """SIGKILL the server (not its model processes) and wait until it has died."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while server.is_running():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> tuple[int, ...]:
    """``count`` distinct ports free now (held together while picked, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return tuple(int(sock.getsockname()[1]) for sock in socks)


class GatewayProcess:
    def __init__(
        self, log_path: Path, env: dict[str, str], args: list[str] | None = None, *, tls: ssl.SSLContext | None = None
    ) -> None:
        """``tls``: the process serves https (its arguments or environment name a certificate), which ``tls`` trusts."""
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._verify: ssl.SSLContext | bool = tls or True
        self.log_path = log_path
        self._env = env
        self._args = args or []
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, *, expect_healthy: bool = True, timeout: float = 120.0) -> None:
        env = {**os.environ, "TTS_LOG_LEVEL": "info", **self._env}
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tts_gateway", "serve", "--port", str(self.port), *self._args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own process group: a gateway that will not stop is killed with its workers and servers.
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"gateway exited with {self._process.returncode}:\n{self.log_tail()}")
            try:
                response = httpx.get(f"{self.url}/health", timeout=2.0, verify=self._verify)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            if response.status_code == 200 or not expect_healthy:
                return
            time.sleep(0.2)
        raise RuntimeError(f"gateway did not become healthy:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the gateway was not started")
        return self._process.pid

    def send_signal(self, sig: signal.Signals) -> None:
        if self._process is not None:
            self._process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The exit status once the process has ended; raises ``subprocess.TimeoutExpired``."""
        if self._process is None:
            raise RuntimeError("the gateway was not started")
        return self._process.wait(timeout=timeout)

    def stop(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()

    def wait_for(self, path: str, status: int, within: float) -> float:
        """Seconds until ``GET path`` answers ``status``; fails after ``within``."""
        started = time.monotonic()
        while (code := httpx.get(f"{self.url}{path}", timeout=5).status_code) != status:
            if time.monotonic() - started > within:
                raise AssertionError(f"{path} still answers {code} after {within} s:\n{self.log_tail()}")
            time.sleep(0.1)
        return time.monotonic() - started

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class SlowReader(threading.Thread):
    """A raw HTTP client with a tiny receive buffer that reads ``rate`` bytes per second, in small reads."""

    def __init__(self, port: int, body: dict[str, str], rate: int) -> None:
        super().__init__(daemon=True)
        self.received = 0
        self.status_line = b""
        self._pause = 512 / rate
        self._leaving = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self._sock.connect(("127.0.0.1", port))
        payload = json.dumps(body).encode()
        head = "POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        self._sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)

    def run(self) -> None:
        while not self._leaving.is_set():
            try:
                data = self._sock.recv(512)
            except ConnectionResetError:
                return  # the server closed the connection with data still unread
            if not data:
                return
            if not self.status_line:
                self.status_line = data.split(b"\r\n", 1)[0]
            self.received += len(data)
            time.sleep(self._pause)

    def hurry(self) -> None:
        """Read the rest at full speed (what the kernels still buffer), to the end of the response."""
        self._pause = 0.0

    def leave(self) -> None:
        self._leaving.set()
        self.join(timeout=5)
        self._sock.close()
