"""The gateway's errors: every failure a client is told about, with its HTTP status and OpenAI error type.

Lower layers raise their own exceptions; services translate them once into a
:class:`GatewayError` subclass, and ``api/error_handlers.py`` turns those into
``{"error": {"message", "type", "param", "code"}}`` with the right status.
Status codes are deliberate: the OpenAI SDK retries 408/409/429/5xx, so a bad
request must never come back as 5xx.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class GatewayError(Exception):
    status_code = 500
    error_type = "server_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code

    @property
    def headers(self) -> dict[str, str]:
        """Response headers this error calls for (``Retry-After``, ``WWW-Authenticate``)."""
        return {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        """The error as a response; also sent directly by the ASGI middlewares, which run outside the handlers."""
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


class InvalidRequestError(GatewayError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(GatewayError):
    status_code = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"

    @property
    def headers(self) -> dict[str, str]:
        # Closing also spares the server from draining a body nobody will read.
        return {"WWW-Authenticate": "Bearer", "Connection": "close"}


class ForbiddenError(GatewayError):
    """The resource exists, but this operation is not allowed on it (a built-in voice cannot be deleted)."""

    status_code = 403
    error_type = "invalid_request_error"
    default_code = "forbidden"


class NotFoundError(GatewayError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ConflictError(GatewayError):
    status_code = 409
    error_type = "invalid_request_error"
    default_code = "conflict"


class PayloadTooLargeError(GatewayError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "payload_too_large"

    @property
    def headers(self) -> dict[str, str]:
        # The rest of the body is left unread: the server closes the connection rather than drain it.
        return {"Connection": "close"}


class RateLimitError(GatewayError):
    """No synthesis slot for the request now; OpenAI's shape for shed load, with when to retry."""

    status_code = 429
    error_type = "requests"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class ServerUnavailableError(GatewayError):
    """No ready Triton server can take the call (down, starting, or unreachable)."""

    status_code = 503
    error_type = "server_error"
    default_code = "backend_unavailable"


class ModelUnavailableError(ServerUnavailableError):
    """A model on a Triton that answers says it cannot serve now (a server it relies on, such as an
    LLM server, is down; or it is unloading): the Triton itself is not down, and stays in rotation."""


class ServerTimeoutError(GatewayError):
    """A Triton server took the call but did not answer (or send the next chunk) in time."""

    status_code = 504
    error_type = "server_error"
    default_code = "backend_timeout"


class RequestTimeoutError(GatewayError):
    """The request ran past the gateway's wall-clock limit for one request."""

    status_code = 504
    error_type = "server_error"
    default_code = "request_timeout"


class SynthesisError(GatewayError):
    """Synthesis failed on a request the gateway considered valid (in the model or in handling its audio)."""

    status_code = 502
    error_type = "server_error"
    default_code = "backend_error"


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
