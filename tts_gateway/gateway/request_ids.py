"""Request ids: every response carries ``x-request-id``, and so do the log lines of its request.

The id is the client's ``X-Request-Id`` when it sends a usable one (visible ASCII, at most
``MAX_REQUEST_ID_CHARS`` characters), otherwise a new random one. It lives in a context variable
for the request's duration: tasks the request starts inherit it, the log filter adds it to every
record (``-`` outside a request), and the speech service passes it on to Triton.
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER: Final = "x-request-id"
MAX_REQUEST_ID_CHARS: Final = 128
_USABLE: Final = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")
_HEADER_BYTES: Final = HEADER.encode()

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def current_request_id() -> str:
    """The id of the request being served, or a new one outside any request (a background task)."""
    return _current.get() or uuid.uuid4().hex


def _from_client(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == _HEADER_BYTES:
            text = value.decode("latin-1")
            return text if _USABLE.fullmatch(text) else None
    return None


class RequestIdMiddleware:
    """Pure ASGI, outermost: even a 401 or 413 sent by the other middlewares carries the id."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        request_id = _from_client(scope["headers"]) or uuid.uuid4().hex
        token = _current.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != _HEADER_BYTES]
                message = {**message, "headers": [*headers, (_HEADER_BYTES, request_id.encode())]}
            await send(message)

        try:
            await self._app(scope, receive, send_with_id)
        finally:
            _current.reset(token)


class RequestIdLogFilter(logging.Filter):
    """Gives every log record a ``request_id`` attribute for the format to show."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _current.get() or "-"
        return True
