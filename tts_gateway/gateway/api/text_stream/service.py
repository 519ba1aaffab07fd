"""The text-streaming sockets of one gateway worker: validation before accept, the socket limit."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pydantic import ValidationError
from starlette.websockets import WebSocket

from tts_gateway.gateway.api.text_stream.messages import StreamQuery
from tts_gateway.gateway.api.text_stream.metrics import TextStreamMetrics
from tts_gateway.gateway.api.text_stream.session import (
    POLICY,
    TRY_LATER,
    TextStreamLimits,
    TextStreamSession,
    close_socket,
)
from tts_gateway.gateway.errors import GatewayError
from tts_gateway.gateway.speech.plan import ContextPlan, SpeechPlanner
from tts_gateway.gateway.speech.text_stream.output_format import OutputFormat, UnsupportedOutputFormat
from tts_gateway.gateway.speech.text_stream.phrase_chunker import PhraseChunker
from tts_gateway.gateway.speech.text_stream.synthesis import (
    PhrasePipeline,
    PhraseSynthesizer,
    TextStreamSynthesizer,
    VoiceChoice,
)
from tts_gateway.gateway.speech.text_stream.text_streaming_model import StreamedTextSynthesis, TextStreamCalls

logger = logging.getLogger(__name__)


class TextStreamService:
    def __init__(
        self,
        planner: SpeechPlanner,
        phrases: Callable[[ContextPlan], PhraseSynthesizer],
        limits: TextStreamLimits,
        metrics: TextStreamMetrics,
        sessions: TextStreamCalls | None = None,
    ) -> None:
        """``phrases``: the phrase synthesis of one context; ``sessions``: text-streaming sessions, for the
        models that have them (phrases for the rest)."""
        self._planner = planner
        self._phrases = phrases
        self._limits = limits
        self._metrics = metrics
        self._sessions = sessions
        self._open = 0

    def plan(self, voice: VoiceChoice) -> ContextPlan:
        """``voice`` resolved against what the Triton servers serve now; raises :class:`GatewayError`
        when it cannot be spoken."""
        return self._planner.context(voice.model, voice.voice, speed=voice.speed, normalize=voice.normalize)

    def synthesizer(
        self, voice: VoiceChoice, chunker: PhraseChunker, speech_slots: asyncio.Semaphore
    ) -> TextStreamSynthesizer:
        """The synthesis of one context (or one Wyoming request), planned now, as it opens, for all of its
        text (:class:`ContextPlan`); raises :class:`GatewayError` when ``voice`` cannot be spoken.
        ``speech_slots``: its connection's share of the speech slots."""
        context = self.plan(voice)
        if self._sessions is not None and self._sessions.serves(context):
            return StreamedTextSynthesis(self._sessions, context, chunker, speech_slots)
        return PhrasePipeline(self._phrases(context), chunker, speech_slots=speech_slots)

    async def serve(self, websocket: WebSocket, voice_id: str, *, multi: bool) -> None:
        """Validate the socket's parameters, accept it and serve it to its end.

        A socket is accepted before it is refused for a bad parameter or a limit, so that the
        client can read the reason in the close frame.
        """
        reason = ""
        code = POLICY
        try:
            query = StreamQuery.model_validate(dict(websocket.query_params))
            output = OutputFormat.parse(query.output_format, socket=True)
            voice = VoiceChoice(voice_id, query.model, normalize=query.normalize)
            # A check: an unknown voice or model is refused at once. Each context plans again when it
            # opens, since the voices and what the servers serve may change while the socket lives.
            self.plan(voice)
        except ValidationError as exc:
            error = exc.errors()[0]
            reason = f"invalid query parameter {'.'.join(map(str, error['loc']))}: {error['msg']}"
        except UnsupportedOutputFormat as exc:
            reason = str(exc)
        except GatewayError as exc:
            reason = exc.message
        if not reason and self._open >= self._limits.max_sockets:
            code, reason = TRY_LATER, f"socket limit: {self._limits.max_sockets} text streams are open"
        await websocket.accept()
        if reason:
            await close_socket(websocket, code, reason, self._metrics)
            return
        session = TextStreamSession(
            websocket,
            query,
            output,
            multi=multi,
            voice=voice,
            synthesizers=self.synthesizer,
            limits=self._limits,
            metrics=self._metrics,
        )
        self._open += 1
        self._metrics.sockets.inc()
        try:
            await session.run()
        finally:
            self._open -= 1
            self._metrics.sockets.dec()
