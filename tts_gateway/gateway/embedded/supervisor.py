"""Keep the embedded Triton running: restart it when it exits or stops answering.

One thread owns the server for its whole life. It starts it, then checks every
``check_interval`` seconds that the process is alive and answers its liveness endpoint; a
server that exited, or that has not answered for ``unresponsive_after`` seconds, is stopped
(its model processes and shared memory with it) and started again on the same ports, so
clients reconnect to the address they know. Failed starts are retried with capped
exponential backoff; the delay starts over once a server has stayed up for ``stable_after``
seconds. The thread is also what the kernel ties the server's life to (``PR_SET_PDEATHSIG``
fires when the thread that started a child exits), which is why every start happens on it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final

from tts_gateway.gateway.embedded.server import EmbeddedTriton, EmbeddedTritonError

logger = logging.getLogger(__name__)

_STOP_GRACE: Final = 5.0


class TritonSupervisor:
    def __init__(
        self,
        server: EmbeddedTriton,
        *,
        on_restart: Callable[[], None] = lambda: None,
        check_interval: float = 1.0,
        unresponsive_after: float = 10.0,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
        stable_after: float = 60.0,
    ) -> None:
        """``on_restart`` runs (on the supervisor's thread) each time a failed server is replaced."""
        self.server = server
        self._on_restart = on_restart
        self._check_interval = check_interval
        self._unresponsive_after = unresponsive_after
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._stable_after = stable_after
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the server and supervise it; returns once it is ready, raises if the first start fails."""
        self.launch()
        self.wait_started()

    def launch(self) -> None:
        """Begin the first start on the supervisor's thread and return at once (several servers start together)."""
        self._thread = threading.Thread(target=self._run, name="triton-supervisor", daemon=True)
        self._thread.start()

    def wait_started(self) -> None:
        """Wait for the first start to end; raises its error if it failed."""
        self._started.wait()
        if self._start_error is not None:
            if self._thread is not None:
                self._thread.join()
            raise self._start_error

    def stop(self) -> None:
        """Stop supervising and stop the server (waits for a restart in progress to finish first)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        try:
            self.server.start()
            self.server.keep_ports()
        except BaseException as exc:
            self._start_error = exc
            return
        finally:
            self._started.set()
        try:
            self._supervise()
        finally:
            self.server.stop(grace=_STOP_GRACE)

    def _supervise(self) -> None:
        delay = self._backoff_initial
        up_since = time.monotonic()
        silent_since: float | None = None
        while not self._stopping.wait(self._check_interval):
            returncode = self.server.returncode
            if returncode is None:
                if self.server.answers():
                    silent_since = None
                    continue
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since < self._unresponsive_after:
                    continue
                reason = f"has not answered for {self._unresponsive_after:g} s"
            else:
                reason = f"exited with status {returncode}"
            if time.monotonic() - up_since >= self._stable_after:
                delay = self._backoff_initial
            logger.error("embedded Triton %s; restarting it. Its log ends:\n%s", reason, self.server.log_tail())
            self.server.stop(grace=_STOP_GRACE)
            self._on_restart()
            delay = self._restart(delay)
            up_since, silent_since = time.monotonic(), None

    def _restart(self, delay: float) -> float:
        """Start the server again, waiting ``delay`` before each try; returns the delay for the next failure."""
        while not self._stopping.wait(delay):
            delay = min(delay * 2, self._backoff_max)
            try:
                self.server.start()
            except (EmbeddedTritonError, OSError) as exc:  # OSError: the process could not even be spawned
                logger.error("restarting the embedded Triton failed; next try in %g s: %s", delay, exc)
                continue
            logger.info("embedded Triton restarted (pid %s)", self.server.pid)
            return delay
        return delay
