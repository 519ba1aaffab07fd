"""SpeechService's core logic against an in-process synthesizer that plays a script per sentence.

Each sentence's text is its script, steps separated by spaces:

- ``aN``: a 100-sample chunk whose samples are all ``N / 10`` (so the output says which sentence it came from);
- ``pN``: pause N seconds;
- ``hang``: wait until cancelled;
- ``fail``, ``down``, ``stall``: raise SynthesisError (502), ServerUnavailableError (503), ServerTimeoutError (504,
  what a chunk timeout raises);
- ``resume``: report a failover mid-stream, as the pool does when it restarts a sentence on another server;
- ``retried``: report a failover before the call's first audio (the pool sent the call to another server).

These test ordering, parallelism, deadlines and cancellation; the real failover (which server, what
the listener hears) is tested end to end against real Triton servers.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import wave
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from tests.audio_checks import decode
from tts_gateway.gateway.errors import (
    GatewayError,
    RequestTimeoutError,
    ServerTimeoutError,
    ServerUnavailableError,
    SynthesisError,
)
from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.speech import audio_encoding
from tts_gateway.gateway.speech import service as service_module
from tts_gateway.gateway.speech.admission import AdmissionControl
from tts_gateway.gateway.speech.audio_encoding import OUTPUT_SAMPLE_RATE, AudioFormat, StreamEncoder
from tts_gateway.gateway.speech.idle_memory import IdleMemoryRelease
from tts_gateway.gateway.speech.plan import SpeechPlan
from tts_gateway.gateway.speech.service import Audio, SpeechService, SpeechStream, StreamAborted
from tts_gateway.gateway.speech.voice_registry import ResolvedVoice
from tts_gateway.gateway.triton.model_catalog import SpeechModel
from tts_gateway.gateway.triton.pool import Failover
from tts_gateway.models import contract

CHUNK = 100
MODEL = SpeechModel(
    id="fake",
    description="",
    sample_rate=OUTPUT_SAMPLE_RATE,
    supports_cloning=False,
    speed_variants=frozenset(),
    builtin_voices=("v",),
    languages=("en",),
    inputs=frozenset({contract.TARGET_TEXT}),
    offline_model="fake",
    stream_model="fake_stream",
)


@dataclass
class FakeSynthesizer:
    """Plays each sentence's script; records which calls started, finished and were closed early."""

    started: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    patient: dict[str, bool] = field(default_factory=dict)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)

    async def infer(
        self,
        model: str,
        values: Mapping[str, Any],
        request_id: str,
        *,
        patient: bool = False,
        failover: Failover | None = None,
    ) -> Audio:
        chunks = [c async for c in self.stream(model, values, request_id, patient=patient, failover=failover)]
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)

    async def stream(
        self,
        model: str,
        values: Mapping[str, Any],
        request_id: str,
        *,
        patient: bool = False,
        failover: Failover | None = None,
    ) -> AsyncGenerator[Audio, None]:
        name = request_id.rpartition("-")[2]
        self.started.append(name)
        self.patient[name] = patient
        done = False
        try:
            for step in str(values[contract.TARGET_TEXT]).split():
                if name in self.gates:
                    await self.gates[name].wait()
                if step.startswith("a"):
                    yield np.full(CHUNK, int(step[1:]) / 10, dtype=np.float32)
                elif step.startswith("p"):
                    await asyncio.sleep(float(step[1:]))
                elif step == "hang":
                    await asyncio.Event().wait()
                elif step == "resume":
                    assert failover is not None
                    failover.notify(ServerUnavailableError("the Triton server is unavailable"), True)
                elif step == "retried":
                    assert failover is not None
                    failover.notify(ServerUnavailableError("the Triton server is unavailable"), False)
                else:
                    error: type[GatewayError] = {
                        "fail": SynthesisError,
                        "down": ServerUnavailableError,
                        "stall": ServerTimeoutError,
                    }[step]
                    raise error(f"{step} as the script says")
            done = True
            self.finished.append(name)
        finally:
            if not done:
                self.closed.append(name)


@dataclass
class Setup:
    synthesizer: FakeSynthesizer
    admission: AdmissionControl
    metrics: GatewayMetrics
    service: SpeechService

    def outcome(self, outcome: str) -> float:
        labels = {"model": "fake", "format": "pcm", "outcome": outcome}
        return self.metrics.registry.get_sample_value("tts_speech_requests_total", labels) or 0.0


def setup(
    *, parallelism: int = 3, request_timeout: float = 10.0, idle_memory: IdleMemoryRelease | None = None
) -> Setup:
    synthesizer = FakeSynthesizer()
    metrics = GatewayMetrics()
    admission = AdmissionControl(slots=2, max_queued=2, queue_timeout=1.0, metrics=metrics)
    service = SpeechService(
        synthesizer,
        admission,
        metrics,
        request_timeout=request_timeout,
        synthesis_parallelism=parallelism,
        idle_memory=idle_memory,
    )
    return Setup(synthesizer, admission, metrics, service)


def plan(
    *sentences: str, sse: bool = False, streaming: bool = True, whole: bool = False, fmt: AudioFormat = "pcm"
) -> SpeechPlan:
    return SpeechPlan(
        model=MODEL,
        triton_model="fake_stream" if streaming else "fake",
        voice=ResolvedVoice("v"),
        sentences=sentences,
        speed=1.0,
        response_format=fmt,
        sse=sse,
        input_chars=sum(len(s) for s in sentences),
        whole=whole,
    )


async def read_all(stream: SpeechStream) -> bytes:
    try:
        return b"".join([piece async for piece in stream])
    finally:
        await stream.aclose()


def chunk_values(pcm: bytes) -> list[int]:
    """The script's ``aN`` values, one per 100-sample chunk of 16-bit PCM."""
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767
    assert samples.size % CHUNK == 0
    return [round(float(samples[i]) * 10) for i in range(0, samples.size, CHUNK)]


@pytest.mark.parametrize("streaming", [True, False])
async def test_sentences_come_out_in_order_when_later_ones_finish_first(streaming: bool) -> None:
    s = setup(parallelism=3)
    stream = await s.service.open_stream(plan("a1 p0.3 a1", "p0.2 a2 a2", "a3", "a4", streaming=streaming))
    assert chunk_values(await read_all(stream)) == [1, 1, 2, 2, 3, 4]
    # Sentence 2 was done while 1 was still speaking: parallel, yet its audio waited its turn.
    assert s.synthesizer.finished.index("2") < s.synthesizer.finished.index("1")
    assert s.outcome("ok") == 1
    assert s.admission.in_use == 0


async def test_the_first_sentence_runs_alone_until_its_first_audio() -> None:
    s = setup(parallelism=3)
    s.synthesizer.gates["0"] = gate = asyncio.Event()
    opening = asyncio.create_task(s.service.open_stream(plan("a1 a1", "a2", "a3")))
    await asyncio.sleep(0.1)
    assert s.synthesizer.started == ["0"]
    gate.set()
    stream = await opening
    assert chunk_values(await read_all(stream)) == [1, 1, 2, 3]
    assert sorted(s.synthesizer.started) == ["0", "1", "2"]
    # Only the calls made once the response had started may wait for a server.
    assert s.synthesizer.patient == {"0": False, "1": True, "2": True}


async def test_a_continued_request_waits_for_a_server_from_its_first_sentence() -> None:
    """A text stream's later phrase continues audio already heard: its first sentence is patient too."""
    s = setup(parallelism=2)
    stream = await s.service.open_stream(plan("a1", "a2"), continued=True)
    assert chunk_values(await read_all(stream)) == [1, 2]
    assert s.synthesizer.patient == {"0": True, "1": True}


async def test_parallelism_bounds_the_sentences_in_flight() -> None:
    s = setup(parallelism=2)
    stream = await s.service.open_stream(plan("a1 p0.2", "a2 p0.2", "a3", "a4"))
    await asyncio.sleep(0.1)
    assert s.synthesizer.started == ["0", "1"]
    assert chunk_values(await read_all(stream)) == [1, 2, 3, 4]


async def test_the_request_deadline_before_the_first_byte_is_a_504_and_frees_the_slot() -> None:
    s = setup(request_timeout=0.3)
    with pytest.raises(RequestTimeoutError):
        await s.service.open_stream(plan("hang"))
    assert s.synthesizer.closed == ["0"]
    assert s.admission.in_use == 0
    assert s.outcome("failed") == 1


async def test_the_request_deadline_after_the_first_byte_aborts_the_response() -> None:
    s = setup(request_timeout=0.5)
    stream = await s.service.open_stream(plan("a1", "a2 hang"))
    with pytest.raises(StreamAborted) as aborted:
        await read_all(stream)
    assert isinstance(aborted.value.error, RequestTimeoutError)
    assert aborted.value.sentence == 1
    assert s.synthesizer.closed == ["1"]
    assert s.outcome("aborted") == 1
    assert s.outcome("ok") == 0
    assert s.admission.in_use == 0


async def test_a_chunk_timeout_before_the_first_byte_is_a_504() -> None:
    s = setup()
    with pytest.raises(ServerTimeoutError):
        await s.service.open_stream(plan("stall", "a2"))
    assert s.synthesizer.started == ["0"]


async def test_a_chunk_timeout_after_the_first_byte_aborts_at_its_sentence() -> None:
    s = setup()
    stream = await s.service.open_stream(plan("a1", "a2", "a3 stall", "a4"))
    received = bytearray()
    with pytest.raises(StreamAborted) as aborted:
        async for piece in stream:
            received += piece
    await stream.aclose()
    assert aborted.value.sentence == 2
    assert isinstance(aborted.value.error, ServerTimeoutError)
    # Everything before the broken sentence's failure was passed on, nothing after it.
    assert chunk_values(bytes(received)) == [1, 2, 3]


async def test_a_client_that_leaves_cancels_every_call_in_flight() -> None:
    s = setup(parallelism=3)
    stream = await s.service.open_stream(plan("a1 hang", "a2 hang", "a3 hang", "a4"))
    assert chunk_values(await anext(stream)) == [1]
    await asyncio.sleep(0.1)
    assert s.synthesizer.started == ["0", "1", "2"]
    await stream.aclose()  # what the response does when its client disconnects
    assert sorted(s.synthesizer.closed) == ["0", "1", "2"]
    assert "3" not in s.synthesizer.started
    assert s.admission.in_use == 0
    assert s.outcome("cancelled") == 1


@pytest.mark.parametrize(("step", "status"), [("fail", 502), ("down", 503)], ids=["model-failed", "backend-down"])
async def test_an_error_before_the_first_byte_is_the_responses_status(step: str, status: int) -> None:
    s = setup()
    with pytest.raises(GatewayError) as failed:
        await s.service.open_stream(plan(step, "a2"))
    assert failed.value.status_code == status
    assert s.admission.in_use == 0
    assert s.outcome("failed") == 1


async def test_an_error_after_the_first_byte_aborts_the_audio_body() -> None:
    s = setup()
    stream = await s.service.open_stream(plan("a1", "a2 down", "a3"))
    with pytest.raises(StreamAborted) as aborted:
        await read_all(stream)
    assert aborted.value.sentence == 1
    assert aborted.value.error.code == "backend_unavailable"
    assert s.outcome("aborted") == 1


@pytest.mark.parametrize("ending", ["client-left", "aborted", "failed", "complete"])
async def test_a_response_closes_its_encoder_however_it_ends(ending: str, monkeypatch: pytest.MonkeyPatch) -> None:
    encoders: list[StreamEncoder] = []

    def recorded(*args: Any, **kwargs: Any) -> StreamEncoder:
        encoders.append(audio_encoding.create_encoder(*args, **kwargs))
        return encoders[-1]

    monkeypatch.setattr(service_module, "create_encoder", recorded)
    s = setup()
    # 0.3 s of audio before anything else: enough for the first mp3 frames to leave the encoder.
    speech = " ".join(["a1"] * 72)
    if ending == "failed":
        with pytest.raises(GatewayError):
            await s.service.open_stream(plan("fail", fmt="mp3"))
    else:
        script = {"client-left": [speech, "hang"], "aborted": [speech, "down"], "complete": [speech]}[ending]
        stream = await s.service.open_stream(plan(*script, fmt="mp3"))
        if ending == "client-left":
            assert await anext(stream)
            await stream.aclose()
        elif ending == "aborted":
            with pytest.raises(StreamAborted):
                await read_all(stream)
        else:
            assert decode(await read_all(stream), "mp3").duration > 0.25
    (encoder,) = encoders
    # A closed encoder takes no more audio: its codec was let go with the response, not left to the collector.
    with pytest.raises(RuntimeError, match="finished"):
        encoder.encode(np.zeros(CHUNK, dtype=np.float32))


async def test_a_whole_response_comes_in_one_piece_and_a_failure_anywhere_is_its_status() -> None:
    s = setup(parallelism=3)
    stream = await s.service.open_stream(plan("a1 p0.1 a1", "a2", "a3", whole=True))
    pieces = [piece async for piece in stream]
    await stream.aclose()
    assert len(pieces) == 1 and chunk_values(pieces[0]) == [1, 1, 2, 3]
    assert s.outcome("ok") == 1
    with pytest.raises(GatewayError) as failed:
        await s.service.open_stream(plan("a1", "a2 down", "a3", whole=True))
    assert failed.value.status_code == 503
    assert s.outcome("failed") == 1
    assert s.admission.in_use == 0


async def test_a_whole_wav_response_has_its_true_sizes() -> None:
    s = setup()
    body = await read_all(await s.service.open_stream(plan("a1 a1", "a2", whole=True, fmt="wav")))
    with wave.open(io.BytesIO(body)) as reader:
        assert reader.getnframes() == 3 * CHUNK
        assert chunk_values(reader.readframes(3 * CHUNK)) == [1, 1, 2]
    streamed = await read_all(await s.service.open_stream(plan("a1 a1", "a2", fmt="wav")))
    assert streamed[44:] == body[44:]
    assert struct.unpack_from("<I", streamed, 40)[0] == 0xFFFFFFFF


async def test_an_sse_stream_sends_its_error_event_then_aborts() -> None:
    s = setup()
    stream = await s.service.open_stream(plan("a1", "fail", sse=True))
    events = []
    with pytest.raises(StreamAborted):
        async for piece in stream:
            events.append(json.loads(piece.decode().removeprefix("data: ")))
    await stream.aclose()
    assert [e["type"] for e in events] == ["speech.audio.delta", "error"]
    assert chunk_values(base64.b64decode(events[0]["audio"])) == [1]
    assert events[1]["error"]["code"] == "backend_error"


async def test_a_complete_sse_stream_ends_with_done() -> None:
    s = setup()
    stream = await s.service.open_stream(plan("a1", "a2", sse=True))
    events = [
        json.loads(line.removeprefix("data: ")) for line in (await read_all(stream)).decode().split("\n\n") if line
    ]
    assert [e["type"] for e in events] == ["speech.audio.delta", "speech.audio.delta", "speech.audio.done"]


async def test_a_resumed_sentence_counts_the_response_as_resumed() -> None:
    s = setup()
    stream = await s.service.open_stream(plan("a1", "a2 resume a2", "a3"))
    assert chunk_values(await read_all(stream)) == [1, 2, 2, 3]
    assert s.outcome("resumed") == 1
    assert s.outcome("ok") == 0


async def test_a_call_retried_elsewhere_counts_as_resumed_only_once_the_response_has_started() -> None:
    s = setup()
    stream = await s.service.open_stream(plan("retried a1", "a2"))
    assert chunk_values(await read_all(stream)) == [1, 2]
    assert s.outcome("ok") == 1
    stream = await s.service.open_stream(plan("a1", "retried a2"))
    assert chunk_values(await read_all(stream)) == [1, 2]
    assert s.outcome("resumed") == 1


async def test_free_memory_goes_back_once_after_responses_of_every_ending_and_never_during_one() -> None:
    releases: list[int] = []
    idle = IdleMemoryRelease(delay_s=0.05, release=lambda: releases.append(1))
    s = setup(idle_memory=idle)
    await read_all(await s.service.open_stream(plan("a1", "a2")))  # completed
    with pytest.raises(GatewayError):
        await s.service.open_stream(plan("fail"))  # failed before its first byte
    with pytest.raises(StreamAborted):
        await read_all(await s.service.open_stream(plan("a1", "down")))  # aborted
    running = await s.service.open_stream(plan("a1 hang"))
    assert idle.active == 1
    await asyncio.sleep(0.2)
    assert releases == []  # a response is still open
    await running.aclose()  # cancelled by its client
    assert idle.active == 0
    await asyncio.sleep(0.3)
    assert releases == [1]
