"""Rate-limited client log lines, and uvicorn's error line for a refused handshake dropped."""

from __future__ import annotations

import contextvars
import logging

import pytest

from tts_gateway.gateway.api.log_limits import RateLimitedLog, RefusedHandshakeFilter, log_refused_handshake


def test_lines_beyond_the_rate_are_held_back_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(logging.getLogger("test.limits"), per_minute=3)
    with caplog.at_level(logging.INFO, logger="test.limits"):
        for index in range(10):
            log.log(logging.WARNING, "refused %d", index)
    assert [record.getMessage() for record in caplog.records] == ["refused 0", "refused 1", "refused 2"]
    log._window_end = 0.0  # the minute is over
    with caplog.at_level(logging.INFO, logger="test.limits"):
        log.log(logging.WARNING, "refused %d", 10)
    assert caplog.records[-1].getMessage() == "refused 10 (7 similar lines held back before this one)"


def uvicorn_record() -> logging.LogRecord:
    return logging.LogRecord(
        "uvicorn.error", logging.ERROR, __file__, 1, "ASGI callable returned without completing handshake.", (), None
    )


def test_uvicorn_error_dropped_only_for_a_handshake_logged_as_refused() -> None:
    drop = RefusedHandshakeFilter()
    assert drop.filter(uvicorn_record())

    def refused() -> bool:
        scope = {"type": "websocket", "path": "/v1/text-to-speech/joe/stream-input", "client": ("10.0.0.7", 4242)}
        log_refused_handshake(scope, 401, "incorrect API key provided")
        return drop.filter(uvicorn_record())

    assert contextvars.copy_context().run(refused) is False
    assert drop.filter(uvicorn_record()), "another connection's line is kept"
