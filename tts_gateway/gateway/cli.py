"""``tts-gateway``: the command-line entry point."""

from __future__ import annotations

import argparse
import logging
import logging.config
import os
import signal
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from types import FrameType
from typing import Any, NoReturn

import uvicorn

from tts_gateway.allocator import worker_malloc_env
from tts_gateway.gateway.api.websocket_protocol import GatewayWebSocketProtocol
from tts_gateway.gateway.app_factory import create_app
from tts_gateway.gateway.embedded.fleet import start_embedded_fleet
from tts_gateway.gateway.metrics import MULTIPROC_DIR_ENV, shared_restarts_counter
from tts_gateway.gateway.settings import Settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tts-gateway", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the OpenAI-compatible speech API")
    serve.add_argument("--host", help="bind address (TTS_HOST)")
    serve.add_argument("--port", type=int, help="port (TTS_PORT)")
    serve.add_argument(
        "--triton-url",
        help="Triton gRPC host:port, or several comma-separated (TTS_TRITON_URL); unset: the embedded server starts",
    )
    serve.add_argument("--workers", type=int, help="gateway processes sharing the port (TTS_WORKERS)")
    serve.add_argument("--wyoming-port", type=int, help="serve Wyoming text-to-speech here (TTS_WYOMING_PORT)")
    serve.add_argument("--wyoming-host", help="the Wyoming server's bind address (TTS_WYOMING_HOST)")
    serve.add_argument(
        "--wyoming-zeroconf",
        action="store_true",
        default=None,
        help="announce the Wyoming server over zeroconf for Home Assistant (TTS_WYOMING_ZEROCONF)",
    )
    serve.add_argument("--ssl-certfile", help="TLS certificate, PEM: serve https and wss (TTS_SSL_CERTFILE)")
    serve.add_argument("--ssl-keyfile", help="the certificate's private key, PEM (TTS_SSL_KEYFILE)")
    return parser


def _uvicorn_options(settings: Settings) -> dict[str, Any]:
    """What every uvicorn server of the gateway runs with, one process or several."""
    return {
        "host": settings.host,
        "port": settings.port,
        "log_config": _log_config(settings.log_level),
        "log_level": settings.log_level,
        "timeout_graceful_shutdown": settings.shutdown_grace,
        "timeout_keep_alive": settings.keep_alive,
        "ws": GatewayWebSocketProtocol,
        # uvicorn's own TLS: https, and wss for the text-to-speech sockets.
        "ssl_certfile": settings.ssl_certfile,
        "ssl_keyfile": settings.ssl_keyfile,
    }


def _log_config(level: str) -> dict[str, Any]:
    """Logging for uvicorn to apply in every process it runs the app in (spawned workers included)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "plain": {"format": "%(asctime)s %(levelname)s %(process)d %(name)s [%(request_id)s]: %(message)s"}
        },
        "filters": {
            "request_id": {"()": "tts_gateway.gateway.request_ids.RequestIdLogFilter"},
            "refused_handshake": {"()": "tts_gateway.gateway.api.log_limits.RefusedHandshakeFilter"},
        },
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "plain",
                "filters": ["request_id", "refused_handshake"],
            }
        },
        "root": {"handlers": ["stderr"], "level": level.upper()},
    }


def _exit_after_shutdown(signum: int, frame: FrameType | None) -> NoReturn:
    """Exit 0 on SIGINT/SIGTERM: uvicorn raises the signal again once it has shut down gracefully.

    Left to the default handlers, that re-raise would end the process as killed by the signal
    (status 143, or a KeyboardInterrupt traceback), although the shutdown asked for completed.
    Before uvicorn installs its own handlers, the same signal simply ends the process.
    """
    raise SystemExit(0)


def _serve_workers(settings: Settings, overrides: dict[str, Any]) -> None:
    """Several uvicorn worker processes on one port, sharing the Triton servers.

    The workers are spawned and build their settings from the environment, so the command
    line's values travel there. The embedded Tritons, if any, are started and supervised here,
    once, and stopped after the last worker has ended; so is the directory the workers'
    metrics share, where this process also counts the server's restarts.
    """
    with ExitStack() as stack:
        os.environ[MULTIPROC_DIR_ENV] = stack.enter_context(tempfile.TemporaryDirectory(prefix="tts-metrics-"))
        environment = {f"TTS_{key.upper()}": str(value) for key, value in overrides.items()}
        if settings.triton_url is None:
            fleet = start_embedded_fleet(settings, stack, shared_restarts_counter().inc)
            stack.callback(fleet.stop)
            environment["TTS_TRITON_URL"] = ",".join(fleet.grpc_urls)
        environment |= worker_malloc_env(os.environ)
        os.environ.update(environment)
        uvicorn.run(
            "tts_gateway.gateway.app_factory:create_app",
            factory=True,
            workers=settings.workers,
            **_uvicorn_options(settings),
        )


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    overrides: dict[str, Any] = {
        key: value
        for key, value in (
            ("host", args.host),
            ("port", args.port),
            ("triton_url", args.triton_url),
            ("workers", args.workers),
            ("wyoming_port", args.wyoming_port),
            ("wyoming_host", args.wyoming_host),
            ("wyoming_zeroconf", args.wyoming_zeroconf),
            ("ssl_certfile", args.ssl_certfile),
            ("ssl_keyfile", args.ssl_keyfile),
        )
        if value is not None
    }
    settings = Settings(**overrides)
    logging.config.dictConfig(_log_config(settings.log_level))
    for handled in (signal.SIGINT, signal.SIGTERM):
        signal.signal(handled, _exit_after_shutdown)
    if settings.workers > 1:
        _serve_workers(settings, overrides)
        return
    uvicorn.run(create_app(settings), **_uvicorn_options(settings))
