"""Optional API-key authentication, as pure ASGI middleware.

It runs before routing, so it covers every route, the OpenAPI pages and unknown paths
alike (an unauthenticated caller cannot even learn which paths exist from 404s), and
it answers before any request body is read. Clients send ``Authorization: Bearer KEY``,
as the OpenAI SDK does with its ``api_key``, or the key alone in an ``xi-api-key`` header, as
ElevenLabs' clients do (on ElevenLabs' REST paths the 401 comes in ElevenLabs' envelope). A
WebSocket without a valid key is refused before it is accepted: with a 401 and the error body
where the server can answer a handshake with a response (uvicorn can), else with close code
1008, which the server sends as a 403.

A presented key is hashed and compared with the hash of every configured key, each with
:func:`hmac.compare_digest` and without stopping at a match: the time taken says neither
which key matched nor how long the keys are.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketClose

from tts_gateway.gateway.api.elevenlabs_api import REST_PATHS, gateway_error_response
from tts_gateway.gateway.api.log_limits import log_refused_handshake
from tts_gateway.gateway.errors import AuthenticationError


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeyMiddleware:
    """Lets an HTTP request through when it carries one of ``keys`` or asks for a public path."""

    def __init__(self, app: ASGIApp, *, keys: Iterable[str], public_paths: Iterable[str]) -> None:
        self._app = app
        self._digests = tuple(_digest(key) for key in keys)
        if not self._digests:
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self._public = frozenset(public_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Lifespan events carry no request.
        if scope["type"] not in ("http", "websocket") or scope["path"] in self._public:
            await self._app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        key = headers.get("xi-api-key")
        error = self._check(f"Bearer {key}" if key else headers.get("authorization"))
        if scope["type"] == "http":
            if error is None:
                await self._app(scope, receive, send)
            elif scope["path"].startswith(REST_PATHS):
                await gateway_error_response(error)(scope, receive, send)
            else:
                await error.response()(scope, receive, send)
            return
        if error is None:
            await self._app(scope, receive, send)
        elif "websocket.http.response" in scope.get("extensions", {}):
            log_refused_handshake(scope, error.status_code, error.message)
            await WebSocket(scope, receive, send).send_denial_response(error.response())
        else:
            log_refused_handshake(scope, 1008, error.message)
            await WebSocketClose(code=1008, reason=error.message)(scope, receive, send)

    def _check(self, authorization: str | None) -> AuthenticationError | None:
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return AuthenticationError(
                "missing API key; send it as 'Authorization: Bearer <key>' or 'xi-api-key: <key>'"
            )
        if not self._matches(token):
            return AuthenticationError("incorrect API key provided")
        return None

    def _matches(self, token: str) -> bool:
        presented = _digest(token)
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(presented, known)
        return matched
