"""Audio handed from the task that produces it to the one that passes it on, then its end or its error.

A sentence of a speech response, a phrase of a text stream and a text-streaming session each run
in a task of their own, so that the next one can start while the audio before it still goes out.
:class:`AudioQueue` carries that audio in order, then marks its end; a failure of the producer
goes to the reader in its place, never lost in a task nobody awaits, so the reader never waits
for an end that does not come.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Final, Generic, TypeVar

from tts_gateway.gateway.errors import GatewayError, SynthesisError

logger = logging.getLogger(__name__)

_Item = TypeVar("_Item")


class _End:
    """Marks the end of the audio."""


_END: Final = _End()


class AudioQueue(Generic[_Item]):
    """Pieces of audio (never ``None``) from one or more producers to one reader.

    ``maxsize``: pieces that may wait for the reader before a producer waits too; a slow reader then
    slows the Triton call (gRPC flow control) instead of growing the gateway's memory. 0: no bound.
    """

    def __init__(self, maxsize: int = 0) -> None:
        self._queue: asyncio.Queue[_Item | _End | GatewayError] = asyncio.Queue(maxsize)

    async def put(self, item: _Item) -> None:
        await self._queue.put(item)

    async def produce(self, work: Awaitable[None], what: str, *, end: bool = True) -> None:
        """Await ``work``, which puts audio here; then mark the end (unless ``end`` is false: another
        producer will). If ``work`` fails, its error goes to the reader instead of propagating: a
        :class:`GatewayError` as it is, any other exception (a bug) logged as ``what`` failing and
        passed on as an internal error."""
        try:
            await work
        except GatewayError as exc:
            await self._queue.put(exc)
        except Exception as exc:
            logger.exception("%s failed", what)
            await self._queue.put(SynthesisError(f"synthesis failed: {type(exc).__name__}", code="internal_error"))
        if end:
            await self._queue.put(_END)

    async def get(self) -> _Item | None:
        """The next piece; ``None`` at the end. Raises the error that ended the audio instead."""
        item = await self._queue.get()
        if isinstance(item, _End):
            return None
        if isinstance(item, GatewayError):
            raise item
        return item
