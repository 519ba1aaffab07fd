"""The backends' log records handed to Triton's logger (the real one only exists inside a model's stub)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import ClassVar

import pytest

from tts_gateway.models.triton_logging import PACKAGE_LOGGER, TritonLogHandler, forward_to_triton


class _Written:
    """Records what would have been written to the server's log, by level."""

    lines: ClassVar[list[tuple[str, str]]] = []

    @staticmethod
    def log_info(message: str) -> None:
        _Written.lines.append(("info", message))

    @staticmethod
    def log_warn(message: str) -> None:
        _Written.lines.append(("warn", message))

    @staticmethod
    def log_error(message: str) -> None:
        _Written.lines.append(("error", message))


@pytest.fixture
def written() -> Iterator[list[tuple[str, str]]]:
    package = logging.getLogger(PACKAGE_LOGGER)
    level = package.level
    _Written.lines = []
    yield _Written.lines
    for handler in list(package.handlers):
        if isinstance(handler, TritonLogHandler):
            package.removeHandler(handler)
    package.setLevel(level)


def test_records_go_to_the_matching_level_named_by_model_and_logger(written: list[tuple[str, str]]) -> None:
    forward_to_triton(_Written, "token2wav")
    log = logging.getLogger("tts_gateway.models.cosyvoice2.engines.flow_graphs")
    log.debug("not shown")
    log.info("captured in %.1f s", 12.34)
    log.warning("slow")
    log.error("failed")
    assert written == [
        ("info", "token2wav: tts_gateway.models.cosyvoice2.engines.flow_graphs: captured in 12.3 s"),
        ("warn", "token2wav: tts_gateway.models.cosyvoice2.engines.flow_graphs: slow"),
        ("error", "token2wav: tts_gateway.models.cosyvoice2.engines.flow_graphs: failed"),
    ]


def test_a_second_call_replaces_the_first_handler(written: list[tuple[str, str]]) -> None:
    forward_to_triton(_Written, "first")
    forward_to_triton(_Written, "second")
    logging.getLogger("tts_gateway.models.x").info("once")
    assert written == [("info", "second: tts_gateway.models.x: once")]


def test_other_packages_records_are_not_forwarded(written: list[tuple[str, str]]) -> None:
    forward_to_triton(_Written, "llm")
    logging.getLogger("transformers").warning("elsewhere")
    assert written == []
