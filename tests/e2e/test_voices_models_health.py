"""Voices, model listings, health and metrics through the real gateway process."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from openai import OpenAI

from tests.audio_checks import decode
from tests.e2e.gateway_process import GatewayProcess
from tts_gateway.paths import REFERENCE_VOICES

pytestmark = pytest.mark.triton

REPO_ROOT = Path(__file__).resolve().parents[2]


def _speech_like_wav(seconds: float = 2.0, rate: int = 44_100) -> bytes:
    """A voiced, amplitude-modulated signal: not speech, but valid and clearly not silence."""
    t = np.arange(int(seconds * rate)) / rate
    signal = 0.4 * np.sin(2 * np.pi * 160 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    buffer = io.BytesIO()
    sf.write(buffer, np.stack([signal, signal], axis=1), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def _upload(
    gateway: GatewayProcess, name: str, data: bytes, transcript: str | None = "A test recording."
) -> httpx.Response:
    fields = {"name": name} | ({"transcript": transcript} if transcript is not None else {})
    return httpx.post(
        f"{gateway.url}/v1/audio/voices",
        data=fields,
        files={"audio_sample": ("sample.wav", data, "audio/wav")},
        timeout=30,
    )


def test_model_listings(gateway: GatewayProcess, client: OpenAI) -> None:
    ids = {m.id for m in client.models.list()}
    assert {"piper", "tts-1", "tts-1-hd", "gpt-4o-mini-tts"} <= ids
    audio_models = httpx.get(f"{gateway.url}/v1/audio/models").json()["models"]
    piper = next(m for m in audio_models if m["id"] == "piper")
    assert piper["sample_rate"] == 22_050
    assert piper["supports_cloning"] is False
    assert piper["supports_streaming"] is True
    assert piper["voices"] == ["joe"]


def test_voice_listing_offers_what_the_models_can_speak(gateway: GatewayProcess) -> None:
    # Open WebUI fills its voice picker from this list: on Piper alone the reference voices
    # (which only cloning models speak) must not be offered.
    offered = httpx.get(f"{gateway.url}/v1/audio/voices").json()["voices"]
    assert [(v["id"], v["type"], v["models"]) for v in offered] == [("joe", "builtin", ["piper"])]
    for_piper = httpx.get(f"{gateway.url}/v1/audio/voices", params={"model": "tts-1"}).json()["voices"]
    assert [v["id"] for v in for_piper] == ["joe"]
    unknown = httpx.get(f"{gateway.url}/v1/audio/voices", params={"model": "nope"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"


def test_voice_listing_of_all_has_builtin_and_shipped_voices(gateway: GatewayProcess) -> None:
    listed = httpx.get(f"{gateway.url}/v1/audio/voices", params={"all": "true"}).json()["voices"]
    voices = {v["id"]: v for v in listed}
    assert voices["joe"]["type"] == "builtin"
    for shipped in ("lumen", "harbor"):
        assert voices[shipped]["type"] == "reference"
        assert voices[shipped]["models"] == []
        assert voices[shipped]["transcript"] == (REFERENCE_VOICES / f"{shipped}.txt").read_text().strip()
        assert 1.0 < voices[shipped]["duration"] < 30.0


def test_upload_persist_and_delete(gateway: GatewayProcess, voices_dir: Path) -> None:
    response = _upload(gateway, "my-voice_1", _speech_like_wav())
    assert response.status_code == 201, response.text
    created = response.json()
    assert created["object"] == "audio.voice"
    assert created["id"] == "my-voice_1"
    assert created["transcript"] == "A test recording."
    assert abs(created["duration"] - 2.0) < 0.1
    stored, rate = sf.read(voices_dir / "my-voice_1.wav")
    assert rate == 16_000 and stored.ndim == 1
    assert {p.name for p in voices_dir.iterdir()} >= {"my-voice_1.wav", "my-voice_1.json"}

    assert _upload(gateway, "my-voice_1", _speech_like_wav()).status_code == 409

    # Survives a restart of the gateway.
    gateway.stop()
    gateway.start()
    listed = {v["id"]: v for v in httpx.get(f"{gateway.url}/v1/audio/voices?all=true").json()["voices"]}
    assert listed["my-voice_1"]["type"] == "uploaded"

    deleted = httpx.delete(f"{gateway.url}/v1/audio/voices/my-voice_1")
    assert deleted.status_code == 200
    assert deleted.json() == {"object": "audio.voice.deleted", "id": "my-voice_1", "deleted": True}
    assert not (voices_dir / "my-voice_1.wav").exists()
    assert httpx.delete(f"{gateway.url}/v1/audio/voices/my-voice_1").status_code == 404


@pytest.mark.parametrize(
    ("name", "data", "status", "param"),
    [
        ("../escape", _speech_like_wav(), 400, "name"),
        ("ok-name", b"this is not audio at all", 400, "audio_sample"),
        ("ok-name", b"", 400, "audio_sample"),
        ("ok-name", _speech_like_wav()[:100], 400, "audio_sample"),
        ("ok-name", _speech_like_wav(seconds=0.3), 400, "audio_sample"),
        ("lumen", _speech_like_wav(), 409, "name"),
        ("joe", _speech_like_wav(), 409, "name"),
    ],
)
def test_bad_uploads(gateway: GatewayProcess, name: str, data: bytes, status: int, param: str) -> None:
    response = _upload(gateway, name, data)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_oversized_upload_is_413(gateway: GatewayProcess) -> None:
    response = _upload(gateway, "huge", b"\0" * (10 * 1024 * 1024 + 1))
    assert response.status_code == 413
    assert response.json()["error"]["param"] == "audio_sample"


@pytest.mark.parametrize(("voice", "why"), [("lumen", "ships with the server"), ("joe", "is built into a model")])
def test_builtin_and_shipped_voices_cannot_be_deleted(gateway: GatewayProcess, voice: str, why: str) -> None:
    response = httpx.delete(f"{gateway.url}/v1/audio/voices/{voice}")
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "voice_read_only" and error["param"] == "voice_id"
    assert f"{why} and cannot be deleted" in error["message"]
    listed = httpx.get(f"{gateway.url}/v1/audio/voices", params={"all": "true"}).json()["voices"]
    assert voice in {v["id"] for v in listed}


def test_health_and_metrics(gateway: GatewayProcess, client: OpenAI) -> None:
    health = httpx.get(f"{gateway.url}/health")
    assert health.status_code == 200
    assert "piper" in health.json()["models"]
    decode(
        client.audio.speech.create(model="tts-1", voice="alloy", input="Counting.", response_format="pcm").content,
        "pcm",
    )
    metrics = httpx.get(f"{gateway.url}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'tts_speech_requests_total{format="pcm",model="piper",outcome="ok"}' in metrics.text
    assert "tts_time_to_first_audio_seconds_bucket" in metrics.text
    assert "tts_triton_ready 1.0" in metrics.text
    assert "tts_backend_ready 1.0" in metrics.text  # its former name, still exported
    assert "process_open_fds " in metrics.text
    assert "process_resident_memory_bytes " in metrics.text
    assert "tts_event_loop_tasks " in metrics.text


def test_wrong_method_names_every_allowed_one(gateway: GatewayProcess) -> None:
    # /v1/audio/voices has a GET and a POST route; the 405 must name both.
    response = httpx.put(f"{gateway.url}/v1/audio/voices", json={})
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert set(response.headers["allow"].split(", ")) == {"GET", "POST"}


def test_backend_down_gives_503(tmp_path: Path) -> None:
    from tests.e2e.gateway_process import free_port

    process = GatewayProcess(
        tmp_path / "gateway.log",
        {"TTS_TRITON_URL": f"127.0.0.1:{free_port()}", "TTS_VOICES_DIR": str(tmp_path / "voices")},
    )
    process.start(expect_healthy=False)
    try:
        health = httpx.get(f"{process.url}/health")
        assert health.status_code == 503
        speech = httpx.post(
            f"{process.url}/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": "hello"}
        )
        assert speech.status_code == 503
        assert speech.json()["error"]["code"] == "backend_unavailable"
    finally:
        process.stop()
