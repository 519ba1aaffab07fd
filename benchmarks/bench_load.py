"""Timed requests against the two targets of a benchmark: the gateway, and Triton directly.

Both targets get the same text and produce the same audio. The gateway gets
``POST /v1/audio/speech``; the direct target gets, over gRPC, exactly the contract
inputs the gateway would send for that text (its own :class:`~tts_gateway.gateway.speech.plan.SpeechPlan`
builds them: same sentence split, same voice inputs), one Triton request per sentence on
the gateway's schedule (the first sentence alone until its first audio, then the gateway's
sentence parallelism). Times: first audio byte (for the direct target, the first chunk of
the first sentence) and the whole response, from just before the request is sent.

The load of a level comes from this process (:class:`InProcessLoad`) or from several client
processes at once (:class:`ClientProcesses`), each with its own event loop and connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import signal
import time
import traceback
import uuid
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import tritonclient.grpc.aio as grpcclient

from benchmarks.bench_texts import BenchText, select_texts
from tts_gateway.gateway.settings import OPENAI_MODEL_NAMES, Settings
from tts_gateway.gateway.speech.audio_encoding import OUTPUT_SAMPLE_RATE
from tts_gateway.gateway.speech.plan import SpeechPlan, synthesis_pieces
from tts_gateway.gateway.speech.voice_registry import VoiceRegistry
from tts_gateway.gateway.triton.client import TritonClient, build_inputs
from tts_gateway.gateway.triton.model_catalog import ModelCatalog
from tts_gateway.models import contract

WAV_HEADER_BYTES = 44
PCM_BYTES_PER_SAMPLE = 2
_ERROR_TEXT_CHARS = 300
# How long a client process waits for the others at the start of a level.
_BARRIER_TIMEOUT_S = 120.0


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

    def __init__(
        self,
        http: aiohttp.ClientSession,
        url: str,
        model: str,
        voice: str,
        response_format: str,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        if response_format not in ("wav", "pcm"):
            raise ValueError("audio seconds are counted from wav or pcm bodies only")
        self._http = http
        self._url = f"{url.rstrip('/')}/v1/audio/speech"
        self._body = {"model": model, "voice": voice, "response_format": response_format, **(extra or {})}
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


def gateway_session(connections: int, timeout: float, *, keep_alive: bool = True) -> aiohttp.ClientSession:
    """A client session keeping up to ``connections`` connections to the gateway open (with ``keep_alive``)
    or opening one per request."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, force_close=not keep_alive),
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
        sentences = synthesis_pieces(text.text, settings)
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
        inputs[text.name] = [plan.model_inputs(i, s) for i, s in enumerate(plan.sentences)]
    streaming = triton_model == speech_model.stream_model
    return DirectPlan(triton_model, streaming, speech_model.sample_rate, texts, inputs)


@dataclass(frozen=True)
class GatewaySpec:
    """What a client process needs to build a :class:`GatewayTarget` of its own."""

    url: str
    model: str
    voice: str
    response_format: str
    connections: int
    timeout: float

    async def open(self, stack: contextlib.AsyncExitStack) -> Target:
        http = await stack.enter_async_context(gateway_session(self.connections, self.timeout))
        return GatewayTarget(http, self.url, self.model, self.voice, self.response_format)


@dataclass(frozen=True)
class DirectSpec:
    """What a client process needs to build a :class:`DirectTarget` of its own."""

    triton_url: str
    plan: DirectPlan
    parallelism: int
    timeout: float

    async def open(self, stack: contextlib.AsyncExitStack) -> Target:
        client = grpcclient.InferenceServerClient(self.triton_url)
        stack.push_async_callback(client.close)
        plan = self.plan
        return DirectTarget(
            client,
            plan.triton_model,
            plan.inputs,
            streaming=plan.streaming,
            sample_rate=plan.sample_rate,
            parallelism=self.parallelism,
            timeout=self.timeout,
        )


TargetSpec = GatewaySpec | DirectSpec


@dataclass(frozen=True)
class LevelRun:
    samples: tuple[Sample, ...]
    wall: float
    """Seconds the requests took; for runs merged one after another, the sum of their walls."""
    rss_peak_mb: float | None
    started: float
    ended: float
    """``time.monotonic()`` at the first request and after the last: one clock for every process of the host."""


async def run_level(
    target: Target, texts: Sequence[BenchText], concurrency: int, requests: int, rss_pid: int | None = None
) -> LevelRun:
    """``requests`` requests from ``concurrency`` workers, texts in turn; the peak RSS of ``rss_pid``'s tree."""
    counter = itertools.count()
    samples: list[Sample] = []

    async def worker() -> None:
        while (index := next(counter)) < requests:
            samples.append(await target.request(texts[index % len(texts)]))

    sampler = RssSampler(rss_pid)
    async with sampler:
        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        ended = time.monotonic()
    return LevelRun(tuple(samples), ended - started, sampler.peak_mb, started, ended)


def merge_runs(runs: Sequence[LevelRun]) -> LevelRun:
    """Runs of one level made one after another as one: all samples, wall times added, the highest RSS."""
    peaks = [run.rss_peak_mb for run in runs if run.rss_peak_mb is not None]
    samples = tuple(sample for run in runs for sample in run.samples)
    return LevelRun(
        samples,
        sum(run.wall for run in runs),
        max(peaks) if peaks else None,
        min(run.started for run in runs),
        max(run.ended for run in runs),
    )


def merge_concurrent(runs: Sequence[LevelRun], rss_peak_mb: float | None) -> LevelRun:
    """Runs made at the same time (one per client process) as one: the wall is their union window."""
    started = min(run.started for run in runs)
    ended = max(run.ended for run in runs)
    samples = tuple(sample for run in runs for sample in run.samples)
    return LevelRun(samples, ended - started, rss_peak_mb, started, ended)


def split(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` shared in proportion to ``weights``, what rounding leaves to the largest fractions."""
    whole = sum(weights)
    shares = [total * weight // whole for weight in weights]
    by_fraction = sorted(range(len(weights)), key=lambda index: -(total * weights[index] % whole))
    for index in by_fraction[: total - sum(shares)]:
        shares[index] += 1
    return shares


class LoadGenerator(Protocol):
    """Opens the targets, warms them up, and runs levels against them by name."""

    async def open(self, targets: Mapping[str, TargetSpec], warmup: Sequence[BenchText]) -> None: ...

    async def run(
        self, target: str, texts: Sequence[BenchText], concurrency: int, requests: int, rss_pid: int | None = None
    ) -> LevelRun: ...

    async def close(self) -> None: ...


class InProcessLoad:
    """The load generated in this process, on its event loop."""

    def __init__(self) -> None:
        self._stack = contextlib.AsyncExitStack()
        self._targets: dict[str, Target] = {}

    async def open(self, targets: Mapping[str, TargetSpec], warmup: Sequence[BenchText]) -> None:
        for name, spec in targets.items():
            self._targets[name] = await spec.open(self._stack)
        for target in self._targets.values():
            for text in warmup:
                await target.request(text)

    async def run(
        self, target: str, texts: Sequence[BenchText], concurrency: int, requests: int, rss_pid: int | None = None
    ) -> LevelRun:
        return await run_level(self._targets[target], texts, concurrency, requests, rss_pid)

    async def close(self) -> None:
        self._targets.clear()
        stack, self._stack = self._stack, contextlib.AsyncExitStack()
        await stack.aclose()


class ClientProcesses:
    """The load of each level generated by several client processes at once.

    Each process has its own event loop, HTTP session and gRPC client, and runs its share of
    the level's workers and requests; the processes start a level together (a barrier) and
    their samples are merged, requests/s taken over the union of their windows. The processes
    live as long as this object, so starting them (spawn, imports) is not measured. The
    peak RSS is sampled here, while the processes run.
    """

    def __init__(self, processes: int, cores: set[int] | None = None) -> None:
        if processes < 1:
            raise ValueError("at least one client process")
        self._count = processes
        self._cores = cores
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._connections: list[Connection] = []

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes if process.pid is not None]

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        barrier = context.Barrier(self._count)
        for index in range(self._count):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=_client_process, args=(theirs, barrier, self._cores), name=f"bench-client-{index}", daemon=True
            )
            process.start()
            theirs.close()
            self._processes.append(process)
            self._connections.append(mine)
        # Each process says when it is up: starting them (spawn, imports) is done before any level.
        self._replies()

    def stop(self) -> None:
        for connection in self._connections:
            with contextlib.suppress(OSError):
                connection.send(None)
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        for connection in self._connections:
            connection.close()
        self._processes.clear()
        self._connections.clear()

    async def open(self, targets: Mapping[str, TargetSpec], warmup: Sequence[BenchText]) -> None:
        await self._each([_Open(dict(targets), tuple(warmup))] * self._count)

    async def run(
        self, target: str, texts: Sequence[BenchText], concurrency: int, requests: int, rss_pid: int | None = None
    ) -> LevelRun:
        workers = split(concurrency, [1] * self._count)
        counts = split(requests, workers)
        commands = [_Run(target, tuple(texts), w, n) for w, n in zip(workers, counts, strict=True)]
        async with RssSampler(rss_pid) as sampler:
            runs = await self._each(commands)
        return merge_concurrent([run for run in runs if run is not None], sampler.peak_mb)

    async def close(self) -> None:
        await self._each([_Close()] * self._count)

    async def _each(self, commands: Sequence[_Command]) -> list[Any]:
        for connection, command in zip(self._connections, commands, strict=True):
            connection.send(command)
        return await asyncio.to_thread(self._replies)

    def _replies(self) -> list[Any]:
        """One reply from each process; an error if a process failed or died."""
        replies: dict[int, Any] = {}
        pending = dict(enumerate(self._connections))
        while pending:
            sentinels = {self._processes[index].sentinel: index for index in pending}
            ready = wait([*pending.values(), *sentinels])
            for connection in ready:
                if isinstance(connection, Connection):
                    index = self._connections.index(connection)
                    replies[index] = connection.recv()
                    del pending[index]
            for sentinel in ready:
                if isinstance(sentinel, int) and sentinels[sentinel] in pending:
                    process = self._processes[sentinels[sentinel]]
                    raise RuntimeError(f"client process {process.name} exited with {process.exitcode}")
        failures = [reply for reply in replies.values() if isinstance(reply, _Failure)]
        if failures:
            raise RuntimeError(f"a client process failed:\n{failures[0].traceback}")
        return [replies[index] for index in range(len(self._connections))]


@contextlib.contextmanager
def client_processes(processes: int, cores: set[int] | None = None) -> Iterator[ClientProcesses]:
    """:class:`ClientProcesses` started, and stopped afterwards."""
    clients = ClientProcesses(processes, cores)
    try:
        clients.start()
        yield clients
    finally:
        clients.stop()


@dataclass(frozen=True)
class _Open:
    targets: dict[str, TargetSpec]
    warmup: tuple[BenchText, ...]

    async def apply(self, load: InProcessLoad, barrier: Barrier) -> None:
        await load.open(self.targets, self.warmup)


@dataclass(frozen=True)
class _Run:
    target: str
    texts: tuple[BenchText, ...]
    concurrency: int
    requests: int

    async def apply(self, load: InProcessLoad, barrier: Barrier) -> LevelRun | None:
        # Every process waits here, also one with no share of this level, so the barrier stays in step.
        barrier.wait(_BARRIER_TIMEOUT_S)
        if not self.concurrency:
            return None
        return await load.run(self.target, self.texts, self.concurrency, self.requests)


@dataclass(frozen=True)
class _Close:
    async def apply(self, load: InProcessLoad, barrier: Barrier) -> None:
        await load.close()


_Command = _Open | _Run | _Close


@dataclass(frozen=True)
class _Failure:
    traceback: str


def _client_process(connection: Connection, barrier: Barrier, cores: set[int] | None) -> None:
    """A client process: commands in, replies out, until told to stop or the benchmark is gone."""
    # Ctrl-C reaches the whole process group; the benchmark stops its clients itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cores:
        os.sched_setaffinity(0, cores)
    loop = asyncio.new_event_loop()
    load = InProcessLoad()
    try:
        connection.send(None)
        while True:
            try:
                command: _Command | None = connection.recv()
            except EOFError:
                return
            if command is None:
                return
            try:
                reply = loop.run_until_complete(command.apply(load, barrier))
            except Exception:
                reply = _Failure(traceback.format_exc())
            connection.send(reply)
    finally:
        loop.run_until_complete(load.close())
        loop.close()


class RssSampler:
    """Peak resident memory of a process and its descendants, read from /proc every ``interval`` seconds.

    The process tree is looked up again every ``rescan`` seconds (a scan of /proc costs a few
    ms), so a worker process started or replaced meanwhile is counted from then on.
    """

    def __init__(self, pid: int | None, interval: float = 0.05, rescan: float = 1.0) -> None:
        self._pid = pid
        self._interval = interval
        self._rescan = rescan
        self._tree: list[int] = []
        self._next_scan = 0.0
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
        if self._pid is None:
            return
        if time.monotonic() >= self._next_scan:
            self._tree = process_tree(self._pid)
            self._next_scan = time.monotonic() + self._rescan
        rss = tree_rss_mb(self._tree)
        if rss is not None:
            self.peak_mb = max(rss, self.peak_mb or 0.0)


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it, from the parent ids in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after its last ')'.
        parent = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    tree = [pid]
    for member in tree:
        tree.extend(children.get(member, ()))
    return tree


def tree_rss_mb(tree: Sequence[int]) -> float | None:
    """Resident set sizes of ``tree`` (root first) added up, in MiB; None once the root is gone.

    Pages shared between the processes (libraries) count once per process: an upper bound.
    """
    sizes = [_rss_kib(pid) for pid in tree]
    if sizes[0] is None:
        return None
    return sum(size for size in sizes if size is not None) / 1024


def rss_mb(pid: int) -> float | None:
    """Resident set size of ``pid`` and its descendants in MiB, None once it is gone."""
    return tree_rss_mb(process_tree(pid))


def _rss_kib(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None
