"""A gateway fit for a network: API keys, body limits, admission control and timeouts, end to end.

The gateway runs as a real process in front of a real Triton serving the scripted test
model (``tests/fixtures/triton_repo/scripted``), whose input text says what it does:
send tones at a real-time pace, stall, or fail. That makes slow, stalled and failing
backends reproducible to the second.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.audio_checks import decode
from tests.e2e.gateway_process import GatewayProcess
from tests.fixtures.scripted_triton import TONE_SECONDS, start_scripted_triton
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = pytest.mark.triton

KEYS = ("key-one", "key-two")
AUTH = {"Authorization": f"Bearer {KEYS[1]}"}
QUEUE_TIMEOUT = 3.0
REQUEST_TIMEOUT = 8.0
CHUNK_TIMEOUT = 2.0
UPLOAD_MAX_BYTES = 10 * 1024 * 1024  # the default
REQUEST_MAX_BYTES = 256 * 1024  # the default


@pytest.fixture(scope="module")
def scripted_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    server = start_scripted_triton(tmp_path_factory.mktemp("scripted_triton"))
    yield server
    server.stop(grace=2.0)


def _gateway(triton: EmbeddedTriton, workdir: Path, **settings: str) -> GatewayProcess:
    env = {
        "TTS_TRITON_URL": triton.grpc_url,
        "TTS_VOICES_DIR": str(workdir / "voices"),
        "TTS_TEXT_NORMALIZATION": "false",  # the scripted model's input is a script ("tone*2"), not prose
        **settings,
    }
    return GatewayProcess(workdir / "gateway.log", env)


@pytest.fixture(scope="module")
def guarded(scripted_triton: EmbeddedTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """API keys on, one synthesis slot, one queue place, short timeouts."""
    process = _gateway(
        scripted_triton,
        tmp_path_factory.mktemp("guarded"),
        TTS_API_KEYS=",".join(KEYS),
        TTS_MAX_CONCURRENT_SPEECH="1",
        TTS_MAX_QUEUED_SPEECH="1",
        TTS_QUEUE_TIMEOUT=str(QUEUE_TIMEOUT),
        TTS_REQUEST_TIMEOUT=str(REQUEST_TIMEOUT),
        TTS_BACKEND_CHUNK_TIMEOUT=str(CHUNK_TIMEOUT),
    )
    process.start()
    yield process
    process.stop()


def _body(script: str, **extra: Any) -> dict[str, Any]:
    return {"model": "scripted", "voice": "alloy", "input": script, "response_format": "wav", **extra}


def _speech(gateway: GatewayProcess, script: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/audio/speech", json=_body(script, **extra), headers=AUTH, timeout=30)


def _metric(gateway: GatewayProcess, name: str, **labels: str) -> float:
    text = httpx.get(f"{gateway.url}/metrics", headers=AUTH).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


def _wait_idle(gateway: GatewayProcess, within: float = 5.0) -> None:
    """Every synthesis slot free and nobody queued, within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if _metric(gateway, "tts_speech_slots_in_use") == 0 and _metric(gateway, "tts_speech_queued") == 0:
            return
        time.sleep(0.1)
    pytest.fail(f"slots still taken: {_metric(gateway, 'tts_speech_slots_in_use')}")


def _assert_tone(body: bytes, tones: int) -> None:
    audio = decode(body, "wav")
    assert audio.sample_rate == 24_000
    assert audio.duration == pytest.approx(tones * TONE_SECONDS, abs=0.05)
    assert audio.rms > 0.1


def _assert_error(response: httpx.Response, status: int, error_type: str, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == (error_type, code)
    return error


def _sse_events(gateway: GatewayProcess, script: str, *, aborted: bool = False) -> list[dict[str, Any]]:
    """The response's events; ``aborted``: the body must end without its last chunk, as a failed stream's does."""
    body = _body(script, response_format="pcm", stream_format="sse")
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{gateway.url}/v1/audio/speech", json=body, headers=AUTH, timeout=30) as response:
        assert response.status_code == 200
        try:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        except httpx.RemoteProtocolError:
            assert aborted, "the stream was cut off"
            return events
    assert not aborted, "a failed stream ended as if it were complete"
    return events


# -- API keys ---------------------------------------------------------------------------------------


def test_the_openai_sdk_speaks_with_a_key_and_is_refused_with_a_wrong_one(guarded: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEYS[0], max_retries=0)
    speech = client.audio.speech.create(model="scripted", voice="alloy", input="tone*2", response_format="wav")
    _assert_tone(speech.content, tones=2)
    wrong = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="key-three", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.audio.speech.create(model="scripted", voice="alloy", input="tone")
    assert info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/audio/speech"),
        ("GET", "/v1/models"),
        ("GET", "/v1/audio/voices"),
        ("POST", "/v1/audio/voices"),
        ("DELETE", "/v1/audio/voices/lumen"),
        ("GET", "/metrics"),
        ("GET", "/docs"),
        ("GET", "/openapi.json"),
        ("GET", "/"),
        ("GET", "/v1/nothing-here"),
    ],
)
def test_everything_but_health_needs_a_key(guarded: GatewayProcess, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer key-three"}):
        response = httpx.request(method, f"{guarded.url}{path}", headers=headers, timeout=10)
        _assert_error(response, 401, "invalid_request_error", "invalid_api_key")
        assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{guarded.url}/health", timeout=10).status_code == 200


# -- body limits ------------------------------------------------------------------------------------


class Sent:
    """A request body produced piece by piece, counting what the client got to send."""

    def __init__(self) -> None:
        self.bytes = 0

    def pieces(self, head: bytes, filler: int, tail: bytes) -> Iterator[bytes]:
        yield head
        self.bytes += len(head)
        piece = b"a" * 65536
        for _ in range(filler // len(piece)):
            yield piece
            self.bytes += len(piece)
        yield tail
        self.bytes += len(tail)


_BOUNDARY = "limitsboundary"
_UPLOAD_HEAD = (
    f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="name"\r\n\r\nhuge\r\n'
    f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="audio_sample"; filename="huge.wav"\r\n'
    "Content-Type: audio/wav\r\n\r\n"
).encode()


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize(
    ("path", "head", "filler", "tail", "content_type"),
    [
        (
            "/v1/audio/speech",
            b'{"model": "scripted", "voice": "alloy", "input": "',
            64 << 20,
            b'"}',
            "application/json",
        ),
        (
            "/v1/audio/speech",
            b'{"model": "scripted", "voice": "alloy", "input": "',
            512 << 10,
            b'"}',
            "application/json",
        ),
        ("/v1/audio/voices", _UPLOAD_HEAD, 64 << 20, f"\r\n--{_BOUNDARY}--\r\n".encode(), None),
        ("/v1/audio/voices", _UPLOAD_HEAD, 11 << 20, f"\r\n--{_BOUNDARY}--\r\n".encode(), None),
    ],
    ids=["json-64MiB", "json-512KiB", "upload-64MiB", "upload-11MiB"],
)
def test_over_long_bodies_get_413_before_they_are_read(
    guarded: GatewayProcess, path: str, head: bytes, filler: int, tail: bytes, content_type: str | None, declared: bool
) -> None:
    sent = Sent()
    total = len(head) + filler // 65536 * 65536 + len(tail)
    headers = {**AUTH, "Content-Type": content_type or f"multipart/form-data; boundary={_BOUNDARY}"}
    if declared:
        headers["Content-Length"] = str(total)
    started = time.monotonic()
    response = httpx.post(f"{guarded.url}{path}", content=sent.pieces(head, filler, tail), headers=headers, timeout=30)
    elapsed = time.monotonic() - started
    limit = UPLOAD_MAX_BYTES + REQUEST_MAX_BYTES if path == "/v1/audio/voices" else REQUEST_MAX_BYTES
    error = _assert_error(response, 413, "invalid_request_error", "payload_too_large")
    assert str(limit) in error["message"]
    assert elapsed < 5.0
    if total > 4 * limit:
        # The gateway stopped reading at the limit: the client could not send the rest (socket
        # buffers take a few MiB). Without the limit it reads, parses or spools all 64 MiB.
        assert sent.bytes < limit + (16 << 20) < total
    # The gateway is up, stored nothing and serves the next request.
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    voices = httpx.get(f"{guarded.url}/v1/audio/voices", headers=AUTH).json()["voices"]
    assert "huge" not in {voice["id"] for voice in voices}
    _assert_tone(_speech(guarded, "tone").content, tones=1)


def test_an_unauthenticated_upload_is_refused_before_it_is_read(guarded: GatewayProcess) -> None:
    sent = Sent()
    response = httpx.post(
        f"{guarded.url}/v1/audio/voices",
        content=sent.pieces(_UPLOAD_HEAD, 64 << 20, b""),
        headers={"Content-Type": f"multipart/form-data; boundary={_BOUNDARY}"},
        timeout=30,
    )
    _assert_error(response, 401, "invalid_request_error", "invalid_api_key")
    assert sent.bytes < 32 << 20


def test_input_over_4096_characters_is_a_400_about_input(guarded: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEYS[1], max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(model="scripted", voice="alloy", input="tone " * 820)
    error = info.value.body
    assert isinstance(error, dict)
    assert (error["type"], error["param"]) == ("invalid_request_error", "input")
    assert "4096" in error["message"]


# -- admission control ------------------------------------------------------------------------------


async def test_load_beyond_the_slot_and_the_queue_is_shed_with_429(guarded: GatewayProcess) -> None:
    _wait_idle(guarded)
    rejected_before = _metric(guarded, "tts_speech_rejected_total", reason="queue_full")
    async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=30) as client:
        responses = await asyncio.gather(*(client.post("/v1/audio/speech", json=_body("tone*4")) for _ in range(5)))
    statuses = sorted(r.status_code for r in responses)
    # One synthesises, one waits for its slot, the other three are turned away at once.
    assert statuses == [200, 200, 429, 429, 429]
    for response in responses:
        if response.status_code == 200:
            _assert_tone(response.content, tones=4)
        else:
            error = _assert_error(response, 429, "requests", "rate_limit_exceeded")
            assert "queue is full" in error["message"]
            assert 1 <= int(response.headers["retry-after"]) <= 10
    assert _metric(guarded, "tts_speech_rejected_total", reason="queue_full") == rejected_before + 3
    _wait_idle(guarded)
    _assert_tone(_speech(guarded, "tone*2").content, tones=2)


async def test_the_sdk_sees_a_rate_limit_error(guarded: GatewayProcess) -> None:
    _wait_idle(guarded)
    client = openai.AsyncOpenAI(base_url=f"{guarded.url}/v1", api_key=KEYS[0], max_retries=0)

    async def speak() -> bytes:
        response = await client.audio.speech.create(model="scripted", voice="alloy", input="tone*4")
        return response.content

    results = await asyncio.gather(*(speak() for _ in range(3)), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], openai.RateLimitError), results
    assert errors[0].code == "rate_limit_exceeded"
    assert int(errors[0].response.headers["retry-after"]) >= 1


async def test_waiting_longer_than_the_queue_timeout_is_a_429(guarded: GatewayProcess) -> None:
    _wait_idle(guarded)
    async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=30) as client:
        long = asyncio.create_task(client.post("/v1/audio/speech", json=_body("tone*24")))  # about 6 s
        await asyncio.sleep(0.5)
        started = time.monotonic()
        waited = await client.post("/v1/audio/speech", json=_body("tone"))
        waited_for = time.monotonic() - started
        finished = await long
    error = _assert_error(waited, 429, "requests", "rate_limit_exceeded")
    assert f"within {QUEUE_TIMEOUT:g} s" in error["message"]
    assert int(waited.headers["retry-after"]) >= 1
    assert QUEUE_TIMEOUT <= waited_for < QUEUE_TIMEOUT + 2
    _assert_tone(finished.content, tones=24)
    assert _metric(guarded, "tts_speech_rejected_total", reason="queue_timeout") >= 1


def test_a_client_that_leaves_frees_its_slot(guarded: GatewayProcess) -> None:
    _wait_idle(guarded)
    for script in ("tone*40", "tone hang"):
        with httpx.stream(
            "POST", f"{guarded.url}/v1/audio/speech", json=_body(script), headers=AUTH, timeout=30
        ) as response:
            assert response.status_code == 200
            next(response.iter_bytes())
        # Within a second: before the chunk timeout could end the stalled one on its own.
        _wait_idle(guarded, within=1.0)
        _assert_tone(_speech(guarded, "tone").content, tones=1)


@pytest.mark.parametrize(
    ("script", "status", "code"),
    [("fail", 502, "backend_error"), ("reject", 400, "backend_rejected"), ("hang", 504, "backend_timeout")],
)
def test_a_backend_failure_before_the_first_byte_frees_the_slot(
    guarded: GatewayProcess, script: str, status: int, code: str
) -> None:
    _wait_idle(guarded)
    started = time.monotonic()
    response = _speech(guarded, script)
    _assert_error(response, status, "server_error" if status >= 500 else "invalid_request_error", code)
    # A stalled backend is given up after the chunk timeout, not the 120 s backend timeout.
    assert time.monotonic() - started < CHUNK_TIMEOUT + 3
    _wait_idle(guarded, within=1.0)
    _assert_tone(_speech(guarded, "tone").content, tones=1)


# -- timeouts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "code", "seconds"),
    [
        ("tone fail", "backend_error", 1.0),
        ("tone*2 hang", "backend_timeout", 1.0 + CHUNK_TIMEOUT),
        ("tone*60", "request_timeout", REQUEST_TIMEOUT),
    ],
)
def test_a_stream_that_fails_midway_ends_with_an_sse_error_event(
    guarded: GatewayProcess, script: str, code: str, seconds: float
) -> None:
    _wait_idle(guarded)
    started = time.monotonic()
    events = _sse_events(guarded, script, aborted=True)
    elapsed = time.monotonic() - started
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error"
    assert (events[-1]["error"]["type"], events[-1]["error"]["code"]) == ("server_error", code)
    assert not any(event["type"] == "speech.audio.done" for event in events)
    assert elapsed < seconds + 2
    _wait_idle(guarded, within=1.0)


@pytest.mark.parametrize(("script", "seconds"), [("tone*2 hang", CHUNK_TIMEOUT), ("tone*60", REQUEST_TIMEOUT)])
def test_audio_cut_by_a_timeout_is_never_a_complete_response(
    guarded: GatewayProcess, script: str, seconds: float
) -> None:
    """Audio already sent cannot be taken back, but the body ends without its last chunk: the client sees an error."""
    _wait_idle(guarded)
    started = time.monotonic()
    received = bytearray()
    body = _body(script, response_format="wav")
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", f"{guarded.url}/v1/audio/speech", json=body, headers=AUTH, timeout=30) as response,
    ):
        assert response.status_code == 200
        for chunk in response.iter_bytes():
            received += chunk
    elapsed = time.monotonic() - started
    assert received[:4] == b"RIFF"
    assert len(received) >= 44 + 2 * int(2 * TONE_SECONDS * 24_000) - 4800
    assert elapsed < seconds + 3
    _wait_idle(guarded, within=1.0)


def test_a_hung_offline_call_is_a_504_at_the_request_timeout(scripted_triton: EmbeddedTriton, tmp_path: Path) -> None:
    gateway = _gateway(
        scripted_triton,
        tmp_path,
        TTS_BACKEND_MODE="offline",
        TTS_REQUEST_TIMEOUT="3",
        TTS_QUEUE_TIMEOUT="1",
    )
    gateway.start()
    try:
        started = time.monotonic()
        response = httpx.post(f"{gateway.url}/v1/audio/speech", json=_body("hang"), timeout=30)
        elapsed = time.monotonic() - started
        error = _assert_error(response, 504, "server_error", "request_timeout")
        assert "3 s" in error["message"]
        # Without the request timeout the gateway would wait out the 120 s backend timeout.
        assert 3.0 <= elapsed < 6.0
        # Triton was told to stop: the model's one instance is free for the next request.
        done = httpx.post(f"{gateway.url}/v1/audio/speech", json=_body("tone*2"), timeout=30)
        _assert_tone(done.content, tones=2)
    finally:
        gateway.stop()
