"""TokenFeed: tokens read ahead on a thread, seen without blocking, errors and closing passed on; StopSignal."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Generator

import pytest

from tts_gateway.models.cosyvoice2.orchestrator.token_feed import LLMStalled, StopSignal, TokenFeed

pytestmark = pytest.mark.cosyvoice

TIMEOUT_S = 10.0


class Source:
    """A token generator fed by the test through a queue; ``None`` ends it, an exception is raised."""

    def __init__(self) -> None:
        self.items: queue.Queue[int | BaseException | None] = queue.Queue()
        self.closed_on: str | None = None
        self.closed = threading.Event()

    def tokens(self) -> Generator[int, None, None]:
        try:
            while (item := self.items.get(timeout=TIMEOUT_S)) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed_on = threading.current_thread().name
            self.closed.set()


def feed_of(source: Source) -> TokenFeed:
    return TokenFeed(source.tokens(), StopSignal(), name="feed-under-test")


def test_tokens_arrive_while_the_consumer_is_away() -> None:
    source = Source()
    feed = feed_of(source)
    for token in range(5):
        source.items.put(token)
    assert feed.wait_for(5) == 5
    source.items.put(5)
    source.items.put(None)
    assert feed.all_tokens() == [0, 1, 2, 3, 4, 5]
    assert feed.finished and feed.arrived == 6
    assert feed.tokens(3) == [0, 1, 2]
    assert source.closed_on == "feed-under-test"


def test_waiting_for_more_than_the_source_gives_returns_what_arrived() -> None:
    source = Source()
    feed = feed_of(source)
    source.items.put(7)
    source.items.put(None)
    assert feed.wait_for(10) == 1
    assert feed.finished


def test_an_error_reaches_the_consumer_after_the_tokens_before_it() -> None:
    source = Source()
    feed = feed_of(source)
    for item in (1, 2, RuntimeError("LLM gone")):
        source.items.put(item)
    assert feed.wait_for(2) == 2
    with pytest.raises(RuntimeError, match="LLM gone"):
        feed.wait_for(3)
    with pytest.raises(RuntimeError, match="LLM gone"):
        feed.all_tokens()
    assert feed.tokens(5) == [1, 2]


def test_closing_stops_the_reader_at_the_next_token_and_closes_the_source_on_its_thread() -> None:
    source = Source()
    feed = feed_of(source)
    source.items.put(1)
    assert feed.wait_for(1) == 1
    # Nothing more comes: the reader waits inside the source, and closing gives up waiting for it.
    assert not feed.close(wait_s=0.05)
    assert feed.stop.is_set() and not source.closed.is_set()
    source.items.put(2)
    assert feed.close(wait_s=TIMEOUT_S)
    assert source.closed_on == "feed-under-test"
    assert feed.all_tokens() == [1]


def test_closing_a_finished_feed_finds_its_reader_done() -> None:
    source = Source()
    feed = feed_of(source)
    source.items.put(None)
    assert feed.all_tokens() == []
    assert feed.close(wait_s=TIMEOUT_S)
    assert source.closed.is_set()


def test_even_a_base_exception_from_the_source_reaches_the_consumer() -> None:
    source = Source()
    feed = feed_of(source)
    source.items.put(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        feed.all_tokens()


def test_no_check_runs_once_the_stop_signal_is_set() -> None:
    stop = StopSignal()
    asked: list[str] = []
    entered, release = threading.Event(), threading.Event()

    def slow_check() -> bool:
        asked.append(threading.current_thread().name)
        entered.set()
        assert release.wait(TIMEOUT_S)
        return False

    checking = threading.Thread(target=lambda: asked.append(str(stop.unless_set(slow_check))), name="reader")
    checking.start()
    assert entered.wait(TIMEOUT_S)
    setting = threading.Thread(target=stop.set)
    setting.start()
    setting.join(0.05)
    assert setting.is_alive()  # set() waits for the check under way
    release.set()
    setting.join(TIMEOUT_S)
    checking.join(TIMEOUT_S)
    assert asked == ["reader", "False"]
    assert stop.unless_set(slow_check) is True and asked == ["reader", "False"]


def test_a_source_that_goes_silent_fails_the_wait_after_the_stall_time() -> None:
    source = Source()
    feed = TokenFeed(source.tokens(), StopSignal(), name="feed-under-test", stall_s=0.3)
    source.items.put(1)
    assert feed.wait_for(1) == 1
    started = time.monotonic()
    with pytest.raises(LLMStalled, match=r"0\.3 s"):
        feed.wait_for(2)
    assert 0.2 <= time.monotonic() - started < 2.0
    with pytest.raises(LLMStalled):
        feed.all_tokens()
    assert feed.close(0.2) is False  # the reader still waits inside the silent source
    source.items.put(None)
    assert source.closed.wait(TIMEOUT_S)


def test_tokens_that_keep_coming_are_waited_for_longer_than_the_stall_time() -> None:
    source = Source()
    feed = TokenFeed(source.tokens(), StopSignal(), name="feed-under-test", stall_s=0.3)

    def trickle() -> None:
        for token in range(8):
            time.sleep(0.1)
            source.items.put(token)
        source.items.put(None)

    thread = threading.Thread(target=trickle)
    thread.start()
    # 0.8 s in all, never more than 0.1 s between two tokens.
    assert feed.all_tokens() == list(range(8))
    thread.join()


@pytest.mark.parametrize("stall_s", [0.0, -1.0, math.inf, math.nan])
def test_the_stall_time_must_be_finite_and_positive(stall_s: float) -> None:
    with pytest.raises(ValueError, match="stall_s"):
        TokenFeed(Source().tokens(), StopSignal(), name="feed-under-test", stall_s=stall_s)
