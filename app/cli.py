"""``tts-gateway``: the command-line entry point."""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Sequence
from types import FrameType
from typing import Any, NoReturn

import uvicorn

from app.app_factory import create_app
from app.settings import Settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tts-gateway", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the OpenAI-compatible speech API")
    serve.add_argument("--host", help="bind address (TTS_HOST)")
    serve.add_argument("--port", type=int, help="port (TTS_PORT)")
    serve.add_argument(
        "--triton-url", help="Triton gRPC host:port (TTS_TRITON_URL); without it the embedded server starts"
    )
    return parser


def _exit_after_shutdown(signum: int, frame: FrameType | None) -> NoReturn:
    """Exit 0 on SIGINT/SIGTERM: uvicorn raises the signal again once it has shut down gracefully.

    Left to the default handlers, that re-raise would end the process as killed by the signal
    (status 143, or a KeyboardInterrupt traceback), although the shutdown asked for completed.
    Before uvicorn installs its own handlers, the same signal simply ends the process.
    """
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    overrides: dict[str, Any] = {
        key: value
        for key, value in (("host", args.host), ("port", args.port), ("triton_url", args.triton_url))
        if value is not None
    }
    settings = Settings(**overrides)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handled in (signal.SIGINT, signal.SIGTERM):
        signal.signal(handled, _exit_after_shutdown)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.shutdown_grace,
    )
