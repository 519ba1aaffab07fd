"""Text-streaming sessions of the orchestrator: a caller's session id -> the LLM text stream behind it.

The contract (:mod:`tts_gateway.models.contract`, ``SESSION_ID`` and after): the request that carries
the voice opens the session and streams its audio; later requests of the session carry text, its end
or a close and are answered at once. All of a session's requests must reach the process holding it:
the deployment's sequence batcher routes them by their correlation id, the session id, to the
instance that took the opening request (its worker threads serve the sessions it holds). Each
session gets a text-stream id of its own, unique on the server, for the LLM and token2wav, so
callers' session ids never meet.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from tts_gateway.models import contract
from tts_gateway.models.cosyvoice2.orchestrator.pipeline import CosyVoice2Pipeline
from tts_gateway.models.request_parsing import ContractError, optional_text, parse_synthesis_request, scalar

_log = logging.getLogger(__name__)
# parse_synthesis_request wants a target text; a session's opening request may bring none.
_NO_TEXT = np.array([b"-"], dtype=np.object_)


@dataclass(frozen=True)
class SessionCall:
    """One request of a session: it opens the session (``opens``), or brings text, the end, a close."""

    session_id: str
    opens: bool
    text: str
    end: bool
    close: bool


def parse_session_call(tensors: Mapping[str, NDArray[Any]]) -> SessionCall:
    session_id = optional_text(tensors, contract.SESSION_ID)
    if not session_id:
        raise ContractError(f"input '{contract.SESSION_ID}' is required by a text-streaming model")
    return SessionCall(
        session_id=session_id,
        opens=contract.REFERENCE_WAV in tensors,
        text=optional_text(tensors, contract.TEXT_PIECE) or "",
        end=bool(scalar(tensors, contract.TEXT_END)),
        close=bool(scalar(tensors, contract.SESSION_CLOSE)),
    )


class TextSessions:
    """The open sessions of one orchestrator process."""

    def __init__(self, pipeline: CosyVoice2Pipeline) -> None:
        self._pipeline = pipeline
        self._lock = threading.Lock()
        self._streams: dict[str, str] = {}

    def open(self, call: SessionCall) -> str:
        """Hold the session of an opening ``call`` (pieces for it are taken from now on); returns its
        text-stream id for :meth:`run`."""
        stream_id = uuid.uuid4().hex
        with self._lock:
            if call.session_id in self._streams:
                raise ContractError(f"session {call.session_id!r} {contract.SESSION_IN_USE}")
            self._streams[call.session_id] = stream_id
        return stream_id

    def run(
        self,
        call: SessionCall,
        stream_id: str,
        tensors: Mapping[str, NDArray[Any]],
        is_cancelled: Callable[[], bool],
        *,
        request_id: str = "",
    ) -> Iterator[NDArray[np.float32]]:
        """The audio of an opened session (its voice and sampling in ``tensors``; ``request_id``: the opening
        Triton request's, which the stage trace names); the session ends with it."""
        try:
            request = parse_synthesis_request({**tensors, contract.TARGET_TEXT: _NO_TEXT})
            speech = replace(request, target_text="", request_id=request_id)
            chunks = self._pipeline.synthesize_text_stream(speech, stream_id, is_cancelled=is_cancelled)
            if call.text or call.end or call.close:
                self._pipeline.send_text(stream_id, call.text, end=call.end, cancel=call.close)
            yield from chunks
        finally:
            with self._lock:
                del self._streams[call.session_id]

    def send(self, call: SessionCall) -> None:
        """Pass a later request's text, end or close to its open session. A close of a session that
        is not open is done already: a caller closes every session it opened, also one that ended by
        itself or failed to open, to end its Triton sequence."""
        with self._lock:
            stream_id = self._streams.get(call.session_id)
        if stream_id is None:
            if call.close and not call.text and not call.end:
                return
            raise ContractError(f"no open session {call.session_id!r}")
        self._pipeline.send_text(stream_id, call.text, end=call.end, cancel=call.close)

    def close_all(self) -> None:
        """Cancel every open session's LLM stream (unloading: a session waiting for text would wait for good)."""
        with self._lock:
            streams = list(self._streams.values())
        for stream_id in streams:
            try:
                self._pipeline.send_text(stream_id, "", cancel=True)
            except Exception:
                _log.exception("cancelling text stream %s failed", stream_id)
