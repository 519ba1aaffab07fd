"""Timed requests against the two targets of a benchmark: the gateway, and Triton directly.

Both targets get the same text and produce the same audio. The gateway gets
``POST /v1/audio/speech``; the direct target gets, over gRPC, exactly the contract
inputs the gateway would send for that text (its own :class:`~app.speech_service.SpeechPlan`
builds them: same sentence split, same voice inputs), one Triton request per sentence on
the gateway's schedule (the first sentence alone until its first audio, then the gateway's
sentence parallelism). Times: first audio byte (for the direct target, the first chunk of
the first sentence) and the whole response, from just before the request is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import tritonclient.grpc.aio as grpcclient
from bench_texts import BenchText, select_texts

from app.audio_encoding import OUTPUT_SAMPLE_RATE
from app.model_catalog import ModelCatalog
from app.settings import OPENAI_MODEL_NAMES, Settings
from app.speech_service import SpeechPlan
from app.text_splitting import split_sentences
from app.triton_client import TritonClient, build_inputs
from app.voice_registry import VoiceRegistry
from tts_backends import contract

WAV_HEADER_BYTES = 44
PCM_BYTES_PER_SAMPLE = 2
_ERROR_TEXT_CHARS = 300


@dataclass(frozen=True)
class Sample:
    """One request's outcome; times in seconds from just before it was sent."""

    text: str
    total: float
    first_byte: float | None = None
    audio_seconds: float = 0.0
    error: str | None = None


class Target(Protocol):
    async def request(self, text: BenchText) -> Sample: ...


class GatewayTarget:
    """``POST /v1/audio/speech``, body read as it streams in.

    aiohttp, not httpx: its C parser makes the client cheap enough that, on a small machine,
    the load generator does not take the CPU the gateway is being measured on (httpx spent
    about 5 ms of CPU per 240 kB response, twice the gateway's own cost).
    """

    def __init__(self, http: aiohttp.ClientSession, url: str, model: str, voice: str, response_format: str) -> None:
        if response_format not in ("wav", "pcm"):
            raise ValueError("audio seconds are counted from wav or pcm bodies only")
        self._http = http
        self._url = f"{url.rstrip('/')}/v1/audio/speech"
        self._body = {"model": model, "voice": voice, "response_format": response_format}
        self._header = WAV_HEADER_BYTES if response_format == "wav" else 0

    async def request(self, text: BenchText) -> Sample:
        first: float | None = None
        size = 0
        started = time.perf_counter()
        try:
            async with self._http.post(self._url, json={**self._body, "input": text.text}) as response:
                if response.status != 200:
                    detail = (await response.read()).decode(errors="replace")[:_ERROR_TEXT_CHARS]
                    return Sample(text.name, time.perf_counter() - started, error=f"{response.status} {detail}")
                async for data in response.content.iter_any():
                    if data and first is None:
                        first = time.perf_counter() - started
                    size += len(data)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return Sample(text.name, time.perf_counter() - started, error=f"{type(exc).__name__}: {exc}")
        audio = max(0, size - self._header) / PCM_BYTES_PER_SAMPLE / OUTPUT_SAMPLE_RATE
        return Sample(text.name, time.perf_counter() - started, first, audio)


def gateway_session(connections: int, timeout: float) -> aiohttp.ClientSession:
    """A client session keeping up to ``connections`` connections to the gateway open."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=timeout),
        auto_decompress=False,
    )


class DirectTarget:
    """The Triton requests the gateway would make for a text, sent straight to Triton over gRPC."""

    def __init__(
        self,
        client: grpcclient.InferenceServerClient,
        triton_model: str,
        inputs: Mapping[str, Sequence[Mapping[str, Any]]],
        *,
        streaming: bool,
        sample_rate: int,
        parallelism: int,
        timeout: float,
    ) -> None:
        self._client = client
        self._model = triton_model
        self._inputs = inputs
        self._streaming = streaming
        self._sample_rate = sample_rate
        self._parallelism = parallelism
        self._timeout = timeout

    async def request(self, text: BenchText) -> Sample:
        progress = _Progress(time.perf_counter())
        request_id = uuid.uuid4().hex
        window: deque[asyncio.Task[None]] = deque()
        try:
            # The gateway's schedule: the first sentence alone until its first audio, then up to
            # ``parallelism`` sentences in flight, the next starting once the oldest has finished.
            for index, values in enumerate(self._inputs[text.name]):
                if index == 1:
                    await progress.first_audio.wait()
                if len(window) == self._parallelism:
                    await window.popleft()
                sentence = self._sentence(index, values, f"{request_id}-{index}", progress)
                window.append(asyncio.create_task(sentence))
            while window:
                await window.popleft()
        except Exception as exc:
            return Sample(text.name, progress.elapsed(), error=f"{type(exc).__name__}: {exc}"[:_ERROR_TEXT_CHARS])
        finally:
            for task in window:
                task.cancel()
            for task in window:
                with contextlib.suppress(BaseException):
                    await task
        return Sample(text.name, progress.elapsed(), progress.first, progress.samples / self._sample_rate)

    async def _sentence(self, index: int, values: Mapping[str, Any], request_id: str, progress: _Progress) -> None:
        try:
            await self._call(index, values, request_id, progress)
        finally:
            # A first sentence that failed or had no audio holds the others back no longer.
            if index == 0:
                progress.first_audio.set()

    async def _call(self, index: int, values: Mapping[str, Any], request_id: str, progress: _Progress) -> None:
        if not self._streaming:
            result = await self._client.infer(
                self._model, build_inputs(values), request_id=request_id, client_timeout=self._timeout
            )
            progress.audio(index, _samples(result))
            return
        request = {"model_name": self._model, "inputs": build_inputs(values), "request_id": request_id}

        async def one_request() -> Any:
            yield request

        async for result, error in self._client.stream_infer(one_request(), stream_timeout=self._timeout):
            if error is not None:
                raise error
            progress.audio(index, _samples(result))


@dataclass
class _Progress:
    started: float
    first: float | None = None
    samples: int = 0
    first_audio: asyncio.Event = field(default_factory=asyncio.Event)

    def audio(self, sentence: int, samples: int) -> None:
        self.samples += samples
        # Audio is played in order: only the first sentence's audio can be the first byte.
        if sentence == 0 and samples and self.first is None:
            self.first = self.elapsed()
            self.first_audio.set()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def _samples(result: Any) -> int:
    waveform = result.as_numpy(contract.WAVEFORM)
    return 0 if waveform is None else int(waveform.size)


@dataclass(frozen=True)
class DirectPlan:
    """What the gateway decides for a model, voice and mode, reproduced for the direct target."""

    triton_model: str
    streaming: bool
    sample_rate: int
    texts: tuple[BenchText, ...]
    """The texts asked for that the model speaks."""
    inputs: Mapping[str, Sequence[Mapping[str, Any]]]
    """Per text name, the contract inputs of each sentence."""


async def direct_plan(
    triton_url: str,
    settings: Settings,
    model: str,
    voice: str,
    text_names: Sequence[str] | None,
    workdir: Path,
) -> DirectPlan:
    """Resolve ``model`` and ``voice`` as the gateway does and build each text's per-sentence inputs."""
    client = TritonClient(triton_url, timeout=settings.backend_timeout)
    try:
        catalog = ModelCatalog.from_triton(
            await client.model_configs(),
            default_model=settings.default_model,
            aliases=settings.model_aliases,
            openai_names=OPENAI_MODEL_NAMES,
        )
    finally:
        await client.close()
    speech_model = catalog.resolve(model)
    voices = VoiceRegistry(
        settings.ref_audios_dir,
        workdir / "voices",
        min_seconds=settings.ref_min_seconds,
        max_seconds=settings.ref_max_seconds,
        aliases=settings.voice_aliases,
    )
    voices.load()
    resolved = voices.resolve(voice, speech_model, catalog)
    triton_model = catalog.require_streaming_or_offline(speech_model, settings.backend_mode)
    texts = select_texts(text_names, speech_model.languages)
    inputs: dict[str, list[dict[str, Any]]] = {}
    for text in texts:
        sentences = split_sentences(
            text.text, max_chars=settings.sentence_max_chars, first_max_chars=settings.first_sentence_max_chars
        )
        plan = SpeechPlan(
            model=speech_model,
            triton_model=triton_model,
            voice=resolved,
            sentences=tuple(sentences),
            speed=1.0,
            response_format="pcm",
            sse=False,
            input_chars=len(text.text),
        )
        inputs[text.name] = [plan.backend_inputs(i, s) for i, s in enumerate(plan.sentences)]
    streaming = triton_model == speech_model.stream_model
    return DirectPlan(triton_model, streaming, speech_model.sample_rate, texts, inputs)


@dataclass(frozen=True)
class LevelRun:
    samples: tuple[Sample, ...]
    wall: float
    rss_peak_mb: float | None


async def run_level(
    target: Target, texts: Sequence[BenchText], concurrency: int, requests: int, rss_pid: int | None = None
) -> LevelRun:
    """``requests`` requests from ``concurrency`` workers, texts in turn; the process's peak RSS meanwhile."""
    counter = itertools.count()
    samples: list[Sample] = []

    async def worker() -> None:
        while (index := next(counter)) < requests:
            samples.append(await target.request(texts[index % len(texts)]))

    sampler = RssSampler(rss_pid)
    async with sampler:
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return LevelRun(tuple(samples), wall, sampler.peak_mb)


def merge_runs(runs: Sequence[LevelRun]) -> LevelRun:
    """Several runs of one level as one: all samples, wall times added, the highest RSS."""
    peaks = [run.rss_peak_mb for run in runs if run.rss_peak_mb is not None]
    samples = tuple(sample for run in runs for sample in run.samples)
    return LevelRun(samples, sum(run.wall for run in runs), max(peaks) if peaks else None)


class RssSampler:
    """Peak resident memory of one process, read from /proc every ``interval`` seconds."""

    def __init__(self, pid: int | None, interval: float = 0.05) -> None:
        self._pid = pid
        self._interval = interval
        self._task: asyncio.Task[None] | None = None
        self.peak_mb: float | None = None

    async def __aenter__(self) -> RssSampler:
        if self._pid is not None:
            self._sample()
            self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._sample()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            self._sample()

    def _sample(self) -> None:
        rss = rss_mb(self._pid) if self._pid is not None else None
        if rss is not None:
            self.peak_mb = max(rss, self.peak_mb or 0.0)


def rss_mb(pid: int) -> float | None:
    """Resident set size of ``pid`` in MiB, None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None
