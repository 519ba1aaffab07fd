"""The backends' Python log records, written to the Triton server's log.

Inside a Triton Python model, the standard ``logging`` module has no handler: info records (how
long the graphs took to record at load, for one) are lost, and warnings reach the server's stderr
without saying which model wrote them. :func:`forward_to_triton` hands the records of the
``tts_gateway.models`` loggers to Triton's own logger (``pb_utils.Logger``, passed in because it exists only
inside the stub), tagged with the model's name, at the matching level.

:func:`enable_stack_dumps` lets an operator see where a model's threads are when it hangs:
``kill -USR1`` on its stub process writes every thread's Python stack to the server's log.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
from typing import Protocol

PACKAGE_LOGGER = "tts_gateway.models"


class TritonLogger(Protocol):
    """What this module uses of ``triton_python_backend_utils.Logger``."""

    @staticmethod
    def log_info(message: str) -> None: ...

    @staticmethod
    def log_warn(message: str) -> None: ...

    @staticmethod
    def log_error(message: str) -> None: ...


class TritonLogHandler(logging.Handler):
    """Writes each record as ``<model>: <logger>: <message>`` through Triton's logger."""

    def __init__(self, logger: TritonLogger, model_name: str) -> None:
        super().__init__()
        self.triton = logger
        self.setFormatter(logging.Formatter(f"{model_name}: %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            if record.levelno >= logging.ERROR:
                self.triton.log_error(message)
            elif record.levelno >= logging.WARNING:
                self.triton.log_warn(message)
            else:
                self.triton.log_info(message)
        except Exception:
            self.handleError(record)


def forward_to_triton(logger: TritonLogger, model_name: str, level: int = logging.INFO) -> TritonLogHandler:
    """Send the ``tts_gateway.models`` loggers' records of ``level`` and above to Triton's log (once per process:
    a second call replaces the first one's handler)."""
    package = logging.getLogger(PACKAGE_LOGGER)
    for handler in list(package.handlers):
        if isinstance(handler, TritonLogHandler):
            package.removeHandler(handler)
    handler = TritonLogHandler(logger, model_name)
    package.addHandler(handler)
    package.setLevel(level)
    return handler


STACK_DUMP_SIGNAL = signal.SIGUSR1


def enable_stack_dumps() -> None:
    """On ``STACK_DUMP_SIGNAL``, write every thread's Python stack to stderr (a stub's stderr is the
    server's log). Written by the interpreter's own handler, so a thread that holds the GIL in C, or
    a stuck Triton logger, does not keep the dump from coming out."""
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
