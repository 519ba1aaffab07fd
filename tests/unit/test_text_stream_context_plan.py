"""A text stream's context is planned once, when it opens: the gateway's own planner, voice registry and
speech service in process, over a synthesizer that records what each Triton call was sent.

A context is one turn in one voice: its pieces are only normalised and cut into sentences, so a voice
deleted while the context speaks is still the voice of the rest of its text (the recording it opened
with), and only the next context finds the voice gone.
"""

from __future__ import annotations

import asyncio
import functools
import io
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import soundfile as sf

from tests.unit.test_text_stream_session import RecordingSocket, multi_stream_session
from tts_gateway.gateway.api.text_stream.metrics import TextStreamMetrics
from tts_gateway.gateway.api.text_stream.service import TextStreamService
from tts_gateway.gateway.api.text_stream.session import TextStreamLimits
from tts_gateway.gateway.errors import InvalidRequestError
from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.settings import Settings
from tts_gateway.gateway.speech.admission import AdmissionControl
from tts_gateway.gateway.speech.audio_encoding import OUTPUT_SAMPLE_RATE
from tts_gateway.gateway.speech.plan import SpeechPlanner
from tts_gateway.gateway.speech.service import Audio, SpeechService
from tts_gateway.gateway.speech.text_normalization import TextNormalizer
from tts_gateway.gateway.speech.text_stream.phrase_chunker import PhraseChunker
from tts_gateway.gateway.speech.text_stream.synthesis import SpeechChunk, SpeechServicePhrases, VoiceChoice
from tts_gateway.gateway.speech.voice_registry import VoiceRegistry
from tts_gateway.gateway.triton.live_catalog import LiveCatalog
from tts_gateway.gateway.triton.model_catalog import ModelCatalog, SpeechModel
from tts_gateway.models import contract
from tts_gateway.paths import REFERENCE_VOICES

CLONING = SpeechModel(
    id="cloner",
    description="",
    sample_rate=OUTPUT_SAMPLE_RATE,
    supports_cloning=True,
    speed_variants=frozenset(),
    builtin_voices=(),
    languages=("en",),
    inputs=frozenset({contract.TARGET_TEXT, contract.REFERENCE_WAV, contract.REFERENCE_WAV_LEN}),
    offline_model="cloner",
    stream_model="cloner_stream",
)
VOICE = VoiceChoice("mine", "cloner")


@dataclass
class RecordingSynthesizer:
    """Speaks a tenth of a second per sentence; records the inputs of every call."""

    calls: list[Mapping[str, Any]] = field(default_factory=list)

    async def infer(self, model: str, values: Mapping[str, Any], request_id: str, **_: Any) -> Audio:
        self.calls.append(values)
        return np.full(OUTPUT_SAMPLE_RATE // 10, 0.1, dtype=np.float32)

    async def stream(
        self, model: str, values: Mapping[str, Any], request_id: str, **_: Any
    ) -> AsyncGenerator[Audio, None]:
        yield await self.infer(model, values, request_id)


@dataclass
class Gateway:
    registry: VoiceRegistry
    synthesizer: RecordingSynthesizer
    streams: TextStreamService


@pytest.fixture(scope="module")
def normalizer() -> Iterator[TextNormalizer]:
    normalizer = TextNormalizer()
    yield normalizer
    normalizer.close()


@pytest.fixture()
async def gateway(tmp_path: Path, normalizer: TextNormalizer) -> Gateway:
    registry = VoiceRegistry(REFERENCE_VOICES, tmp_path / "voices", min_seconds=1.0, max_seconds=30.0, aliases={})
    registry.load()
    recording = np.sin(2 * np.pi * 200 * np.arange(2 * 22_050) / 22_050) * 0.3
    buffer = io.BytesIO()
    sf.write(buffer, recording, 22_050, format="WAV")
    await registry.add_upload("mine", buffer.getvalue(), "a recording of mine")
    catalog = cast(LiveCatalog, SimpleNamespace(current=ModelCatalog([CLONING])))
    planner = SpeechPlanner(catalog, registry, Settings(_env_file=None, text_normalization=True), normalizer)
    synthesizer = RecordingSynthesizer()
    metrics = GatewayMetrics()
    admission = AdmissionControl(slots=2, max_queued=2, queue_timeout=1.0, metrics=metrics)
    speech = SpeechService(synthesizer, admission, metrics, request_timeout=10.0, synthesis_parallelism=2)
    phrases = functools.partial(SpeechServicePhrases, planner, speech.open_stream)
    streams = TextStreamService(planner, phrases, TextStreamLimits(), TextStreamMetrics(metrics))
    return Gateway(registry, synthesizer, streams)


async def test_a_voice_deleted_mid_context_still_speaks_the_rest_of_it(gateway: Gateway) -> None:
    uploaded = gateway.registry.get("mine")
    assert uploaded is not None
    context = gateway.streams.synthesizer(VOICE, PhraseChunker(auto_mode=True), asyncio.Semaphore(2))
    chunks = aiter(context.chunks())
    await context.push("It costs $5.")
    first: SpeechChunk = await anext(chunks)
    assert first.pcm

    await gateway.registry.delete("mine")
    assert gateway.registry.get("mine") is None
    await context.push(" Then the voice is gone.")
    await context.end_input()
    rest = [chunk async for chunk in chunks]

    assert rest and all(chunk.pcm for chunk in rest)
    # Each piece only normalised and cut into sentences, in the voice resolved when the context opened.
    assert [call[contract.TARGET_TEXT] for call in gateway.synthesizer.calls] == [
        "It costs five dollars.",
        "Then the voice is gone.",
    ]
    for call in gateway.synthesizer.calls:
        assert np.array_equal(call[contract.REFERENCE_WAV], uploaded.audio.samples)
    await context.aclose()

    # The next context resolves the voice again, and finds it gone.
    with pytest.raises(InvalidRequestError) as gone:
        gateway.streams.synthesizer(VOICE, PhraseChunker(), asyncio.Semaphore(2))
    assert gone.value.code == "voice_not_found"


async def test_a_context_opened_after_its_voice_was_deleted_fails_the_socket(gateway: Gateway) -> None:
    """The socket was accepted with the voice; a context opened once it is gone ends the socket as a failed
    synthesis does: the context's error, then 1011, and no ``isFinal``."""
    await gateway.registry.delete("mine")
    socket = RecordingSocket([{"text": "Hello there. ", "context_id": "late", "flush": True}])
    session = multi_stream_session(
        socket, gateway.streams.synthesizer, GatewayMetrics(), inactivity_timeout=20, voice=VOICE
    )
    await asyncio.wait_for(session.run(), 10)
    assert socket.closed is not None and socket.closed[0] == 1011
    error = next(message for message in socket.sent if message.get("contextId") == "late")
    assert error["error"] == "voice_not_found"
    assert not any(message.get("isFinal") for message in socket.sent)
    assert gateway.synthesizer.calls == []
