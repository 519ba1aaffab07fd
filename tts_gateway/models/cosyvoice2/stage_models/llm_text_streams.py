"""The text streams open on the LLM's Triton model: text that arrives in pieces, each piece a request of its own.

A stream opens with a request whose prompt has no target text; later requests carry its text
(:class:`~tts_gateway.models.cosyvoice2.orchestrator.pipeline.TextPiece`), find the stream by id and feed its
engine handle.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from tts_gateway.models.cosyvoice2.engines.llm_engine import BatchingEngine, Generation, TextStreamHandle, TokenSink
from tts_gateway.models.cosyvoice2.model import vocab
from tts_gateway.models.cosyvoice2.orchestrator.pipeline import TextPiece


class OpenTextStreams:
    """The text streams open on one LLM model instance, by id: later requests with text find theirs here.

    A stream's requests must all reach the process that holds it, so a model with several instances
    refuses text streams. Text may arrive before the request that opens its stream (they are separate
    calls): it waits here for ``early_s`` seconds, then is dropped.
    """

    def __init__(self, engine: BatchingEngine, *, single_instance: bool, early_s: float = 30.0) -> None:
        self._engine = engine
        self._single_instance = single_instance
        self._early_s = early_s
        self._lock = threading.Lock()
        self._streams: dict[str, TextStreamHandle] = {}
        self._early: dict[str, tuple[float, list[TextPiece]]] = {}

    def open(self, stream_id: str, request: Generation, sink: TokenSink) -> TextStreamHandle:
        """Open a stream for a request whose prompt is ``<|sos|>`` text ``<|task_id|>`` speech (no target text)."""
        if not self._single_instance:
            raise ValueError("text streams need a single instance of the LLM model (instance_count 1)")
        text, speech = vocab.split_prompt_ids(request.input_ids)
        with self._lock:
            if stream_id in self._streams:
                raise ValueError(f"text stream {stream_id!r} is open already")
            handle = self._engine.open_stream(dataclasses.replace(request, input_ids=tuple(speech)), text, sink)
            self._streams[stream_id] = handle
            _, early = self._early.pop(stream_id, (0.0, []))
        for piece in early:
            _apply(handle, piece)
        return handle

    def add_text(self, piece: TextPiece) -> None:
        """Apply a piece to its stream, or keep it until the stream opens."""
        now = time.monotonic()
        with self._lock:
            handle = self._streams.get(piece.stream_id)
            if handle is None:
                for stream_id in [k for k, (t, _) in self._early.items() if now - t > self._early_s]:
                    del self._early[stream_id]
                self._early.setdefault(piece.stream_id, (now, []))[1].append(piece)
                return
        _apply(handle, piece)

    def ended(self, stream_id: str) -> None:
        with self._lock:
            self._streams.pop(stream_id, None)


def _apply(handle: TextStreamHandle, piece: TextPiece) -> None:
    if piece.cancel:
        handle.cancel()
        return
    if piece.ids:
        handle.add_text(piece.ids)
    if piece.end:
        handle.end_text()
