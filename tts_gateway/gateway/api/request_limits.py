"""Request body size limits, as pure ASGI middleware.

A body over its limit is answered with 413 before the application parses it: at once
when ``Content-Length`` already says so, and for a chunked body as soon as the bytes
received pass the limit (reading stops there; the server then closes the connection
instead of draining the rest). Nothing over the limit is ever buffered, parsed, or
spooled to a temporary file by the multipart parser.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tts_gateway.gateway.errors import PayloadTooLargeError


class _BodyTooLarge(Exception):
    """Raised into the application from ``receive`` to stop it reading an over-long body."""


class RequestBodyLimitMiddleware:
    """Caps request bodies at ``default_limit`` bytes, or at ``route_limits[(method, path)]``."""

    def __init__(
        self, app: ASGIApp, *, default_limit: int, route_limits: Mapping[tuple[str, str], int] | None = None
    ) -> None:
        self._app = app
        self._default = default_limit
        self._routes = dict(route_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        limit = self._routes.get((scope["method"], scope["path"]), self._default)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _too_large(limit).response()(scope, receive, send)
            return

        received = 0
        exceeded = False
        response_started = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    exceeded = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if exceeded and not response_started:
                return  # whatever the application answers to the aborted read, the client gets the 413
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self._app(scope, limited_receive, guarded_send)
        except Exception:
            # The application may let the abort through or turn it into an error of its own;
            # either way, once the limit is passed the only answer is the 413.
            if not exceeded or response_started:
                raise
        if exceeded and not response_started:
            await _too_large(limit).response()(scope, receive, send)


def _too_large(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"request body is larger than the limit of {limit} bytes")


def _content_length(scope: Scope) -> int | None:
    value = Headers(scope=scope).get("content-length")
    if value is None or not value.isdigit():
        return None  # the server rejects a malformed Content-Length before the application sees it
    return int(value)
