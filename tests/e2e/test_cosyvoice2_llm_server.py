"""The gateway in front of CosyVoice2 with its LLM on a separate OpenAI-compatible server.

Triton serves the ``cosyvoice2-cpu-llm-server`` profile (orchestrator, token2wav, speech
tokenizer, speaker embedding) over the tiny checkpoint; the LLM is a real ``transformers serve``
process on the checkpoint's HF directory, which the tests start late, kill mid-stream and
start again. The tests run in file order: each leaves the LLM server up for the next.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI

from tests.audio_checks import DecodedAudio, decode
from tests.e2e.gateway_process import GatewayProcess, cpu_seconds, free_port
from tests.llm_server_process import LLMServerProcess
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = [pytest.mark.triton, pytest.mark.cosyvoice]

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLES_PER_TOKEN = 960
TEXT = "The quick brown fox."
# How a stream's later chunks are cut depends on how many tokens arrived meanwhile (the orchestrator's
# catch-up), and the cuts shape the audio at the joins. Two text tokens of the tiny tokenizer give at
# most 40 speech tokens: a first chunk and a final one whatever the timing, so streams are bit-exact.
EXACT_TEXT = "Hello world"
# One sentence whose speech takes the LLM minutes on CPU; the gateway below sends it whole (by
# default it would cut it into pieces, and the LLM server would idle while the first one is voiced).
ENDLESS = "and then " + " ".join(f"word{n}" for n in range(120)) + " went by"
WHOLE = str(len(ENDLESS) + 100)
ORCHESTRATORS = ("cosyvoice2", "cosyvoice2_stream")


@dataclass(frozen=True)
class Stack:
    llm: LLMServerProcess
    triton: EmbeddedTriton
    gateway: GatewayProcess
    gateway_env: dict[str, str]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from tts_gateway.models.cosyvoice2.checkpoints.tiny_checkpoint import write_tiny_checkpoint
    from tts_gateway.tools import model_prep

    root = tmp_path_factory.mktemp("cosyvoice2_llm_server")
    tiny = write_tiny_checkpoint(root / "models")
    # Not started: Triton and the gateway come up before the LLM server does.
    llm = LLMServerProcess(tiny.llm_dir, free_port(), root / "llm_server.log")
    overrides = []
    for name in ORCHESTRATORS:
        overrides += ["--set", f"{name}.instance_count=1", "--set", f"{name}.llm_urls={llm.url}"]
        overrides += ["--set", f"{name}.llm_retries=1", "--set", f"{name}.llm_timeout_s=60"]
    # token2wav's queue as gpu-torch runs it: guarding playing streams by its own recent groups, and
    # gathering the calls that reach an idle queue together.
    overrides += ["--set", "token2wav.playback_guard_ms=auto", "--set", "token2wav.gather_ms=12"]
    repository = root / "repository"
    args = ["render", "--profile", "cosyvoice2-cpu-llm-server", "--dest", str(repository)]
    assert model_prep.main([*args, "--models-root", str(root / "models"), *overrides]) == 0
    triton = EmbeddedTriton(repository, workdir=root, startup_timeout=300.0)
    triton.start()
    env = {
        "TTS_TRITON_URL": triton.grpc_url,
        "TTS_VOICES_DIR": str(root / "voices"),
        "TTS_SENTENCE_MAX_CHARS": WHOLE,
        "TTS_FIRST_SENTENCE_MAX_CHARS": WHOLE,
    }
    gateway = GatewayProcess(root / "gateway.log", env)
    try:
        gateway.start()
        yield Stack(llm, triton, gateway, env)
    finally:
        gateway.stop()
        triton.stop(grace=5.0)
        llm.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.gateway.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _speech(stack: Stack, text: str = TEXT, **extra: object) -> httpx.Response:
    body = {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm", **extra}
    return httpx.post(f"{stack.gateway.url}/v1/audio/speech", json=body, timeout=300)


def _pcm(client: OpenAI, seed: int = 7, text: str = EXACT_TEXT) -> DecodedAudio:
    response = client.audio.speech.create(
        model="tts-1", voice="alloy", input=text, response_format="pcm", extra_body={"seed": seed}
    )
    return decode(response.content, "pcm")


def test_before_the_llm_server_is_up_speech_is_unavailable_then_served(stack: Stack) -> None:
    assert not stack.llm.is_running()
    for stream in (False, True):
        response = _speech(stack, stream_format="sse" if stream else "audio")
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "backend_unavailable"
        # No internal address reaches the client.
        assert stack.llm.url not in response.text
    stack.llm.start()
    response = _speech(stack)
    assert response.status_code == 200, response.text
    audio = decode(response.content, "pcm")
    assert audio.samples.size > 0 and audio.samples.size % SAMPLES_PER_TOKEN == 0


def test_speech_is_whole_tokens_and_reproducible(stack: Stack, client: OpenAI) -> None:
    stack.llm.start()
    first = _pcm(client, seed=7)
    assert first.samples.size > 0 and first.samples.size % SAMPLES_PER_TOKEN == 0
    assert first.rms > 0.0
    assert np.array_equal(first.samples, _pcm(client, seed=7).samples)
    assert not np.array_equal(first.samples, _pcm(client, seed=8).samples)


def test_streaming_arrives_in_pieces_and_matches_offline(stack: Stack, client: OpenAI) -> None:
    stack.llm.start()
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=EXACT_TEXT, response_format="pcm", extra_body={"seed": 7}
    ) as response:
        pieces = list(response.iter_bytes())
    assert len(pieces) > 1
    assert np.array_equal(decode(b"".join(pieces), "pcm").samples, _pcm(client, seed=7).samples)


def test_the_offline_orchestrator_speaks_through_the_llm_server_too(
    stack: Stack, client: OpenAI, tmp_path: Path
) -> None:
    """A gateway in offline mode calls ``cosyvoice2`` (not decoupled), which takes the LLM server's tokens whole."""
    stack.llm.start()
    offline = GatewayProcess(tmp_path / "gateway-offline.log", {**stack.gateway_env, "TTS_BACKEND_MODE": "offline"})
    offline.start()
    try:
        body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm", "seed": 7}
        response = httpx.post(f"{offline.url}/v1/audio/speech", json=body, timeout=300)
    finally:
        offline.stop()
    assert response.status_code == 200, response.text
    audio = decode(response.content, "pcm")
    assert audio.rms > 0.0
    # The same seed draws the same tokens from the server: as long as the streamed answer (the
    # samples differ: streamed chunks run the flow with chunked attention, offline with full).
    assert audio.samples.size == _pcm(client, seed=7, text=TEXT).samples.size


def test_a_client_that_leaves_stops_the_llm_server(stack: Stack) -> None:
    stack.llm.start()
    body = {"model": "tts-1", "voice": "alloy", "input": ENDLESS, "response_format": "pcm"}
    with httpx.stream("POST", f"{stack.gateway.url}/v1/audio/speech", json=body, timeout=300) as response:
        assert response.status_code == 200
        # Kept: an iterator dropped after its first chunk closes the connection when it is collected
        # (httpcore closes on GeneratorExit), and the gateway then cancels the request: the client
        # would have left before the measurement starts.
        chunks = response.iter_bytes()
        next(chunks)
        # Still generating (about two minutes of tokens on CPU). How busy a half-second finds the
        # server depends on what else shares the CPUs, so it is looked at until it is seen busy.
        (busy,) = _loads_until(stack.llm.pids(), lambda load: load > 0.1, within_s=30.0)
        assert busy > 0.1, _server_state(stack)
    # The gateway cancels the gRPC stream, the orchestrator closes the HTTP stream, the server stops
    # (left running, it would stay busy for the two minutes): idle for two seconds running.
    quiet = max(0.05, busy / 4)
    idle = _loads_until(stack.llm.pids(), lambda load: load < quiet, within_s=20.0, windows=4)
    assert len(idle) == 4 and max(idle) < quiet, f"{idle}\n{_server_state(stack)}"
    # transformers serve generates one request at a time: the next one is not stuck behind it.
    assert _speech(stack).status_code == 200


def test_the_llm_server_dying_mid_stream_ends_the_stream_with_an_error(stack: Stack) -> None:
    stack.llm.start()
    body = {"model": "tts-1", "voice": "alloy", "input": ENDLESS, "response_format": "pcm", "stream_format": "sse"}
    events = []
    # The error event comes first, then the body ends without its last chunk: never a clean end.
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", f"{stack.gateway.url}/v1/audio/speech", json=body, timeout=300) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line.removeprefix("data: ")))
            if len(events) == 1:
                stack.llm.kill()
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error"
    assert not any(event["type"] == "speech.audio.done" for event in events)
    response = _speech(stack)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "backend_unavailable"
    # Triton and the gateway stayed up; speech is back with the server.
    stack.llm.start()
    assert _speech(stack).status_code == 200


def _server_state(stack: Stack) -> str:
    """What a failed load check needs to be told apart: a server gone, one idle, one stuck."""
    state = "running" if stack.llm.is_running() else "exited"
    logs = f"its log ends:\n{stack.llm.log_tail()}\nthe gateway's log ends:\n{stack.gateway.log_tail()}"
    return f"LLM server {stack.llm.pid} {state}, with its processes {stack.llm.pids()}; {logs}"


def _loads_until(
    pids: list[int], done: Callable[[float], bool], within_s: float, windows: int = 1, window_s: float = 0.5
) -> list[float]:
    """The CPUs' share ``pids`` used together in consecutive windows, until ``done`` holds for ``windows`` of them
    in a row or time is up: the last ``windows`` shares."""
    deadline = time.monotonic() + within_s
    loads: list[float] = []
    while True:
        before = cpu_seconds(pids)
        time.sleep(window_s)
        loads.append((cpu_seconds(pids) - before) / window_s)
        last = loads[-windows:]
        if (len(last) == windows and all(done(load) for load in last)) or time.monotonic() > deadline:
            return last
