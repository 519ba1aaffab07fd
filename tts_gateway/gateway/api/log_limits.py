"""Log lines that clients cause (refused handshakes, malformed frames, sockets closed for a limit):
one line each at INFO or WARNING with the reason and the client's address, no traceback, and
rate-limited, so that a stranger who opens sockets in a loop cannot fill the log.

Each :class:`RateLimitedLog` writes at most ``per_minute`` lines a minute; the lines it holds back
are counted, and the count is written with the next line let through.

uvicorn itself logs an ERROR for every WebSocket handshake that an application answers with an
HTTP response (a 401), as if the application had failed to answer it:
:class:`RefusedHandshakeFilter` drops that line for the handshakes :func:`log_refused_handshake`
has logged (a context variable marks them; uvicorn logs in the connection's own task).
"""

from __future__ import annotations

import contextvars
import logging
import time
from typing import Any, Final

from starlette.types import Scope

_WINDOW_SECONDS: Final = 60.0
_UVICORN_UNANSWERED: Final = "ASGI callable returned without completing handshake."

_refused: contextvars.ContextVar[bool] = contextvars.ContextVar("handshake_refused", default=False)
logger = logging.getLogger(__name__)


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, *, per_minute: int = 20) -> None:
        self._logger = logger
        self._per_minute = per_minute
        self._window_end = 0.0
        self._written = 0
        self._held_back = 0

    def log(self, level: int, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now >= self._window_end:
            self._window_end = now + _WINDOW_SECONDS
            self._written = 0
        if self._written >= self._per_minute:
            self._held_back += 1
            return
        self._written += 1
        if self._held_back:
            message = f"{message} ({self._held_back} similar lines held back before this one)"
            self._held_back = 0
        self._logger.log(level, message, *args)


_handshakes_log = RateLimitedLog(logger)


def client_address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "unknown"


def log_refused_handshake(scope: Scope, status: int, reason: str) -> None:
    """Log a WebSocket handshake refused with ``status`` (uvicorn's own error line for it is dropped)."""
    _refused.set(True)
    where = client_address(scope.get("client"))
    _handshakes_log.log(logging.WARNING, "WebSocket %s from %s refused (%d): %s", scope["path"], where, status, reason)


class RefusedHandshakeFilter(logging.Filter):
    """Drops uvicorn's error line for a handshake that :func:`log_refused_handshake` logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == _UVICORN_UNANSWERED and _refused.get())
