"""ElevenLabs' own client libraries against the gateway's text-to-speech WebSocket: Pipecat's
``ElevenLabsTTSService`` (token and sentence aggregation, and an interruption) and LiveKit's
ElevenLabs TTS (its socket and its REST ``synthesize()``, with its defaults: mp3 at 22.05 kHz),
talking to a real gateway process over Piper; PocketSphinx checks what was said."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import numpy as np
import pytest
from livekit.plugins import elevenlabs as livekit_elevenlabs
from pipecat.frames.frames import (
    EndFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.elevenlabs.tts import ElevenLabsTTSService
from pipecat.services.tts_service import TextAggregationMode
from pipecat.workers.runner import WorkerRunner

from tests.audio_checks import DecodedAudio
from tests.e2e.gateway_process import GatewayProcess
from tests.e2e.test_text_stream_ws import metric
from tests.speech_recognition import transcribe

pytestmark = pytest.mark.triton

REPLY = "The quick brown fox jumps over the lazy dog. It was a sunny day."
# Piper speaks this sentence in about 3.4 s, so the long reply lasts over five minutes. Piper makes audio
# many times faster than real time, and what it made before an interruption took effect still arrives: on
# a 2-core machine that was 17 to 51 s. Half of the reply or more means it was not cut short. Its
# words come a millisecond apart, so that all of its text is there within about a second.
LONG_REPLY = " ".join(["This sentence keeps the voice talking for quite a while longer."] * 100)
LONG_REPLY_CUT_S = 170.0
RATE = 16_000
# Pipecat ends a context that has had no audio for `stop_frame_timeout_s` (3 s by default) and reports
# it as "completed with no audio"; on this 2-core machine under a parallel load, Piper's first phrase
# of a turn can take longer than that, which is the machine and not the protocol under test.
QUIET_S = 15.0


def heard_words(pcm: bytes, rate: int) -> set[str]:
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    return set(transcribe(DecodedAudio(samples, rate, 1)).split())


class Collector(FrameProcessor):
    """The end of the pipeline: what the TTS service produced."""

    def __init__(self) -> None:
        super().__init__()
        self.audio = bytearray()
        self.words: list[str] = []
        self.stopped = asyncio.Event()
        self.first_audio = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.audio += frame.audio
            self.first_audio.set()
        elif isinstance(frame, TTSTextFrame):
            self.words.append(frame.text)
        elif isinstance(frame, TTSStoppedFrame):
            self.stopped.set()
        await self.push_frame(frame, direction)


class PipecatBot:
    def __init__(self, gateway: GatewayProcess, mode: TextAggregationMode) -> None:
        self.mode = mode
        self.tts = ElevenLabsTTSService(
            api_key="unused",
            settings=ElevenLabsTTSService.Settings(voice="joe", model="eleven_flash_v2_5"),
            url=f"ws://127.0.0.1:{gateway.port}",
            sample_rate=RATE,
            text_aggregation_mode=mode,
            stop_frame_timeout_s=QUIET_S,
        )
        self.out = Collector()
        self.worker = PipelineWorker(
            Pipeline([self.tts, self.out]), params=PipelineParams(audio_out_sample_rate=RATE), enable_rtvi=False
        )
        self.runner = WorkerRunner(handle_sigint=False)
        self._run: asyncio.Task[None] | None = None

    async def __aenter__(self) -> PipecatBot:
        await self.runner.add_workers(self.worker)
        self._run = asyncio.create_task(self.runner.run())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.worker.queue_frame(EndFrame())
        assert self._run is not None
        await asyncio.wait_for(self._run, 30)

    async def say(self, text: str, *, end: bool = True, gap_s: float = 0.01) -> None:
        """Text as an LLM streams it: word tokens (with their leading space) ``gap_s`` apart."""
        await self.worker.queue_frame(LLMFullResponseStartFrame())
        for index, word in enumerate(text.split(" ")):
            await self.worker.queue_frame(LLMTextFrame(word if index == 0 else f" {word}"))
            await asyncio.sleep(gap_s)
        if end:
            await self.worker.queue_frame(LLMFullResponseEndFrame())


@pytest.mark.parametrize("mode", [TextAggregationMode.TOKEN, TextAggregationMode.SENTENCE])
async def test_pipecat_speaks_a_streamed_reply(gateway: GatewayProcess, mode: TextAggregationMode) -> None:
    async with PipecatBot(gateway, mode) as bot:
        await bot.say(REPLY)
        await asyncio.wait_for(bot.out.stopped.wait(), 60)
    assert len(bot.out.audio) / 2 / RATE > 2.5
    # Word timestamps come from the alignment: every word of the reply, in order.
    assert " ".join(bot.out.words).split() == REPLY.split()
    heard = heard_words(bytes(bot.out.audio), RATE)
    assert len(heard & {"quick", "brown", "fox", "lazy", "dog", "sunny", "day"}) >= 4, heard


async def test_pipecat_interruption_stops_the_audio_and_the_socket_goes_on(gateway: GatewayProcess) -> None:
    interrupted_before = await metric(gateway, "tts_ws_contexts_interrupted_total")
    async with PipecatBot(gateway, TextAggregationMode.TOKEN) as bot:
        await bot.say(LONG_REPLY, end=False, gap_s=0.001)
        await asyncio.wait_for(bot.out.first_audio.wait(), 60)
        await bot.worker.queue_frame(InterruptionFrame())
        await asyncio.sleep(1.0)
        assert await metric(gateway, "tts_ws_contexts_interrupted_total") == interrupted_before + 1
        spoken_at_interruption = len(bot.out.audio)
        await asyncio.sleep(1.0)
        assert len(bot.out.audio) == spoken_at_interruption, "audio kept coming after the interruption"
        assert spoken_at_interruption / 2 / RATE < LONG_REPLY_CUT_S, "the long reply was not cut short"
        # The same socket serves the next turn.
        bot.out.stopped.clear()
        bot.out.audio.clear()
        await bot.say(REPLY)
        await asyncio.wait_for(bot.out.stopped.wait(), 60)
    assert len(bot.out.audio) / 2 / RATE > 2.5
    assert await metric(gateway, "tts_ws_contexts_open") == 0


def livekit_tts(gateway: GatewayProcess, session: aiohttp.ClientSession, **options: Any) -> livekit_elevenlabs.TTS:
    return livekit_elevenlabs.TTS(
        voice_id="joe",
        api_key="unused",
        base_url=f"http://127.0.0.1:{gateway.port}/v1",
        http_session=session,
        **options,
    )


def livekit_pcm(frames: list[Any], rate: int) -> bytes:
    assert frames and {frame.sample_rate for frame in frames} == {rate}
    assert {frame.num_channels for frame in frames} == {1}
    return b"".join(bytes(frame.data) for frame in frames)


@pytest.mark.parametrize(("options", "rate"), [({}, 22_050), ({"encoding": "pcm_24000"}, 24_000)])
async def test_livekit_streams_a_reply(gateway: GatewayProcess, options: dict[str, str], rate: int) -> None:
    """With the plugin's defaults (mp3 at 22.05 kHz) and with raw PCM."""
    async with aiohttp.ClientSession() as session:
        tts = livekit_tts(gateway, session, model="eleven_flash_v2_5", **options)
        stream = tts.stream()
        for index, word in enumerate(REPLY.split(" ")):
            stream.push_text(word if index == 0 else f" {word}")
        stream.end_input()
        frames = [event.frame async for event in stream]
        await stream.aclose()
        await tts.aclose()
    pcm = livekit_pcm(frames, rate)
    assert len(pcm) / 2 / rate > 2.5
    heard = heard_words(pcm, rate)
    assert len(heard & {"quick", "brown", "fox", "lazy", "dog", "sunny", "day"}) >= 4, heard


async def test_livekit_synthesize_calls_the_rest_stream(gateway: GatewayProcess) -> None:
    async with aiohttp.ClientSession() as session:
        tts = livekit_tts(gateway, session)
        frames = [event.frame async for event in tts.synthesize(REPLY)]
        await tts.aclose()
    pcm = livekit_pcm(frames, 22_050)
    assert len(pcm) / 2 / 22_050 > 2.5
    heard = heard_words(pcm, 22_050)
    assert len(heard & {"quick", "brown", "fox", "lazy", "dog", "sunny", "day"}) >= 4, heard
