"""Hostile requests against the real gateway process: every one is a clean 4xx in OpenAI's envelope.

Malformed bodies, wrong types, control characters and lone surrogates in the speech API;
broken, fake and bomb-like recordings and path-like voice names in the upload API.
"""

from __future__ import annotations

import io
import json
import struct
import time
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.audio_checks import decode
from tests.e2e.gateway_process import GatewayProcess
from tests.hostile_audio import flac_silence_bomb, wav_with_header

pytestmark = pytest.mark.triton

_VALID: dict[str, Any] = {"model": "tts-1", "voice": "alloy", "input": "Hello there.", "response_format": "pcm"}
_JSON = {"content-type": "application/json"}
_FORM = {"content-type": "application/x-www-form-urlencoded"}


def _speech(gateway: GatewayProcess, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/audio/speech", content=body, headers=headers or _JSON, timeout=60)


def _with(**fields: Any) -> bytes:
    return json.dumps(_VALID | fields).encode()


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    error: dict[str, Any] = body["error"]
    return error


# -- the speech API ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        pytest.param(b'{"model": "tts-1", "input": ', _JSON, id="truncated-json"),
        pytest.param(b"{'model': 'tts-1'}", _JSON, id="not-json"),
        pytest.param(b"[1, 2]", _JSON, id="array"),
        pytest.param(b'"Hello there."', _JSON, id="string"),
        pytest.param(b"null", _JSON, id="null"),
        pytest.param(b"42", _JSON, id="number"),
        pytest.param(b"", _JSON, id="empty"),
        pytest.param(b"", {}, id="empty-no-content-type"),
        pytest.param(b'{"model":"tts-1","voice":"alloy","input":"caf\xe9 \xff\xfe"}', _JSON, id="invalid-utf8"),
        pytest.param(_with(), {"content-type": "text/plain"}, id="text-plain"),
        pytest.param(b"model=tts-1&voice=alloy&input=hi", _FORM, id="form"),
        pytest.param(b'{"model":"tts-1","voice":' + b"[" * 50_000 + b"]" * 50_000 + b"}", _JSON, id="deep-nesting"),
    ],
)
def test_unusable_bodies_are_400(gateway: GatewayProcess, body: bytes, headers: dict[str, str]) -> None:
    _assert_error(_speech(gateway, body, headers), 400)


_NOT_STRINGS = [5, 1.5, True, None, [], {}]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        *[("model", v) for v in _NOT_STRINGS],
        *[("input", v) for v in _NOT_STRINGS],
        *[("voice", v) for v in [5, True, None, [], {}, {"id": 5}, {"name": "alloy"}, {"id": "alloy", "x": 1}]],
        *[("instructions", v) for v in [5, True, [], {}]],
        *[("response_format", v) for v in ["mp4", "MP3", 5, None]],
        *[("stream_format", v) for v in ["chunked", 1, None]],
        # Strict numbers: a string or a boolean is not a speed, even "1.5" or true.
        *[("speed", v) for v in ["1.5", "fast", True, None, [], 0, 0.2, 4.01, 1e308, -1]],
        *[("seed", v) for v in [-1, 1.5, "7", True, 2**63, [], 10**40]],
        ("unknown_field", 1),
        ("model", ""),
        ("input", ""),
        ("input", " \n\t "),
        ("input", "x" * 4097),
        ("voice", ""),
        ("voice", "v" * 10_000),
        ("instructions", "x" * 4097),
    ],
)
def test_wrong_values_name_their_field(gateway: GatewayProcess, field: str, value: Any) -> None:
    error = _assert_error(_speech(gateway, _with(**{field: value})), 400, param=field)
    assert len(error["message"]) < 300  # never echoes a huge value back


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_speed_is_400(gateway: GatewayProcess, literal: str) -> None:
    body = _with(speed=7).replace(b'"speed": 7', b'"speed": ' + literal.encode())

    error = _assert_error(_speech(gateway, body), 400, param="speed")
    assert "finite" in error["message"]


@pytest.mark.parametrize("field", ["input", "voice", "instructions", "model"])
def test_lone_surrogates_are_400(gateway: GatewayProcess, field: str) -> None:
    # "\ud800" is valid JSON but not Unicode text: it cannot be encoded for the backend.
    body = _with(**{field: "Hello SURROGATE there."}).replace(b"SURROGATE", b"\\ud800")

    _assert_error(_speech(gateway, body), 400, param=field)


def test_lone_surrogate_in_a_voice_object_is_400(gateway: GatewayProcess) -> None:
    body = _with(voice={"id": "SURROGATE"}).replace(b"SURROGATE", b"\\udfff")

    _assert_error(_speech(gateway, body), 400, param="voice")


@pytest.mark.parametrize(
    "text",
    [
        "Hello\x00 there, friend.",
        "\x00\x00Hello there, friend.\x00",
        "Hello \x1b[31mthere\x1b[0m, friend.",
        "Hello\x07\x08\x0b\x0c\x7f\x85\x9f there, friend.",
    ],
)
def test_control_characters_in_input_are_spoken_around(gateway: GatewayProcess, text: str) -> None:
    # They become spaces before the text reaches the backend (NUL used to fail Piper: a 502).
    response = _speech(gateway, _with(input=text))

    assert response.status_code == 200, response.text
    audio = decode(response.content, "pcm")
    assert audio.duration > 0.5 and audio.rms > 0.01


@pytest.mark.parametrize("text", ["\x00", "\x00\x01\x02\x1f", "\x1b\x7f \x0c"])
def test_input_of_control_characters_only_is_400(gateway: GatewayProcess, text: str) -> None:
    _assert_error(_speech(gateway, _with(input=text)), 400, param="input")


def test_control_characters_in_voice_and_instructions(gateway: GatewayProcess) -> None:
    error = _assert_error(_speech(gateway, _with(voice="al\x00loy")), 400, param="voice")
    assert error["code"] == "voice_not_found"
    # Piper ignores instructions; a model that reads them gets spaces for the controls.
    assert _speech(gateway, _with(instructions="Calm\x00 and\x1b slow.")).status_code == 200


# -- the upload API ------------------------------------------------------------------------------


def _tone_wav(seconds: float, rate: int = 22_050) -> bytes:
    t = np.arange(round(seconds * rate)) / rate
    signal = 0.4 * np.sin(2 * np.pi * 180 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    buffer = io.BytesIO()
    sf.write(buffer, signal, rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def _video_only_mkv() -> bytes:
    """A valid Matroska file with one video stream and no audio."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="matroska") as output:
        stream = output.add_stream("mpeg4", rate=10)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        for index in range(5):
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), dtype=np.uint8), format="rgb24")
            frame.pts = index
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return buffer.getvalue()


def _png() -> bytes:
    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(header)) + b"IHDR" + header + b"\0" * 64


def _upload(gateway: GatewayProcess, name: str, data: bytes, transcript: str | None = None) -> httpx.Response:
    fields = {"name": name} | ({"transcript": transcript} if transcript is not None else {})
    return httpx.post(
        f"{gateway.url}/v1/audio/voices",
        data=fields,
        files={"audio_sample": ("sample.bin", data, "application/octet-stream")},
        timeout=60,
    )


def _tree(root: Path) -> set[str]:
    return {str(path.relative_to(root)) for path in root.rglob("*")}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(lambda: b"", "empty", id="zero-length"),
        pytest.param(lambda: _tone_wav(3.0)[:30], "could not be decoded", id="truncated-header"),
        pytest.param(lambda: _tone_wav(3.0)[:4000], "too short", id="truncated-data"),
        pytest.param(lambda: wav_with_header(4_000_000_000), "", id="rate-4GHz"),
        pytest.param(lambda: wav_with_header(0), "", id="rate-zero"),
        pytest.param(lambda: wav_with_header(1_000), "unsupported sample rate", id="rate-1kHz"),
        pytest.param(lambda: wav_with_header(16_000, channels=65_535, frames=4), "", id="channels-65535"),
        pytest.param(lambda: wav_with_header(16_000, channels=0), "", id="channels-zero"),
        pytest.param(lambda: wav_with_header(16_000, bits=0), "", id="bits-zero"),
        pytest.param(lambda: np.random.default_rng(3).bytes(50_000), "could not be decoded", id="random-bytes"),
        pytest.param(lambda: b"RIFF" + np.random.default_rng(4).bytes(5_000), "", id="random-after-riff"),
        pytest.param(_png, "", id="png"),
        pytest.param(lambda: b"Hello, I am a text file.\n" * 200, "could not be decoded", id="text"),
        pytest.param(_video_only_mkv, "no audio", id="video-only-container"),
        pytest.param(lambda: _tone_wav(0.4), "too short", id="too-short"),
        pytest.param(lambda: _tone_wav(45.0, rate=8_000), "too long: 45.0 s", id="too-long"),
        pytest.param(flac_silence_bomb, "runs past 60 s", id="decompression-bomb"),
    ],
)
def test_hostile_recordings_are_400(gateway: GatewayProcess, voices_dir: Path, make: Any, message: str) -> None:
    before = _tree(voices_dir)
    started = time.monotonic()

    error = _assert_error(_upload(gateway, "hostile-recording", make()), 400, param="audio_sample")

    assert message in error["message"]
    assert time.monotonic() - started < 10  # a bomb is stopped at the cap, not decoded whole
    assert _tree(voices_dir) == before


@pytest.mark.parametrize(
    "name",
    [
        "../escape",
        "../../etc/passwd",
        "a/b",
        "a\\b",
        "/tmp/absolute",
        ".",
        "..",
        ".hidden",
        "a\x00b",
        "trailing-newline\n",
        "dotted.wav",
        "ａｂｃ",  # fullwidth letters  # noqa: RUF001
        "a\u2215b",  # division slash
        "\u13aabc",  # Cherokee letter A
        "x" * 65,
        "x" * 100_000,
        "-leading-dash",
        "spa ce",
    ],
)
def test_path_like_and_lookalike_voice_names_are_400(gateway: GatewayProcess, voices_dir: Path, name: str) -> None:
    root = voices_dir.parent
    before = _tree(root)

    error = _assert_error(_upload(gateway, name, _tone_wav(2.0)), 400, param="name")

    assert len(error["message"]) < 300
    assert _tree(root) == before
    listed = {v["id"] for v in httpx.get(f"{gateway.url}/v1/audio/voices?all=true").json()["voices"]}
    assert name not in listed


def test_transcript_control_characters_are_replaced(gateway: GatewayProcess, voices_dir: Path) -> None:
    response = _upload(gateway, "control-transcript", _tone_wav(2.0), "Read\x00 this\x1b[0m aloud.")
    assert response.status_code == 201, response.text
    try:
        assert response.json()["transcript"] == "Read  this [0m aloud."
        stored = json.loads((voices_dir / "control-transcript.json").read_text())
        assert "\x00" not in stored["transcript"]
    finally:
        httpx.delete(f"{gateway.url}/v1/audio/voices/control-transcript")


@pytest.mark.parametrize("path", ["..%2F..%2Fetc%2Fpasswd", "%2e%2e", "a%00b", "lumen%00", "%2Ftmp%2Fx"])
def test_path_like_voice_ids_cannot_be_deleted(gateway: GatewayProcess, path: str) -> None:
    response = httpx.delete(f"{gateway.url}/v1/audio/voices/{path}")

    _assert_error(response, 404)
    listed = {v["id"] for v in httpx.get(f"{gateway.url}/v1/audio/voices?all=true").json()["voices"]}
    assert "lumen" in listed


def test_the_uploaded_file_name_is_never_used(gateway: GatewayProcess, voices_dir: Path) -> None:
    target = voices_dir.parent / "planted.wav"
    response = httpx.post(
        f"{gateway.url}/v1/audio/voices",
        data={"name": "file-name-ignored"},
        files={"audio_sample": (f"../../../../../..{target}", _tone_wav(2.0), "audio/wav")},
        timeout=60,
    )
    try:
        assert response.status_code == 201, response.text
        assert not target.exists()
        assert (voices_dir / "file-name-ignored.wav").exists()
    finally:
        httpx.delete(f"{gateway.url}/v1/audio/voices/file-name-ignored")
