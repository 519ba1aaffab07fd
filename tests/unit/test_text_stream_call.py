"""TextStreamCall over a stand-in Triton client whose close takes a while: a session that ended by itself
ends its audio at once, and its close, started then, is what its owner's cancel() awaits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray

from tts_gateway.gateway.triton.client import TritonClient
from tts_gateway.gateway.triton.text_stream_call import TextStreamCall
from tts_gateway.models import contract

CLOSE_S = 0.1


class Client:
    """The session's audio: the opening's empty response, then a chunk and the end once the text's end
    is taken. A close (the request that ends the Triton sequence) is answered after ``CLOSE_S``."""

    def __init__(self) -> None:
        self._audio: asyncio.Queue[NDArray[np.float32] | None] = asyncio.Queue()
        # The closes sent, and those answered.
        self.closes_sent = 0
        self.closes_answered = 0

    async def _stream(self) -> AsyncGenerator[NDArray[np.float32], None]:
        yield np.zeros(0, np.float32)
        while (chunk := await self._audio.get()) is not None:
            yield chunk

    def session_audio(
        self, model: str, values: Mapping[str, Any], request_id: str, session: str, place_wait_s: float
    ) -> AsyncGenerator[NDArray[np.float32], None]:
        return self._stream()

    async def session_call(
        self, model: str, values: Mapping[str, Any], request_id: str, session: str, *, last: bool = False
    ) -> None:
        if contract.SESSION_CLOSE in values:
            assert last
            self.closes_sent += 1
            await asyncio.sleep(CLOSE_S)
            self.closes_answered += 1
        elif contract.TEXT_END in values:
            self._audio.put_nowait(np.ones(480, np.float32))
            self._audio.put_nowait(None)


async def test_a_session_that_ended_by_itself_ends_its_audio_before_its_close() -> None:
    client = Client()
    session = await TextStreamCall.open(cast(TritonClient, client), "model", "session-1", {})
    await session.finish()
    chunks = [chunk async for chunk in session]
    assert [len(chunk) for chunk in chunks] == [480]
    assert client.closes_answered == 0, "the reader waited for the close"
    await asyncio.sleep(CLOSE_S / 10)
    assert client.closes_sent == 1, "the close starts when the audio has ended"
    await session.cancel()
    await session.cancel()
    assert (client.closes_sent, client.closes_answered) == (1, 1)
