"""The Wyoming server's event handling and voice mapping, in process: the real server, handler, phrase
chunker and phrase pipeline over a loopback socket with the ``wyoming`` package's own client, and a
synthesizer that stands in for the speech service (text in, PCM out, every phrase and cancellation
recorded)."""

from __future__ import annotations

import asyncio
import io
import ipaddress
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncZeroconf

from tests.e2e.gateway_process import free_port
from tts_gateway.gateway.api.wyoming import discovery
from tts_gateway.gateway.api.wyoming.handler import RATE, WyomingLimits
from tts_gateway.gateway.api.wyoming.server import WyomingServer, serving
from tts_gateway.gateway.api.wyoming.voices import choose, describe, list_voices
from tts_gateway.gateway.errors import InvalidRequestError, SynthesisError
from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.settings import Settings
from tts_gateway.gateway.speech.text_stream.synthesis import PhrasePipeline, SpeechChunk, VoiceChoice
from tts_gateway.gateway.speech.voice_registry import VoiceRegistry
from tts_gateway.gateway.triton.model_catalog import ModelCatalog, SpeechModel
from tts_gateway.paths import REFERENCE_VOICES

# Bytes of PCM the stand-in synthesizer makes per character of a phrase.
BYTES_PER_CHAR = 200


class PhraseAudioStub:
    def __init__(self, owner: Phrases, text: str) -> None:
        self.normalized = text
        self._owner = owner
        self._text = text

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._owner.fail_on is not None and self._owner.fail_on in self._text:
            raise SynthesisError("the backend broke", code="backend_error")
        await self._owner.gate.wait()
        yield b"\x01\x00" * (len(self._text) * BYTES_PER_CHAR // 2)

    async def aclose(self) -> None:
        self._owner.closed.append(self._text)


class Phrases:
    """The :class:`PhraseSynthesizer` of every request: every phrase opened, and every one closed, recorded."""

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_on: str | None = None

    def context(self, voice: VoiceChoice) -> Phrases:
        """The phrases of a request in ``voice``, planned as it opens: an unknown voice is refused then."""
        if voice.voice != "joe":
            raise InvalidRequestError(f"voice {voice.voice!r} does not exist", code="voice_not_found")
        return self

    async def open(self, text: str, *, continued: bool = False) -> PhraseAudioStub | None:
        self.opened.append(text)
        return PhraseAudioStub(self, text)


class StubVoices:
    def __init__(self, sample_rate: int = RATE) -> None:
        self.catalog = ModelCatalog([_model("piper", cloning=False, voices=("joe",), sample_rate=sample_rate)])

    def info(self) -> Info:
        return describe([])

    async def choose(self, requested: SynthesizeVoice | None) -> VoiceChoice:
        return choose(requested, [], self.catalog)

    def sample_rate(self, voice: VoiceChoice) -> int:
        return self.catalog.models[voice.model].sample_rate


def _model(
    name: str,
    *,
    cloning: bool,
    voices: tuple[str, ...] = (),
    languages: tuple[str, ...] = ("en",),
    sample_rate: int = 22_050,
) -> SpeechModel:
    return SpeechModel(
        id=name,
        description=f"{name} model",
        sample_rate=sample_rate,
        supports_cloning=cloning,
        speed_variants=frozenset(),
        builtin_voices=voices,
        languages=languages,
        inputs=frozenset({"target_text"}),
        offline_model=name,
        stream_model=None,
    )


@asynccontextmanager
async def running(
    phrases: Phrases,
    limits: WyomingLimits | None = None,
    metrics: GatewayMetrics | None = None,
    sample_rate: int = RATE,
    pipeline: type[PhrasePipeline] = PhrasePipeline,
) -> AsyncIterator[int]:
    port = free_port()
    server = WyomingServer(
        "127.0.0.1",
        port,
        voices=StubVoices(sample_rate),
        synthesizers=lambda voice, chunker, slots: pipeline(phrases.context(voice), chunker, speech_slots=slots),
        limits=limits or WyomingLimits(),
        metrics=metrics or GatewayMetrics(),
    )
    async with serving(server, announce=False):
        yield port


async def events_until(client: AsyncTcpClient, last: str) -> list[Event]:
    events: list[Event] = []
    while True:
        event = await asyncio.wait_for(client.read_event(), 10)
        assert event is not None, f"connection closed after {[e.type for e in events]}"
        events.append(event)
        if event.type == last or Error.is_type(event.type):
            return events


def audio_of(events: list[Event]) -> bytes:
    chunks = [AudioChunk.from_event(e) for e in events if AudioChunk.is_type(e.type)]
    assert all((c.rate, c.width, c.channels) == (RATE, 2, 1) for c in chunks)
    return b"".join(c.audio for c in chunks)


async def closed(client: AsyncTcpClient) -> bool:
    return await asyncio.wait_for(client.read_event(), 10) is None


async def test_synthesize_is_answered_with_audio_in_order() -> None:
    phrases = Phrases()
    text = "The first sentence is here. And the second one follows it."
    async with running(phrases) as port, AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Synthesize(text=text, voice=SynthesizeVoice(name="joe")).event())
        events = await events_until(client, AudioStop().event().type)
    types = [e.type for e in events]
    assert types[0] == "audio-start" and types[-1] == "audio-stop"
    assert set(types[1:-1]) == {"audio-chunk"}
    start = AudioStart.from_event(events[0])
    assert (start.rate, start.width, start.channels) == (RATE, 2, 1)
    assert "".join(phrases.opened).replace(" ", "") == text.replace(" ", "")
    assert len(audio_of(events)) == sum(len(p) for p in phrases.opened) * BYTES_PER_CHAR


@pytest.mark.parametrize(("model_rate", "sent_rate"), [(22_050, 22_050), (16_000, 16_000), (11_025, RATE)])
async def test_audio_is_sent_at_the_models_rate_where_pcm_offers_it(model_rate: int, sent_rate: int) -> None:
    phrases = Phrases()
    text = "The first sentence is here. And the second one follows it."
    async with running(phrases, sample_rate=model_rate) as port, AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Synthesize(text=text, voice=SynthesizeVoice(name="joe")).event())
        events = await events_until(client, AudioStop().event().type)
    start = AudioStart.from_event(events[0])
    chunks = [AudioChunk.from_event(e) for e in events if AudioChunk.is_type(e.type)]
    assert start.rate == sent_rate and {c.rate for c in chunks} == {sent_rate}
    # Each phrase resampled whole: as many samples as its 24 kHz audio lasts at the new rate, give or take one.
    sent = sum(len(c.audio) for c in chunks) // 2
    samples = [len(p) * BYTES_PER_CHAR // 2 for p in phrases.opened]
    assert abs(sent - sum(n * sent_rate / RATE for n in samples)) <= len(samples)


async def test_streamed_text_is_spoken_before_it_ends_and_its_repeat_is_not() -> None:
    phrases = Phrases()
    first = "Here is the first sentence of a reply. "
    rest = "And here comes the rest of it."
    async with running(phrases) as port, AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="joe")).event())
        for word in first.split(" "):
            await client.write_event(SynthesizeChunk(text=word + " ").event())
        for word in rest.split(" "):
            await client.write_event(SynthesizeChunk(text=word + " ").event())
        # The audio of the first sentence comes while the stream is still open.
        early = await events_until(client, "audio-chunk")
        # What Home Assistant sends for servers that do not stream: not spoken again.
        await client.write_event(Synthesize(text=first + rest, voice=SynthesizeVoice(name="joe")).event())
        await client.write_event(SynthesizeStop().event())
        late = await events_until(client, SynthesizeStopped().event().type)
    events = early + late
    assert [e.type for e in events][-2:] == ["audio-stop", "synthesize-stopped"]
    assert [e.type for e in events].count("audio-start") == 1
    spoken = " ".join(phrases.opened)
    assert spoken.split() == (first + rest).split()
    assert len(audio_of(events)) == sum(len(p) for p in phrases.opened) * BYTES_PER_CHAR


async def test_unknown_voice_is_an_error_event_then_the_end() -> None:
    async with running(Phrases()) as port, AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Synthesize(text="Hello.", voice=SynthesizeVoice(name="nobody")).event())
        event = await asyncio.wait_for(client.read_event(), 10)
        assert event is not None and Error.is_type(event.type)
        error = Error.from_event(event)
        assert error.code == "voice_not_found" and "nobody" in error.text
        assert await closed(client)


async def test_backend_failure_mid_request_is_an_error_event() -> None:
    phrases = Phrases()
    phrases.fail_on = "broken"
    async with running(phrases) as port, AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Synthesize(text="This one works fine. This one is broken now.").event())
        events = await events_until(client, "error")
        assert Error.from_event(events[-1]).code == "backend_error"
        assert "audio-stop" not in [e.type for e in events]
        assert await closed(client)


class FaultyPipeline(PhrasePipeline):
    """Synthesis whose audio fails after its first chunk with a fault of the gateway's own (no GatewayError)."""

    async def chunks(self) -> AsyncIterator[SpeechChunk]:
        async for chunk in super().chunks():
            yield chunk
            raise RuntimeError("a fault of the gateway")


async def test_a_fault_while_sending_audio_is_an_error_event_and_the_connection_is_counted_closed() -> None:
    metrics = GatewayMetrics()
    async with running(Phrases(), metrics=metrics, pipeline=FaultyPipeline) as port:
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(Synthesize(text="This one works fine.").event())
            events = await events_until(client, "error")
            assert Error.from_event(events[-1]).code == "internal_error"
            assert await closed(client)
        for _ in range(100):
            if metrics.registry.get_sample_value("tts_wyoming_connections_open") == 0:
                break
            await asyncio.sleep(0.05)
        assert metrics.registry.get_sample_value("tts_wyoming_connections_open") == 0


@pytest.mark.parametrize(
    ("events", "code"),
    [
        ([SynthesizeChunk(text="Hello").event()], "unexpected_event"),
        ([SynthesizeStop().event()], "unexpected_event"),
        ([SynthesizeStart().event(), SynthesizeStart().event()], "unexpected_event"),
        ([Event(type="synthesize", data={"voice": {"name": "joe"}})], "invalid_event"),
        ([Event(type="synthesize", data={"text": 5})], "invalid_event"),
    ],
)
async def test_events_out_of_place_are_errors(events: list[Event], code: str) -> None:
    async with running(Phrases()) as port, AsyncTcpClient("127.0.0.1", port) as client:
        for event in events:
            await client.write_event(event)
        reply = await asyncio.wait_for(client.read_event(), 10)
        assert reply is not None and Error.from_event(reply).code == code
        assert await closed(client)


async def test_a_line_that_is_not_an_event_is_an_error() -> None:
    async with running(Phrases()) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"this is not json\n")
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert b'"type": "error"' in reply and b"invalid_event" in reply


async def test_limits_connections_text_size_and_idle_time() -> None:
    limits = WyomingLimits(max_connections=2, max_buffered_chars=200, idle_timeout=0.5)
    phrases = Phrases()
    metrics = GatewayMetrics()
    async with running(phrases, limits, metrics) as port:
        async with AsyncTcpClient("127.0.0.1", port) as one, AsyncTcpClient("127.0.0.1", port) as two:
            await one.write_event(Describe().event())
            await two.write_event(Describe().event())
            assert (await one.read_event()) is not None and (await two.read_event()) is not None
            async with AsyncTcpClient("127.0.0.1", port) as three:
                refused = await asyncio.wait_for(three.read_event(), 10)
                assert refused is not None and Error.from_event(refused).code == "too_many_connections"
                assert await closed(three)
        # Once the server has seen them go, the next connection is served.
        for _ in range(100):
            if metrics.registry.get_sample_value("tts_wyoming_connections_open") == 0:
                break
            await asyncio.sleep(0.05)
        assert metrics.registry.get_sample_value("tts_wyoming_errors_total", {"code": "too_many_connections"}) == 1
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(SynthesizeStart().event())
            await client.write_event(SynthesizeChunk(text="word" * 60).event())
            reply = await asyncio.wait_for(client.read_event(), 10)
            assert reply is not None and Error.from_event(reply).code == "text_limit"
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(Synthesize(text="word " * 41).event())
            reply = await asyncio.wait_for(client.read_event(), 10)
            assert reply is not None and Error.from_event(reply).code == "text_limit"
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(Synthesize(text="x" * (limits.max_event_bytes + 1)).event())
            reply = await asyncio.wait_for(client.read_event(), 10)
            assert reply is not None and Error.from_event(reply).code == "event_too_large"
        async with AsyncTcpClient("127.0.0.1", port) as client:
            reply = await asyncio.wait_for(client.read_event(), 10)
            assert reply is not None and Error.from_event(reply).code == "idle_timeout"
            assert await closed(client)
        # A streamed request whose text stops coming is idle too, although its synthesis is open.
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(SynthesizeStart().event())
            await client.write_event(SynthesizeChunk(text="Some words").event())
            reply = await asyncio.wait_for(client.read_event(), 10)
            assert reply is not None and Error.from_event(reply).code == "idle_timeout"
            assert await closed(client)
        assert phrases.closed == phrases.opened


async def test_speaking_is_not_idle_and_a_client_that_leaves_cancels_its_synthesis() -> None:
    phrases = Phrases()
    phrases.gate.clear()
    async with running(phrases, WyomingLimits(idle_timeout=0.3)) as port:
        client = AsyncTcpClient("127.0.0.1", port)
        await client.connect()
        await client.write_event(Synthesize(text="A sentence that takes a long time to speak.").event())
        # Synthesis outlasts the idle timeout: the connection stays open meanwhile.
        await asyncio.sleep(1.0)
        await client.write_event(Describe().event())
        answer = await asyncio.wait_for(client.read_event(), 10)
        assert answer is not None and Info.is_type(answer.type)
        assert phrases.closed == []
        await client.disconnect()
        for _ in range(100):
            if phrases.closed:
                break
            await asyncio.sleep(0.05)
    assert phrases.closed == phrases.opened != []


# -- voices ----------------------------------------------------------------------------------------


@pytest.fixture()
def registry(tmp_path: Path) -> Iterator[VoiceRegistry]:
    voices = VoiceRegistry(REFERENCE_VOICES, tmp_path, min_seconds=1.0, max_seconds=30.0, aliases={})
    voices.load()
    yield voices


def _wav(seconds: float = 2.0, rate: int = 22_050) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buffer = io.BytesIO()
    sf.write(buffer, 0.3 * np.sin(2 * np.pi * 200.0 * t), rate, format="WAV")
    return buffer.getvalue()


async def test_info_lists_every_voice_a_ready_model_speaks_uploads_included(registry: VoiceRegistry) -> None:
    await registry.add_upload("mine", _wav(), "hello there")
    piper = _model("piper", cloning=False, voices=("joe",))
    cosy = _model("cosyvoice2", cloning=True, languages=("zh", "en"))
    voices = list_voices(ModelCatalog([piper, cosy]), registry)
    by_name = {voice.name: voice for voice in voices}
    assert {"joe", "harbor", "lumen", "mine"} <= set(by_name)
    assert (by_name["joe"].model, by_name["mine"].model) == ("piper", "cosyvoice2")
    info = describe(voices)
    program = info.tts[0]
    assert program.installed and program.supports_synthesize_streaming
    assert all(v.installed and v.languages and v.attribution.name for v in program.voices)
    listed = {v.name: v for v in program.voices}
    assert listed["mine"].languages == ["zh", "en"]
    assert "uploaded voice" in (listed["mine"].description or "")
    # Home Assistant reads it back with the same library.
    assert Info.from_event(info.event()).tts[0].voices[0].name == program.voices[0].name
    # Without a model that clones, only the models' own voices.
    assert [v.name for v in list_voices(ModelCatalog([piper]), registry)] == ["joe"]


def test_a_request_names_its_voice_or_its_language_or_gets_the_default(registry: VoiceRegistry) -> None:
    catalog = ModelCatalog(
        [
            _model("piper", cloning=False, voices=("joe",)),
            _model("fr", cloning=False, voices=("lea",), languages=("fr",)),
        ]
    )
    voices = list_voices(catalog, registry)
    assert choose(SynthesizeVoice(name="lea", speaker="0"), voices, catalog) == VoiceChoice("lea", "fr")
    assert choose(SynthesizeVoice(language="fr_FR"), voices, catalog) == VoiceChoice("lea", "fr")
    assert choose(None, voices, catalog) == VoiceChoice("joe", "piper")
    # Not listed: planned on the default model, which accepts an alias or reports the unknown voice.
    assert choose(SynthesizeVoice(name="alloy"), voices, catalog) == VoiceChoice("alloy", "piper")
    with pytest.raises(InvalidRequestError):
        choose(SynthesizeVoice(language="de"), voices, catalog)


def test_gateways_on_one_host_are_announced_under_names_of_their_own() -> None:
    """Workers of one gateway share its port and so its name (the first announces it); another gateway
    on the host, on another port, is not mistaken for one of them."""
    assert discovery.service_name(10300, "box") == discovery.service_name(10300, "box")
    assert discovery.service_name(10300, "box") != discovery.service_name(10301, "box")
    assert discovery.service_name(10300, "box") != discovery.service_name(10300, "other")


def test_discovery_announces_the_bound_address() -> None:
    info = discovery.service_info("tts-gateway on box", discovery.announced_addresses("127.0.0.1"), 10200)
    assert info.type == "_wyoming._tcp.local."
    assert info.name == "tts-gateway on box._wyoming._tcp.local."
    assert info.parsed_addresses() == ["127.0.0.1"] and info.port == 10200
    wildcard = discovery.announced_addresses("0.0.0.0")
    loopback = [address for address in wildcard if ipaddress.ip_address(address).is_loopback]
    # Every address of the host but loopback; loopback only where the host has no other.
    assert wildcard and (not loopback or wildcard == ["127.0.0.1"])
    with pytest.raises(ValueError, match="IPv4"):
        discovery.announced_addresses("::1")


def test_off_by_default_and_on_loopback_when_on() -> None:
    settings = Settings(_env_file=None)
    assert settings.wyoming_port is None and not settings.wyoming_zeroconf
    assert Settings(_env_file=None, wyoming_port=10200).wyoming_host == "127.0.0.1"


async def test_the_first_announcement_of_a_name_holds_it(caplog: pytest.LogCaptureFixture) -> None:
    # Two workers of one gateway announce the same service: the second finds it taken and leaves it.
    name = f"unit test {uuid.uuid4().hex[:8]}"
    first = discovery.Announcement("127.0.0.1", 10200, name)
    second = discovery.Announcement("127.0.0.1", 10200, name)
    browser = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    await first.start()
    try:
        with caplog.at_level(logging.INFO, logger=discovery.__name__):
            await second.start()
        assert "already announced" in caplog.text
        found = await browser.async_get_service_info(discovery.SERVICE_TYPE, first.info.name, timeout=3000)
        assert found is not None and found.port == 10200 and found.parsed_addresses() == ["127.0.0.1"]
    finally:
        await second.stop()
        await first.stop()
        await browser.async_close()
