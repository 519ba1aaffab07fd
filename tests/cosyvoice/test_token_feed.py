"""TokenFeed: tokens read ahead on a thread, seen without blocking, errors and closing passed on."""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator

import pytest

from tts_backends.cosyvoice2.token_feed import TokenFeed

pytestmark = pytest.mark.cosyvoice

TIMEOUT_S = 10.0


class Source:
    """A token generator fed by the test through a queue; ``None`` ends it, an exception is raised."""

    def __init__(self) -> None:
        self.items: queue.Queue[int | Exception | None] = queue.Queue()
        self.closed_on: str | None = None
        self.closed = threading.Event()

    def tokens(self) -> Generator[int, None, None]:
        try:
            while (item := self.items.get(timeout=TIMEOUT_S)) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed_on = threading.current_thread().name
            self.closed.set()


def feed_of(source: Source) -> TokenFeed:
    return TokenFeed(source.tokens(), threading.Event(), name="feed-under-test")


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
    feed.close()
    assert feed.closed.is_set()
    source.items.put(2)
    assert source.closed.wait(TIMEOUT_S)
    assert source.closed_on == "feed-under-test"
    assert feed.all_tokens() == [1]
