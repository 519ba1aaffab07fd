"""One speech request, from validated body to encoded bytes.

:meth:`SpeechService.plan` does every check that can fail because of the request
(model, voice, capabilities), so errors reach the client with a proper status
before any byte is sent; it then normalises the input (numbers, money, dates... as
words) and splits it into sentences. :meth:`SpeechService.open_stream` waits for a
synthesis slot (admission control) and synthesises: up to ``synthesis_parallelism``
sentences are in flight at the backend at once, and their
audio is emitted strictly in order, chunk by chunk, as it arrives. The first chunk is
awaited before the response starts, so a backend that is down still yields a 503
rather than an empty 200. The whole request, queue included, runs against one
deadline (``request_timeout``): before the first byte running out is a 504, after it
the response ends cleanly like any other mid-stream failure.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from tts_gateway.gateway.admission import AdmissionControl, Slot
from tts_gateway.gateway.audio_encoding import AudioFormat, create_encoder
from tts_gateway.gateway.backend import SpeechBackend
from tts_gateway.gateway.errors import BackendError, GatewayError, InvalidRequestError, RequestTimeoutError
from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.model_catalog import SpeechModel
from tts_gateway.gateway.protocol import SpeechRequest
from tts_gateway.gateway.request_ids import current_request_id
from tts_gateway.gateway.settings import Settings
from tts_gateway.gateway.text_normalization import TextNormalizer
from tts_gateway.gateway.text_splitting import split_sentences
from tts_gateway.gateway.time_stretch import TimeStretcher
from tts_gateway.gateway.voice_registry import ResolvedVoice, VoiceRegistry
from tts_gateway.models import contract

logger = logging.getLogger(__name__)

Audio = NDArray[np.float32]


def synthesis_pieces(text: str, settings: Settings) -> list[str]:
    """The pieces of ``text`` the gateway synthesises one by one (the benchmarks send Triton the same)."""
    return split_sentences(
        text,
        max_chars=settings.sentence_max_chars,
        first_max_chars=settings.first_sentence_max_chars,
        min_chars=settings.sentence_min_chars,
    )


@dataclass(frozen=True)
class SpeechPlan:
    """Everything decided about a request before synthesis starts."""

    model: SpeechModel
    triton_model: str
    voice: ResolvedVoice
    sentences: tuple[str, ...]
    speed: float
    response_format: AudioFormat
    sse: bool
    input_chars: int
    seed: int | None = None
    instructions: str | None = None

    @property
    def streaming_backend(self) -> bool:
        """The Triton model called is the decoupled twin: audio arrives in chunks."""
        return self.triton_model == self.model.stream_model

    @property
    def backend_speed(self) -> bool:
        """The Triton model called changes tempo itself; otherwise the gateway time-stretches."""
        return self.triton_model in self.model.speed_variants

    def backend_inputs(self, index: int, sentence: str) -> dict[str, Any]:
        values: dict[str, Any] = {contract.TARGET_TEXT: sentence}
        inputs = self.model.inputs
        if self.seed is not None and contract.SEED in inputs:
            # One seed per sentence, all derived from the request's: reproducible, not repetitive.
            values[contract.SEED] = (self.seed + index) % 2**63
        if self.instructions and contract.INSTRUCTIONS in inputs:
            values[contract.INSTRUCTIONS] = self.instructions
        if self.backend_speed and self.speed != 1.0:
            values[contract.SPEED] = self.speed
        reference = self.voice.reference
        if reference is not None:
            values[contract.REFERENCE_WAV] = reference.audio.samples
            values[contract.REFERENCE_WAV_LEN] = reference.audio.samples.size
            if reference.transcript and contract.REFERENCE_TEXT in inputs:
                values[contract.REFERENCE_TEXT] = reference.transcript
        elif contract.VOICE in inputs:
            values[contract.VOICE] = self.voice.id
        return values


class _End:
    """Marks the end of one sentence's audio in its queue."""


_END = _End()

# Chunks one sentence may have ready before its producer waits for the reader. A slow reader
# then stalls the backend stream (gRPC flow control) instead of growing the gateway's memory.
_SENTENCE_QUEUE_CHUNKS = 32


@dataclass
class _Progress:
    """What one response has produced so far."""

    samples: int = 0
    error: GatewayError | None = None


class SpeechStream:
    """The body of one speech response, whose first bytes already exist.

    It holds the request's synthesis slot. :meth:`aclose` stops the synthesis and frees
    the slot; the owner must call it however the response ends (finished, client gone,
    failed), also when the body was never iterated.
    """

    def __init__(self, first: bytes, rest: AsyncGenerator[bytes, None], slot: Slot) -> None:
        self._first: bytes | None = first
        self._rest = rest
        self._slot = slot

    def __aiter__(self) -> SpeechStream:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await anext(self._rest)

    async def aclose(self) -> None:
        try:
            await self._rest.aclose()
        finally:
            self._slot.release()


class SpeechService:
    def __init__(
        self,
        backend: SpeechBackend,
        voices: VoiceRegistry,
        settings: Settings,
        metrics: GatewayMetrics,
        admission: AdmissionControl,
        normalizer: TextNormalizer,
    ) -> None:
        self._backend = backend
        self._voices = voices
        self._settings = settings
        self._metrics = metrics
        self._admission = admission
        self._normalizer = normalizer

    async def plan(self, request: SpeechRequest) -> SpeechPlan:
        catalog = self._backend.catalog
        model = catalog.resolve(request.model)
        voice = self._voices.resolve(request.voice_id, model, catalog)
        triton_model = catalog.require_streaming_or_offline(model, self._settings.backend_mode)
        normalize = request.text_normalization
        if normalize is None:
            normalize = self._settings.text_normalization
        text = await self._normalizer.normalize_async(request.input) if normalize else request.input
        sentences = synthesis_pieces(text, self._settings)
        return SpeechPlan(
            model=model,
            triton_model=triton_model,
            voice=voice,
            sentences=tuple(sentences),
            speed=request.speed,
            response_format=request.response_format,
            sse=request.stream_format == "sse",
            input_chars=len(request.input),
            seed=request.seed,
            instructions=request.instructions,
        )

    async def open_stream(self, plan: SpeechPlan) -> SpeechStream:
        """Wait for a synthesis slot, start synthesis, wait for the first bytes.

        Raises a :class:`GatewayError` if there is no slot (429) or synthesis fails before
        any byte exists. The returned stream holds the slot until it is closed.
        """
        started = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self._settings.request_timeout
        slot = await self._admission.acquire()
        body = self._sse_body(plan, deadline) if plan.sse else self._encoded(plan, _Progress(), deadline)
        measured = self._measured(plan, body, started)
        try:
            first = await anext(measured)
        except BaseException:
            slot.release()
            raise
        return SpeechStream(first, measured, slot)

    async def _measured(
        self, plan: SpeechPlan, body: AsyncGenerator[bytes, None], started: float
    ) -> AsyncGenerator[bytes, None]:
        async with contextlib.aclosing(body):
            try:
                first = await anext(body, b"")
            except BaseException:
                self._metrics.speech_requests.labels(plan.model.id, plan.response_format, "failed").inc()
                raise
            self._metrics.first_audio.labels(plan.model.id).observe(time.perf_counter() - started)
            outcome = "cancelled"
            self._metrics.in_flight.inc()
            try:
                yield first
                async for piece in body:
                    yield piece
                outcome = "ok"
            finally:
                self._metrics.in_flight.dec()
                self._metrics.speech_requests.labels(plan.model.id, plan.response_format, outcome).inc()
                self._metrics.duration.labels(plan.model.id).observe(time.perf_counter() - started)

    # -- audio ---------------------------------------------------------------------------------------

    # Every generator below closes the one it reads from (``aclosing``), so closing the response's
    # stream stops the backend work at once rather than whenever the garbage collector gets to it.

    async def _sse_body(self, plan: SpeechPlan, deadline: float) -> AsyncGenerator[bytes, None]:
        progress = _Progress()
        async with contextlib.aclosing(self._encoded(plan, progress, deadline)) as encoded:
            async for data in encoded:
                yield _sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
        if progress.error is not None:
            yield _sse_event({"type": "error", **progress.error.body()})
            return
        seconds = progress.samples / plan.model.sample_rate
        yield _sse_event({"type": "speech.audio.done", "usage": _usage(plan.input_chars, seconds)})

    async def _encoded(self, plan: SpeechPlan, progress: _Progress, deadline: float) -> AsyncGenerator[bytes, None]:
        """Encoded audio as the backend produces it, then the encoder's tail.

        A failure before any audio propagates (the response has not started). A failure
        after it is logged and recorded in ``progress``, and the file ends cleanly where
        the audio stops: the headers, and the status code with them, are already sent.
        Running past ``deadline`` while waiting for audio is such a failure.
        """
        encoder = create_encoder(plan.response_format, plan.model.sample_rate)
        try:
            async with contextlib.aclosing(self._audio(plan)) as audio:
                while (chunk := await self._next_chunk(audio, deadline)) is not None:
                    progress.samples += chunk.size
                    data = encoder.encode(chunk) if encoder.cheap else await asyncio.to_thread(encoder.encode, chunk)
                    if data:
                        yield data
        except GatewayError as exc:
            if progress.samples == 0:
                raise
            progress.error = exc
            logger.error("speech stream for model %s ended early: %s", plan.model.id, exc.message)
        if progress.samples == 0:
            raise InvalidRequestError("input contains nothing to speak", param="input", code="nothing_to_speak")
        tail = encoder.finish() if encoder.cheap else await asyncio.to_thread(encoder.finish)
        self._metrics.audio_seconds.labels(plan.model.id).inc(progress.samples / plan.model.sample_rate)
        if tail:
            yield tail

    async def _next_chunk(self, audio: AsyncIterator[Audio], deadline: float) -> Audio | None:
        """The next chunk of ``audio`` (``None`` at its end), if it comes before ``deadline`` (loop time)."""
        try:
            async with asyncio.timeout_at(deadline):
                return await anext(audio, None)
        except TimeoutError:
            limit = self._settings.request_timeout
            raise RequestTimeoutError(f"the request did not finish within the gateway's limit of {limit:g} s") from None

    async def _audio(self, plan: SpeechPlan) -> AsyncGenerator[Audio, None]:
        """Audio at the model's rate, tempo-adjusted here when the model cannot do it."""
        async with contextlib.aclosing(self._synthesise(plan)) as synthesised:
            if plan.backend_speed or plan.speed == 1.0:
                async for chunk in synthesised:
                    yield chunk
                return
            stretcher = TimeStretcher(plan.speed, plan.model.sample_rate)
            async for chunk in synthesised:
                stretched = await asyncio.to_thread(stretcher.process, chunk)
                if stretched.size:
                    yield stretched
        rest = await asyncio.to_thread(stretcher.flush)
        if rest.size:
            yield rest

    async def _synthesise(self, plan: SpeechPlan) -> AsyncGenerator[Audio, None]:
        """Sentences pipelined at the backend with bounded parallelism, audio in order.

        The first sentence runs alone until its first audio arrives: it then has the backend to
        itself (no competition for the first byte), and the later sentences still start long
        before they are due.
        """
        # The response's x-request-id, so Triton's records of each sentence lead back to the request.
        request_id = current_request_id()
        sentences: Iterator[tuple[int, str]] = enumerate(plan.sentences)
        in_flight: deque[tuple[asyncio.Task[None], asyncio.Queue[Audio | _End | GatewayError]]] = deque()
        parallelism = 1

        def launch() -> None:
            while len(in_flight) < parallelism and (item := next(sentences, None)) is not None:
                index, sentence = item
                queue: asyncio.Queue[Audio | _End | GatewayError] = asyncio.Queue(_SENTENCE_QUEUE_CHUNKS)
                task = asyncio.create_task(self._sentence(plan, index, sentence, f"{request_id}-{index}", queue))
                in_flight.append((task, queue))

        launch()
        try:
            while in_flight:
                _, queue = in_flight[0]
                while not isinstance(item := await queue.get(), _End):
                    if isinstance(item, GatewayError):
                        raise item
                    if parallelism == 1:
                        parallelism = self._settings.synthesis_parallelism
                        launch()
                    yield item
                in_flight.popleft()
                launch()
        finally:
            for task, _ in in_flight:
                task.cancel()
            for task, _ in in_flight:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _sentence(
        self,
        plan: SpeechPlan,
        index: int,
        sentence: str,
        request_id: str,
        queue: asyncio.Queue[Audio | _End | GatewayError],
    ) -> None:
        values = plan.backend_inputs(index, sentence)
        backend = self._backend
        try:
            if plan.streaming_backend:
                # Closed here, not by the garbage collector: a cancelled sentence frees its backend call at once.
                async with contextlib.aclosing(backend.stream(plan.triton_model, values, request_id)) as chunks:
                    async for chunk in chunks:
                        await queue.put(chunk)
            else:
                await queue.put(await backend.infer(plan.triton_model, values, request_id))
        except GatewayError as exc:
            await queue.put(exc)
        except Exception as exc:
            # A bug here must not leave the consumer waiting for an end that never comes.
            logger.exception("synthesis of sentence %s failed", request_id)
            await queue.put(BackendError(f"synthesis failed: {type(exc).__name__}", code="internal_error"))
        await queue.put(_END)


def _sse_event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def _usage(input_chars: int, audio_seconds: float) -> dict[str, int]:
    """Estimated usage: ~4 characters per input token, 25 audio tokens per second (CosyVoice2's rate)."""
    input_tokens = math.ceil(input_chars / 4)
    output_tokens = math.ceil(audio_seconds * 25)
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}
