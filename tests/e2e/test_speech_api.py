"""POST /v1/audio/speech through the real gateway process, the real Triton and the openai SDK."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import struct
import time
import wave
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError, OpenAI

from benchmarks.memory_soak import thread_count
from tests.audio_checks import assert_speech, decode
from tests.e2e.gateway_process import GatewayProcess, stream_requests_seen
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = pytest.mark.triton

SHORT = "The quick brown fox jumps over the lazy dog."
PARAGRAPH = (
    "Streaming speech should start quickly. Every sentence is synthesised in turn. "
    "The listener hears the first words while the rest is still being made. "
    "Long inputs are split, so nothing is cut off. This is the fifth sentence. "
    "And this sixth sentence ends the paragraph."
)
CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}


@pytest.mark.parametrize("fmt", sorted(CONTENT_TYPES))
def test_every_format_decodes_to_speech(
    client: OpenAI, gateway: GatewayProcess, piper_seconds: Callable[..., float], fmt: str
) -> None:
    response = client.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, response_format=fmt)  # type: ignore[arg-type]
    assert response.response.headers["content-type"].startswith(CONTENT_TYPES[fmt])
    audio = decode(response.content, fmt)
    assert_speech(audio, expected_seconds=piper_seconds(SHORT))


def test_default_format_is_mp3(client: OpenAI) -> None:
    response = client.audio.speech.create(model="tts-1", voice="nova", input=SHORT)
    assert response.response.headers["content-type"] == "audio/mpeg"
    assert_speech(decode(response.content, "mp3"), expected_seconds=decode(response.content, "mp3").duration)


def test_streaming_response_streams_before_synthesis_ends(client: OpenAI, piper_seconds: Callable[..., float]) -> None:
    started = time.perf_counter()
    arrivals: list[float] = []
    body = bytearray()
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=PARAGRAPH, response_format="pcm"
    ) as response:
        for piece in response.iter_bytes(4096):
            arrivals.append(time.perf_counter() - started)
            body += piece
    assert len(arrivals) > 3
    # The first audio must arrive well before the last: the response is produced as it is synthesised.
    assert arrivals[0] < 0.5 * arrivals[-1], arrivals
    assert_speech(decode(bytes(body), "pcm"), expected_seconds=piper_seconds(PARAGRAPH), tolerance=0.25)


async def test_async_client_streams_to_file(async_client: AsyncOpenAI, tmp_path: object) -> None:
    async with async_client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice={"id": "coral"}, input=SHORT, response_format="wav"
    ) as response:
        body = await response.read()
    audio = decode(body, "wav")
    assert audio.sample_rate == 24_000
    assert audio.rms > 0.01


def test_streamed_wav_header_uses_unknown_sizes(gateway: GatewayProcess) -> None:
    response = httpx.post(
        f"{gateway.url}/v1/audio/speech",
        json={"model": "tts-1", "voice": "alloy", "input": SHORT, "response_format": "wav"},
        timeout=60,
    )
    assert response.status_code == 200
    riff_size = struct.unpack("<I", response.content[4:8])[0]
    data_index = response.content.index(b"data")
    data_size = struct.unpack("<I", response.content[data_index + 4 : data_index + 8])[0]
    assert riff_size == data_size == 0xFFFFFFFF


def test_whole_wav_carries_its_true_length_for_pythons_wave(
    client: OpenAI, piper_seconds: Callable[..., float], tmp_path: Path
) -> None:
    # What the openai SDK's README does, asking for the response whole (a header sent ahead of a stream
    # cannot know its length): the file plays in Python's wave, which believes the header's sizes.
    whole = tmp_path / "whole.wav"
    client.audio.speech.create(
        model="tts-1", voice="alloy", input=PARAGRAPH, response_format="wav", extra_body={"stream": False}
    ).write_to_file(whole)
    with wave.open(str(whole)) as reader:
        assert (reader.getframerate(), reader.getnchannels(), reader.getsampwidth()) == (24_000, 1, 2)
        frames = reader.getnframes()
        samples = np.frombuffer(reader.readframes(frames), dtype="<i2")
    assert samples.size == frames == (whole.stat().st_size - 44) // 2
    seconds = frames / 24_000
    audio = decode(whole.read_bytes(), "wav")
    assert audio.duration == pytest.approx(seconds, abs=1e-3)
    assert_speech(audio, expected_seconds=piper_seconds(PARAGRAPH), tolerance=0.25)
    # Streamed (the default), the same call's header goes out before the audio exists.
    streamed = tmp_path / "streamed.wav"
    client.audio.speech.create(model="tts-1", voice="alloy", input=PARAGRAPH, response_format="wav").write_to_file(
        streamed
    )
    with wave.open(str(streamed)) as reader:
        assert reader.getnframes() == 0xFFFFFFFF // 2


def test_concatenated_mp3_responses_play_back_to_back(client: OpenAI) -> None:
    first = client.audio.speech.create(model="tts-1", voice="alloy", input="First response.")
    second = client.audio.speech.create(model="tts-1", voice="alloy", input="Second response.")
    joined = decode(first.content + second.content, "mp3")
    parts = decode(first.content, "mp3").duration + decode(second.content, "mp3").duration
    assert abs(joined.duration - parts) < 0.1


def test_speed_changes_tempo(client: OpenAI) -> None:
    normal = decode(
        client.audio.speech.create(model="tts-1", voice="alloy", input=PARAGRAPH, response_format="pcm").content, "pcm"
    )
    fast = decode(
        client.audio.speech.create(
            model="tts-1", voice="alloy", input=PARAGRAPH, response_format="pcm", speed=2.0
        ).content,
        "pcm",
    )
    # Durations scale by 1 / speed, pauses included (tests/e2e/test_speed.py checks the whole range).
    assert 0.45 < fast.duration / normal.duration < 0.55


def test_sse_events(gateway: GatewayProcess, piper_seconds: Callable[..., float]) -> None:
    events = []
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/audio/speech",
        json={"model": "tts-1", "voice": "alloy", "input": PARAGRAPH, "response_format": "pcm", "stream_format": "sse"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 1
    assert events[-1]["type"] == "speech.audio.done"
    usage = events[-1]["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert_speech(decode(pcm, "pcm"), expected_seconds=piper_seconds(PARAGRAPH), tolerance=0.25)


def test_long_input_is_not_truncated(client: OpenAI, piper_seconds: Callable[..., float]) -> None:
    text = " ".join(f"This is sentence number {n} of a long input that must be read to the end." for n in range(1, 26))
    assert len(text) > 1500
    audio = decode(
        client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format="pcm").content, "pcm"
    )
    assert_speech(audio, expected_seconds=piper_seconds(text), tolerance=0.25)


def test_instructions_are_accepted_where_the_model_has_no_use_for_them(client: OpenAI) -> None:
    response = client.audio.speech.create(
        model="tts-1", voice="alloy", input=SHORT, response_format="pcm", instructions="Whisper."
    )
    assert decode(response.content, "pcm").rms > 0.01


def test_native_voice_by_name(client: OpenAI) -> None:
    audio = decode(
        client.audio.speech.create(model="piper", voice="joe", input=SHORT, response_format="flac").content, "flac"
    )
    assert audio.rms > 0.01


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "tts-1", "voice": "alloy", "input": ""}, 400, "input"),
        ({"model": "tts-1", "voice": "alloy", "input": "   "}, 400, "input"),
        ({"model": "tts-1", "voice": "alloy", "input": "x" * 4097}, 400, "input"),
        ({"model": "tts-1", "voice": "alloy", "input": "hi", "response_format": "ogg"}, 400, "response_format"),
        ({"model": "tts-1", "voice": "alloy", "input": "hi", "speed": 4.5}, 400, "speed"),
        ({"model": "tts-1", "voice": "alloy", "input": "hi", "speed": 0.1}, 400, "speed"),
        ({"model": "tts-1", "voice": "alloy", "input": "hi", "stream_format": "jsonl"}, 400, "stream_format"),
        ({"model": "tts-1", "voice": "alloy", "input": "hi", "colour": "red"}, 400, "colour"),
        ({"model": "tts-1", "voice": "nobody", "input": "hi"}, 400, "voice"),
        ({"model": "tts-1", "voice": "lumen", "input": "hi"}, 400, "voice"),
        ({"model": "tts-1", "input": "hi"}, 400, "voice"),
        ({"model": "tts-9", "voice": "alloy", "input": "hi"}, 404, "model"),
        ({"model": "tts-1", "voice": 7, "input": "hi"}, 400, "voice"),
        ({"model": "tts-1", "voice": "alloy", "input": "..."}, 400, "input"),
        ({"model": "tts-1", "voice": "alloy", "input": "...", "stream_format": "sse"}, 400, "input"),
        ({"model": "tts-1", "voice": "alloy", "input": "hi", "stream": "no"}, 400, "stream"),
        ({"model": "tts-1", "voice": "alloy", "input": "hi", "stream": False, "stream_format": "sse"}, 400, "stream"),
    ],
)
def test_bad_requests_get_openai_errors(
    gateway: GatewayProcess, body: dict[str, object], status: int, param: str
) -> None:
    response = httpx.post(f"{gateway.url}/v1/audio/speech", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].startswith(param)
    assert error["message"]


def test_malformed_json_is_a_400(gateway: GatewayProcess) -> None:
    response = httpx.post(
        f"{gateway.url}/v1/audio/speech", content=b'{"model": "tts-1",', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None


def test_sdk_raises_typed_errors(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as bad:
        client.audio.speech.create(model="tts-1", voice="alloy", input="hi", speed=9)
    assert bad.value.body["param"] == "speed"  # type: ignore[index]
    with pytest.raises(NotFoundError):
        client.audio.speech.create(model="no-such-model", voice="alloy", input="hi")


def test_unknown_route_is_an_openai_404(gateway: GatewayProcess) -> None:
    response = httpx.get(f"{gateway.url}/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_client_disconnect_cancels_synthesis(gateway: GatewayProcess, cpu_triton: EmbeddedTriton) -> None:
    sentences = 40
    text = " ".join(f"Sentence {n} keeps the backend busy for a while." for n in range(sentences))
    before = stream_requests_seen(cpu_triton.grpc_url)
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/audio/speech",
        json={"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm"},
        timeout=60,
    ) as response:
        next(response.iter_bytes())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{gateway.url}/metrics").text
        if 'outcome="cancelled"' in metrics and "tts_speech_in_flight 0.0" in metrics:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the disconnected request was not cancelled:\n" + metrics)
    # On the Triton side the work stopped too: only the sentences in flight at the disconnect
    # (synthesis_parallelism of them, plus the one being read) ever reached the model.
    time.sleep(2.0)
    seen = stream_requests_seen(cpu_triton.grpc_url) - before
    assert seen <= 4, f"{seen} of {sentences} sentence requests reached Triton after the client left"
    # The server is still healthy and serves the next request.
    assert httpx.get(f"{gateway.url}/health").status_code == 200


def test_compressed_responses_start_no_codec_threads(
    gateway: GatewayProcess, piper_seconds: Callable[..., float]
) -> None:
    """FFmpeg would give every encoder about a thread per CPU (ffmpeg_threads.py). Four whole responses at
    once fill the gateway's own pools first; then four of 80 sentences each, counted as soon as each has
    sent its first audio (their synthesis and encoding go on for a while after), may hold hardly more
    threads than the gateway had at rest."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("with one CPU FFmpeg starts no threads of its own either way")
    long_text = " ".join(f"Sentence {n} keeps the backend busy for a while." for n in range(80))
    with httpx.Client(base_url=gateway.url, timeout=60) as http:

        def speech(text: str) -> dict[str, str]:
            return {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "flac"}

        def four(stack: contextlib.ExitStack, text: str) -> list[httpx.Response]:
            return [stack.enter_context(http.stream("POST", "/v1/audio/speech", json=speech(text))) for _ in range(4)]

        with contextlib.ExitStack() as stack:
            audio = [b"".join(response.iter_bytes()) for response in four(stack, SHORT)]
        for data in audio:
            assert_speech(decode(data, "flac"), expected_seconds=piper_seconds(SHORT))
        at_rest = thread_count(gateway.pid)
        with contextlib.ExitStack() as stack:
            assert all(next(response.iter_bytes()) for response in four(stack, long_text))
            in_flight = thread_count(gateway.pid)
    # Two CPUs: each open encoder would have added two threads; the gateway's pools may still add one or two.
    assert in_flight <= at_rest + 3, f"{in_flight - at_rest} threads more with four responses in flight"
