"""The one translation of gateway errors into OpenAI's error envelope (see ``errors.py``)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from tts_gateway.gateway.errors import GatewayError, error_body

logger = logging.getLogger(__name__)


def _validation_param(loc: tuple[int | str, ...]) -> str | None:
    """The request field an error is about: ``("body", "voice", "str")`` -> ``"voice"``.

    Deeper location parts name union members and list indexes, which mean nothing to clients.
    """
    if len(loc) >= 2 and loc[0] in ("body", "query", "path", "form") and isinstance(loc[1], str):
        return loc[1]
    return None


async def _gateway_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GatewayError)
    if exc.status_code >= 500:
        logger.warning("request failed: %s (%s)", exc.message, exc.code)
    return exc.response()


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _validation_param(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request"))
    if param:
        message = f"{param}: {message}"
    return JSONResponse(error_body(message, "invalid_request_error", param, "invalid_value"), status_code=400)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(_allowed_methods(request))
    return JSONResponse(error_body(str(exc.detail), kind, None, code), status_code=exc.status_code, headers=headers)


_HTTP_METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")


def _allowed_methods(request: Request) -> list[str]:
    """Methods some route serves on the request's path (Starlette's 405 names only the first route's)."""
    routes = request.app.router.routes
    return [
        method
        for method in _HTTP_METHODS
        if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)
    ]


async def _unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body("internal server error", "server_error", None, "internal_error"), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
