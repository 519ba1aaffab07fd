"""One planned speech request, synthesised and encoded: ordering, parallel sentences, deadlines.

:meth:`SpeechService.open_stream` waits for a synthesis slot (admission control) and
synthesises: up to ``synthesis_parallelism`` sentences are in flight at the synthesizer at
once, and their audio is emitted strictly in order, chunk by chunk, as it arrives. The first
chunk is awaited before the response starts, so a Triton server that is down still yields a 503
rather than an empty 200. The whole request, queue included, runs against one deadline
(``request_timeout``); before the first byte running out is a 504.

Once the first byte is out, a response either ends complete or is aborted, never cut short
as if it were whole:

- a sentence whose server fails mid-stream is restarted on another server (or on the same one
  once it is back, such as a restarted embedded Triton), from the start of that sentence. The
  listener hears that sentence's beginning again, unless the request is reproducible (a seed,
  on a model that takes one): then the samples already sent are skipped and the audio goes on
  where it broke. No text goes unspoken, and the response counts as ``resumed``;
- where that cannot be done (no server, a second failure, a deadline), the response is aborted:
  :class:`StreamAborted` is raised out of the body, so the gateway drops the connection without
  ending the chunked body and every HTTP client reports an error. An SSE response sends its
  ``error`` event first.
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
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from tts_gateway.gateway.errors import GatewayError, InvalidRequestError, RequestTimeoutError
from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.request_ids import current_request_id
from tts_gateway.gateway.speech.admission import AdmissionControl, Slot
from tts_gateway.gateway.speech.audio_encoding import create_encoder
from tts_gateway.gateway.speech.audio_queue import AudioQueue
from tts_gateway.gateway.speech.audio_threads import run_audio_work, run_audio_work_unless_cheap
from tts_gateway.gateway.speech.idle_memory import IdleMemoryRelease
from tts_gateway.gateway.speech.plan import SpeechPlan
from tts_gateway.gateway.speech.time_stretch import TimeStretcher
from tts_gateway.gateway.triton.pool import Failover

logger = logging.getLogger(__name__)

Audio = NDArray[np.float32]


class Synthesizer(Protocol):
    """Where sentences are synthesised (the Triton pool): it picks the server and fails over."""

    async def infer(
        self,
        model: str,
        values: Mapping[str, Any],
        request_id: str,
        *,
        patient: bool = False,
        failover: Failover | None = None,
    ) -> Audio: ...

    def stream(
        self,
        model: str,
        values: Mapping[str, Any],
        request_id: str,
        *,
        patient: bool = False,
        failover: Failover | None = None,
    ) -> AsyncGenerator[Audio, None]: ...


class StreamAborted(Exception):
    """A started response cannot be completed; raised out of its body so the connection drops."""

    def __init__(self, error: GatewayError, sentence: int) -> None:
        super().__init__(f"sentence {sentence}: {error.message}")
        self.error = error
        self.sentence = sentence


# Chunks one sentence may have ready before its producer waits for the reader. A slow reader
# then stalls the Triton stream (gRPC flow control) instead of growing the gateway's memory.
_SENTENCE_QUEUE_CHUNKS = 32


@dataclass
class _Progress:
    """What one response has produced so far, and where it broke."""

    samples: int = 0
    sentence: int = 0
    """The sentence whose audio is being passed on."""
    resumed: list[int] = field(default_factory=list)
    """Sentences that a server failed after the response had started, taken over by another."""
    continued: bool = False
    """The request continues audio its listener already hears (a text stream's later phrase): its
    first sentence is as much part of a started response as the others."""


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
        synthesizer: Synthesizer,
        admission: AdmissionControl,
        metrics: GatewayMetrics,
        *,
        request_timeout: float,
        synthesis_parallelism: int,
        idle_memory: IdleMemoryRelease | None = None,
    ) -> None:
        self._synthesizer = synthesizer
        self._admission = admission
        self._metrics = metrics
        self._request_timeout = request_timeout
        self._parallelism = synthesis_parallelism
        self._idle_memory = idle_memory or IdleMemoryRelease()

    async def open_stream(self, plan: SpeechPlan, *, continued: bool = False) -> SpeechStream:
        """Wait for a synthesis slot, start synthesis, wait for the first bytes.

        Raises a :class:`GatewayError` if there is no slot (429) or synthesis fails before
        any byte exists. The returned stream holds the slot until it is closed. ``continued``:
        the request continues audio that its listener already hears, so its first sentence too
        waits for a server (the restarted one) when its own fails, as every later sentence does.
        """
        started = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self._request_timeout
        slot = await self._admission.acquire()
        progress = _Progress(continued=continued)
        encoded = self._encoded(plan, progress, deadline)
        body = self._sse_body(plan, progress, encoded) if plan.sse else encoded
        measured = self._measured(plan, progress, body, started)
        try:
            first = await anext(measured)
        except BaseException:
            slot.release()
            raise
        return SpeechStream(first, measured, slot)

    async def _measured(
        self, plan: SpeechPlan, progress: _Progress, body: AsyncGenerator[bytes, None], started: float
    ) -> AsyncGenerator[bytes, None]:
        """``body``, counted: its outcome (``ok``, ``resumed``, ``aborted``, ``cancelled`` when the
        client left; ``failed`` before the first byte) in the metrics and in the log."""
        self._idle_memory.begin()
        try:
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
                    outcome = "resumed" if progress.resumed else "ok"
                except StreamAborted as exc:
                    outcome = "aborted"
                    logger.error(
                        "speech response aborted at sentence %d of %d: %s (%s)",
                        exc.sentence,
                        len(plan.sentences),
                        exc.error.message,
                        exc.error.code,
                    )
                    raise
                finally:
                    self._metrics.in_flight.dec()
                    self._metrics.speech_requests.labels(plan.model.id, plan.response_format, outcome).inc()
                    self._metrics.duration.labels(plan.model.id).observe(time.perf_counter() - started)
                    logger.info(
                        "speech response %s: %d sentences, %.2f s of audio%s",
                        outcome,
                        len(plan.sentences),
                        progress.samples / plan.model.sample_rate,
                        f", resumed sentences {progress.resumed}" if progress.resumed else "",
                    )
        finally:
            self._idle_memory.end()

    # -- audio ---------------------------------------------------------------------------------------

    # Every generator below closes the one it reads from (``aclosing``), so closing the response's
    # stream stops the Triton work at once rather than whenever the garbage collector gets to it.

    async def _sse_body(
        self, plan: SpeechPlan, progress: _Progress, encoded: AsyncGenerator[bytes, None]
    ) -> AsyncGenerator[bytes, None]:
        async with contextlib.aclosing(encoded):
            try:
                async for data in encoded:
                    yield _sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
            except StreamAborted as exc:
                # The event tells SSE clients why; the dropped connection after it tells every client.
                yield _sse_event({"type": "error", **exc.error.body()})
                raise
        seconds = progress.samples / plan.model.sample_rate
        yield _sse_event({"type": "speech.audio.done", "usage": _usage(plan.input_chars, seconds)})

    async def _encoded(self, plan: SpeechPlan, progress: _Progress, deadline: float) -> AsyncGenerator[bytes, None]:
        """Encoded audio as the synthesizer produces it, then the encoder's tail; a whole response
        (:attr:`SpeechPlan.whole`) all at once at the end, its encoder writing exact sizes.

        A failure before any audio is sent propagates (the response has not started). One after it
        (running past ``deadline`` included) aborts the response: :class:`StreamAborted`.
        """
        # Closed however the response ends: a client that leaves must not leave the codec to the garbage collector.
        with contextlib.closing(
            create_encoder(plan.response_format, plan.model.sample_rate, streaming=not plan.whole)
        ) as encoder:
            held: list[bytes] = []
            try:
                async with contextlib.aclosing(self._audio(plan, progress)) as audio:
                    while (chunk := await self._next_chunk(audio, deadline)) is not None:
                        progress.samples += chunk.size
                        data = await run_audio_work_unless_cheap(encoder.cheap, encoder.encode, chunk)
                        if plan.whole:
                            held.append(data)
                        elif data:
                            yield data
            except GatewayError as exc:
                if progress.samples == 0 or plan.whole:
                    raise
                raise StreamAborted(exc, progress.sentence) from exc
            if progress.samples == 0:
                raise InvalidRequestError("input contains nothing to speak", param="input", code="nothing_to_speak")
            tail = await run_audio_work_unless_cheap(encoder.cheap, encoder.finish)
        self._metrics.audio_seconds.labels(plan.model.id).inc(progress.samples / plan.model.sample_rate)
        if held or tail:
            yield b"".join([*held, tail])

    async def _next_chunk(self, audio: AsyncIterator[Audio], deadline: float) -> Audio | None:
        """The next chunk of ``audio`` (``None`` at its end), if it comes before ``deadline`` (loop time)."""
        try:
            async with asyncio.timeout_at(deadline):
                return await anext(audio, None)
        except TimeoutError:
            limit = self._request_timeout
            raise RequestTimeoutError(f"the request did not finish within the gateway's limit of {limit:g} s") from None

    async def _audio(self, plan: SpeechPlan, progress: _Progress) -> AsyncGenerator[Audio, None]:
        """Audio at the model's rate, tempo-adjusted here when the model cannot do it."""
        async with contextlib.aclosing(self._synthesise(plan, progress)) as synthesised:
            if plan.model_speed or plan.speed == 1.0:
                async for chunk in synthesised:
                    yield chunk
                return
            stretcher = TimeStretcher(plan.speed, plan.model.sample_rate)
            async for chunk in synthesised:
                stretched = await run_audio_work(stretcher.process, chunk)
                if stretched.size:
                    yield stretched
        rest = await run_audio_work(stretcher.flush)
        if rest.size:
            yield rest

    async def _synthesise(self, plan: SpeechPlan, progress: _Progress) -> AsyncGenerator[Audio, None]:
        """Sentences pipelined at the synthesizer with bounded parallelism, audio in order.

        The first sentence runs alone until its first audio arrives: it then has the server to
        itself (no competition for the first byte), and the later sentences still start long
        before they are due.
        """
        # The response's x-request-id, so Triton's records of each sentence lead back to the request.
        request_id = current_request_id()
        sentences: Iterator[tuple[int, str]] = enumerate(plan.sentences)
        in_flight: deque[tuple[int, asyncio.Task[None], AudioQueue[Audio]]] = deque()
        parallelism = 1

        def launch() -> None:
            while len(in_flight) < parallelism and (item := next(sentences, None)) is not None:
                index, sentence = item
                queue: AudioQueue[Audio] = AudioQueue(_SENTENCE_QUEUE_CHUNKS)
                sentence_id = f"{request_id}-{index}"
                work = self._sentence(plan, index, sentence, sentence_id, queue, progress)
                task = asyncio.create_task(queue.produce(work, f"synthesis of sentence {sentence_id}"))
                in_flight.append((index, task, queue))

        launch()
        try:
            while in_flight:
                progress.sentence, _, queue = in_flight[0]
                while (item := await queue.get()) is not None:
                    if parallelism == 1:
                        parallelism = self._parallelism
                        launch()
                    yield item
                in_flight.popleft()
                launch()
        finally:
            for _, task, _ in in_flight:
                task.cancel()
            for _, task, _ in in_flight:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _sentence(
        self,
        plan: SpeechPlan,
        index: int,
        sentence: str,
        request_id: str,
        queue: AudioQueue[Audio],
        progress: _Progress,
    ) -> None:
        values = plan.model_inputs(index, sentence)
        # Every sentence but the first starts once the response has: waiting for a server beats failing.
        patient = index > 0 or progress.continued

        def failed_over(exc: GatewayError, mid_stream: bool) -> None:
            if not (patient or mid_stream):
                return  # the response has not started: nothing to resume, the call was merely retried
            if index not in progress.resumed:  # a sentence may take several attempts to resume
                progress.resumed.append(index)
            if not mid_stream:
                how = "before any of its audio"
            elif plan.reproducible:
                how = "skipping the audio already sent"
            else:
                how = "repeating it from its start"
            logger.warning("sentence %d broke (%s); resumed on another server, %s", index, exc.message, how)

        failover = Failover(skip_sent=plan.reproducible, notify=failed_over)
        synthesizer = self._synthesizer
        if plan.streaming_model:
            stream = synthesizer.stream(plan.triton_model, values, request_id, patient=patient, failover=failover)
            # Closed here, not by the garbage collector: a cancelled sentence frees its Triton call at once.
            async with contextlib.aclosing(stream) as chunks:
                async for chunk in chunks:
                    await queue.put(chunk)
        else:
            audio = await synthesizer.infer(plan.triton_model, values, request_id, patient=patient, failover=failover)
            await queue.put(audio)


def _sse_event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def _usage(input_chars: int, audio_seconds: float) -> dict[str, int]:
    """Estimated usage: ~4 characters per input token, 25 audio tokens per second (CosyVoice2's rate)."""
    input_tokens = math.ceil(input_chars / 4)
    output_tokens = math.ceil(audio_seconds * 25)
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}
