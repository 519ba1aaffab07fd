"""Text-streaming sessions on a Triton model that declares ``text_streaming`` (see ``tts_gateway.models.contract``).

The session's audio comes on one gRPC stream (``ModelStreamInfer``) whose single request opens the
session with the voice and the session id: its first response is empty (the session is open and
takes text), the next ones are the audio chunks, then the final flag. Each piece of text, the
text's end or a close is a request of its own on a short stream of its own, answered once the
model took it, so a piece's error is never mistaken for the session's and pieces awaited one
after another arrive in order.

Leaving the audio iterator early, or :meth:`TextStreamCall.cancel`, closes the session in the
model and cancels the audio stream; the model frees the LLM slot the session holds.

Every request carries the session id as its Triton correlation id: the model's sequence batcher
sends all of a session's requests to the instance that holds it, so sessions spread over the
model's instances. The opening request starts the sequence and waits at most ``place_wait_s`` for
a place in the batcher (then the model is full: :class:`RateLimitError`); the close ends it. A
session that ended by itself is still closed: its close starts once its audio is read (the model
takes a close of an ended session as done), without holding up the reader, and the session's owner
awaits it with :meth:`TextStreamCall.cancel`. An opening that failed is dropped, then closed, so the
batcher's place is given back however a session ends. Only a close that never reaches the server (the gateway
stopped, the connection lost) leaves the place held, until the model's idle time frees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from tts_gateway.gateway.errors import GatewayError, InvalidRequestError, ServerTimeoutError, SynthesisError
from tts_gateway.gateway.triton.client import TritonClient
from tts_gateway.models import contract

_log = logging.getLogger(__name__)

# An acknowledgement that takes this long, once the model has the request, means the model is stuck.
_ACK_TIMEOUT_S = 30.0
# How long an opening request waits for a place while the model holds all the sessions it can.
_PLACE_WAIT_S = 30.0
# How long a cancelled session's audio stream may take to end before it is cancelled.
_CLOSE_WAIT_S = 10.0


class TextStreamCall:
    """One session: :meth:`send_text` pieces, then :meth:`finish`; iterate for float32 audio chunks."""

    def __init__(self, client: TritonClient, model: str, session_id: str) -> None:
        self._client = client
        self._model = model
        self._session_id = session_id
        self._audio: asyncio.Queue[NDArray[np.float32] | GatewayError | None] = asyncio.Queue()
        self._opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._numbers = itertools.count(1)
        self._reader: asyncio.Task[None] | None = None
        self._ended = False
        self._closing: asyncio.Future[None] | None = None

    @classmethod
    async def open(
        cls,
        client: TritonClient,
        model: str,
        session_id: str,
        voice: Mapping[str, Any],
        *,
        place_wait_s: float = _PLACE_WAIT_S,
    ) -> TextStreamCall:
        """Open a session on ``model`` with the contract inputs ``voice`` (see ``SpeechPlan.voice_inputs``; sampling
        inputs such as ``seed`` may join them); returns once the model holds the session."""
        if not session_id:
            raise InvalidRequestError("a session needs an id")
        session = cls(client, model, session_id)
        audio = client.session_audio(
            model, {**voice, contract.SESSION_ID: session_id}, session.opening_request_id, session_id, place_wait_s
        )
        session._reader = asyncio.create_task(session._read(audio), name=f"text-stream-{session_id}")
        try:
            async with asyncio.timeout(place_wait_s + _ACK_TIMEOUT_S):
                await asyncio.shield(session._opened)
        except BaseException as exc:
            # Dropped first: an opening request still waiting for a place ends its sequence with it.
            await session.aclose()
            if session._opened.done() and not session._opened.cancelled():
                session._opened.exception()  # seen: what is raised here is the session's failure
            if not _in_use(exc):  # the sequence of an id in use is that session's own
                await session.cancel()
            if isinstance(exc, TimeoutError):
                raise ServerTimeoutError(f"model {model!r} did not open the session in time") from None
            raise
        return session

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def opening_request_id(self) -> str:
        """The Triton request id of the request that opened the session (its audio stream)."""
        return f"{self._session_id}:0"

    async def send_text(self, piece: str) -> None:
        """Send a piece of the text; returns once the model took it."""
        if piece:
            await self._call({contract.TEXT_PIECE: piece})

    async def finish(self) -> None:
        """Mark the text complete: the session speaks the rest, then its audio ends."""
        await self._call({contract.TEXT_END: True})

    async def cancel(self) -> None:
        """End the session now (or, once it ended by itself, its Triton sequence): the model stops it
        (freeing its LLM slot) and ends its audio stream, which this waits for (a few seconds at most,
        then cancels it); the session id is free again after. Every call waits for the one close."""
        closing = self._begin_close()
        try:
            # Shielded: a caller cancelled meanwhile must not leave the sequence holding its place.
            await asyncio.shield(closing)
            if self._reader is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._reader), _CLOSE_WAIT_S)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Cancel the audio stream (the model notices the cancellation) and stop reading it."""
        self._ended = True
        if self._reader is not None and not self._reader.done():
            # Cancelled, the reader leaves the audio stream, which cancels the session's request.
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    def __aiter__(self) -> AsyncIterator[NDArray[np.float32]]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[NDArray[np.float32]]:
        complete = False
        try:
            while True:
                item = await self._audio.get()
                if item is None:
                    complete = True
                    return
                if isinstance(item, GatewayError):
                    raise item
                yield item
        finally:
            if complete:
                # Ends the Triton sequence of a session that ended by itself. Not awaited here: the reader
                # learns at once that the audio is complete (a text stream's last chunk takes the rest of
                # its characters only then), and the session's owner awaits the close with cancel().
                self._begin_close()
            else:
                # Stops a session left early.
                await self.cancel()

    def _begin_close(self) -> asyncio.Future[None]:
        """The session's one close, started on the first call."""
        self._ended = True  # nothing may follow the close
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        return self._closing

    async def _close(self) -> None:
        try:
            await self._call({contract.SESSION_CLOSE: True}, last=True)
        except GatewayError:
            pass  # the server failed, or holds no such sequence: nothing to end
        except Exception:
            _log.warning("closing text-stream session %s failed", self._session_id, exc_info=True)

    async def _call(self, values: Mapping[str, Any], *, last: bool = False) -> None:
        if self._ended and not last:
            raise InvalidRequestError(f"session {self._session_id!r} has ended")
        request_id = f"{self._session_id}:{next(self._numbers)}"
        try:
            async with asyncio.timeout(_ACK_TIMEOUT_S):
                await self._client.session_call(
                    self._model,
                    {**values, contract.SESSION_ID: self._session_id},
                    request_id,
                    self._session_id,
                    last=last,
                )
        except TimeoutError:
            raise ServerTimeoutError(f"model {self._model!r} did not take a text piece in time") from None

    async def _read(self, audio: AsyncGenerator[NDArray[np.float32], None]) -> None:
        """The audio stream: its first (empty) response opens the session, then chunks, then the end."""
        failure: GatewayError | None = None
        try:
            async with contextlib.aclosing(audio):
                async for chunk in audio:
                    if not self._opened.done():
                        self._opened.set_result(None)
                    if chunk.size:
                        await self._audio.put(chunk)
        except GatewayError as exc:
            failure = exc
        except Exception as exc:
            failure = SynthesisError(f"model {self._model!r}: the session's stream failed: {exc}")
        finally:
            self._ended = True
            if not self._opened.done():
                self._opened.set_exception(failure or InvalidRequestError("the session ended before it opened"))
            await self._audio.put(failure)


def _in_use(exc: BaseException) -> bool:
    """Whether an opening failed because the model holds another session under its id."""
    return isinstance(exc, InvalidRequestError) and contract.SESSION_IN_USE in exc.message
