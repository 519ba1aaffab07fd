"""The Wyoming server (Home Assistant's local voice protocol), over real sockets with the ``wyoming``
package's own client, against a real gateway process in front of the embedded CPU default (Piper):
describe, one-shot and streamed synthesis with what the voice says, Home Assistant's repeated text,
errors, a client that leaves mid-audio, the connection limit, and the zeroconf announcement.

Home Assistant's own Wyoming integration does not run here: its releases since 2025.2 need Python 3.13
or later (3.14 since 2026.3), and these tests run on 3.11. The streamed test sends the events in the
order Home Assistant's client does, the whole text again included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from wyoming.audio import AudioChunk, AudioStart
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncZeroconf

from tests.audio_checks import DecodedAudio
from tests.e2e.conftest import PiperReference
from tests.e2e.gateway_process import GatewayProcess, free_port
from tests.speech_recognition import transcribe
from tts_gateway.gateway.api.wyoming import discovery
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = pytest.mark.triton

SENTENCE = "The quick brown fox jumps over the lazy dog."
SECOND = "A wizard quickly jinxed the gnomes before they vaporized."
JOE = SynthesizeVoice(name="joe")
MAX_CONNECTIONS = 2


class WyomingGateway:
    def __init__(self, process: GatewayProcess, port: int) -> None:
        self.process = process
        self.port = port

    def client(self) -> AsyncTcpClient:
        return AsyncTcpClient("127.0.0.1", self.port)


@pytest.fixture(scope="module")
def wyoming(cpu_triton: EmbeddedTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WyomingGateway]:
    workdir = tmp_path_factory.mktemp("wyoming")
    port = free_port()
    process = GatewayProcess(
        workdir / "gateway.log",
        {
            "TTS_TRITON_URL": cpu_triton.grpc_url,
            "TTS_VOICES_DIR": str(workdir / "voices"),
            "TTS_WYOMING_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        },
        ["--wyoming-port", str(port), "--wyoming-zeroconf"],
    )
    process.start()
    yield WyomingGateway(process, port)
    process.stop()


async def read_until(client: AsyncTcpClient, *types: str) -> list[Event]:
    """Events up to the first of ``types`` or an ``error``, that one included."""
    events: list[Event] = []
    while True:
        event = await asyncio.wait_for(client.read_event(), 60)
        assert event is not None, f"connection closed after {[e.type for e in events]}"
        events.append(event)
        if event.type in types or Error.is_type(event.type):
            return events


def speech(events: list[Event]) -> DecodedAudio:
    """The audio of ``events``: 16-bit mono at the rate its ``audio-start`` announced."""
    start = next(AudioStart.from_event(e) for e in events if AudioStart.is_type(e.type))
    chunks = [AudioChunk.from_event(e) for e in events if AudioChunk.is_type(e.type)]
    assert all((c.rate, c.width, c.channels) == (start.rate, 2, 1) for c in chunks)
    pcm = b"".join(chunk.audio for chunk in chunks)
    return DecodedAudio(np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0, start.rate, 1)


def heard(audio: DecodedAudio, *words: str) -> int:
    said = transcribe(audio).split()
    return sum(word in said for word in words)


async def metric(gateway: GatewayProcess, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{gateway.url}/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def model_rate(gateway: GatewayProcess, voice: str) -> int:
    """The sample rate ``GET /v1/audio/models`` lists for the model whose own voice ``voice`` is."""
    async with httpx.AsyncClient(timeout=10) as client:
        models = (await client.get(f"{gateway.url}/v1/audio/models")).json()["models"]
    (rate,) = [model["sample_rate"] for model in models if voice in model["voices"]]
    return int(rate)


async def speech_requests(gateway: GatewayProcess) -> tuple[float, float]:
    """Speech requests the speech service has started (every outcome), and those in flight now."""
    return await metric(gateway, "tts_speech_requests_total"), await metric(gateway, "tts_speech_in_flight")


async def test_describe_lists_the_voices_as_home_assistant_needs_them(wyoming: WyomingGateway) -> None:
    async with wyoming.client() as client:
        await client.write_event(Describe().event())
        event = await asyncio.wait_for(client.read_event(), 30)
    assert event is not None and Info.is_type(event.type)
    (program,) = Info.from_event(event).tts
    assert program.installed and program.supports_synthesize_streaming
    voices = {voice.name: voice for voice in program.voices}
    # Piper cannot clone: the shipped reference voices are not offered.
    assert list(voices) == ["joe"]
    assert voices["joe"].installed and voices["joe"].languages == ["en"]
    assert voices["joe"].attribution.name and voices["joe"].version


async def test_synthesize_says_the_text(wyoming: WyomingGateway, piper_seconds: PiperReference) -> None:
    async with wyoming.client() as client:
        await client.write_event(Synthesize(text=SENTENCE, voice=JOE).event())
        events = await read_until(client, "audio-stop")
    assert events[0].type == "audio-start" and events[-1].type == "audio-stop"
    audio = speech(events)
    # Piper's joe speaks at 22,050 Hz: sent at that rate, as announced in audio-start.
    assert audio.sample_rate == await model_rate(wyoming.process, "joe") == 22_050
    # As long as Piper's own audio: samples at another rate than announced would be 9 % off, while
    # one draw of Piper's noisy durations lies within about 2 % of their mean.
    expected = piper_seconds.mean(SENTENCE)
    assert abs(audio.duration - expected) < 0.06 * expected
    assert audio.rms > 0.01
    assert heard(audio, "quick", "brown", "fox", "lazy", "dog") >= 3


async def test_streamed_text_is_spoken_while_it_comes_and_once(
    wyoming: WyomingGateway, piper_seconds: PiperReference
) -> None:
    async with wyoming.client() as client:
        await client.write_event(SynthesizeStart(voice=JOE).event())
        for word in f"{SENTENCE} A".split(" "):
            await client.write_event(SynthesizeChunk(text=f"{word} ").event())
            await asyncio.sleep(0.02)
        # The first sentence is complete: its audio comes while the rest of the text has not.
        early = await read_until(client, "audio-chunk")
        for word in SECOND.split(" ")[1:]:
            await client.write_event(SynthesizeChunk(text=f"{word} ").event())
        # Home Assistant's copy of the whole text, for servers that do not stream.
        await client.write_event(Synthesize(text=f"{SENTENCE} {SECOND}", voice=JOE).event())
        await client.write_event(SynthesizeStop().event())
        late = await read_until(client, "synthesize-stopped")
    events = early + late
    types = [event.type for event in events]
    assert types.count("audio-start") == 1 and types[-2:] == ["audio-stop", "synthesize-stopped"]
    audio = speech(events)
    assert audio.sample_rate == await model_rate(wyoming.process, "joe")
    once = piper_seconds(SENTENCE) + piper_seconds(SECOND)
    # Spoken once: twice the text would be twice as long.
    assert 0.75 * once < audio.duration < 1.3 * once
    assert heard(audio, "quick", "brown", "fox", "lazy", "dog", "wizard", "gnomes") >= 4


async def test_an_unknown_voice_is_an_error_event(wyoming: WyomingGateway) -> None:
    before = await metric(wyoming.process, "tts_wyoming_errors_total", code="voice_not_found")
    async with wyoming.client() as client:
        await client.write_event(Synthesize(text=SENTENCE, voice=SynthesizeVoice(name="nobody")).event())
        event = await asyncio.wait_for(client.read_event(), 30)
        assert event is not None and Error.is_type(event.type)
        error = Error.from_event(event)
        assert error.code == "voice_not_found" and "nobody" in error.text
        assert await asyncio.wait_for(client.read_event(), 30) is None
    assert await metric(wyoming.process, "tts_wyoming_errors_total", code="voice_not_found") == before + 1


async def test_a_client_that_leaves_mid_audio_has_its_synthesis_cancelled(wyoming: WyomingGateway) -> None:
    sentences = [SENTENCE, SECOND] * 8
    before, _ = await speech_requests(wyoming.process)
    client = wyoming.client()
    await client.connect()
    await client.write_event(Synthesize(text=" ".join(sentences), voice=JOE).event())
    await read_until(client, "audio-chunk")
    await client.disconnect()
    # Synthesis stops: nothing is in flight any more, long before every sentence could be spoken ...
    in_flight = 1.0
    for _ in range(100):
        started, in_flight = await speech_requests(wyoming.process)
        if in_flight == 0:
            break
        await asyncio.sleep(0.1)
    assert in_flight == 0
    # ... and stays so: the sentences after the first few were never started.
    await asyncio.sleep(1.0)
    started, in_flight = await speech_requests(wyoming.process)
    assert in_flight == 0 and started - before < len(sentences) / 2
    assert "Wyoming connection closed while speaking; synthesis cancelled" in wyoming.process.log_tail(200)


async def test_connections_over_the_limit_are_refused_with_an_error(wyoming: WyomingGateway) -> None:
    async with wyoming.client() as one, wyoming.client() as two:
        for client in (one, two):
            await client.write_event(Describe().event())
            assert await asyncio.wait_for(client.read_event(), 30) is not None
        async with wyoming.client() as three:
            event = await asyncio.wait_for(three.read_event(), 30)
            assert event is not None and Error.from_event(event).code == "too_many_connections"
            assert await asyncio.wait_for(three.read_event(), 30) is None
    # Once the server has seen them go, a connection is served again.
    for _ in range(100):
        if await metric(wyoming.process, "tts_wyoming_connections_open") == 0:
            break
        await asyncio.sleep(0.1)
    async with wyoming.client() as again:
        await again.write_event(Describe().event())
        event = await asyncio.wait_for(again.read_event(), 30)
        assert event is not None and Info.is_type(event.type)


async def test_zeroconf_announces_the_server_on_loopback(wyoming: WyomingGateway) -> None:
    browser = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    try:
        name = f"{discovery.service_name(wyoming.port)}.{discovery.SERVICE_TYPE}"
        info = await browser.async_get_service_info(discovery.SERVICE_TYPE, name, timeout=5000)
    finally:
        await browser.async_close()
    assert info is not None
    assert info.port == wyoming.port and info.parsed_addresses() == ["127.0.0.1"]


async def test_every_worker_serves_wyoming_on_one_port(cpu_triton: EmbeddedTriton, tmp_path: Path) -> None:
    port = free_port()
    process = GatewayProcess(
        tmp_path / "gateway.log",
        {"TTS_TRITON_URL": cpu_triton.grpc_url, "TTS_VOICES_DIR": str(tmp_path / "voices")},
        ["--workers", "2", "--wyoming-port", str(port)],
    )
    await asyncio.to_thread(process.start)
    try:
        # Both bind the port (a worker that could not would fail its start-up); /health answers
        # once the first worker is up.
        listening = f"Wyoming text-to-speech server on tcp://127.0.0.1:{port}"
        for _ in range(600):
            if process.log_tail(400).count(listening) == 2:
                break
            await asyncio.sleep(0.1)
        assert process.log_tail(400).count(listening) == 2, process.log_tail()
        for _ in range(4):
            async with AsyncTcpClient("127.0.0.1", port) as client:
                await client.write_event(Synthesize(text=SENTENCE, voice=JOE).event())
                events = await read_until(client, "audio-stop")
            assert speech(events).duration > 1.5
    finally:
        await asyncio.to_thread(process.stop)
