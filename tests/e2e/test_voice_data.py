"""Uploaded voices as user data: one winner per name, no half voice after a crash, deletion that sticks.

A gateway process of its own, killed with SIGKILL (no cleanup runs) while uploads are on
the wire or being stored, and restarted over the same voices directory.
"""

from __future__ import annotations

import io
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.e2e.gateway_process import GatewayProcess
from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.gateway.speech.voice_registry import GENERATION_FILE, LOCK_FILE

pytestmark = pytest.mark.triton

_BOUNDARY = "voice-data-test-boundary"


@pytest.fixture(scope="module")
def voices(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data") / "voices"


@pytest.fixture(scope="module")
def gateway(cpu_triton: EmbeddedTriton, voices: Path) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        voices.parent / "gateway.log", {"TTS_TRITON_URL": cpu_triton.grpc_url, "TTS_VOICES_DIR": str(voices)}
    )
    process.start()
    yield process
    process.stop()


def _recording(seconds: float, rate: int = 22_050, channels: int = 1) -> bytes:
    t = np.arange(round(seconds * rate)) / rate
    mono = 0.4 * np.sin(2 * np.pi * 170 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    buffer = io.BytesIO()
    sf.write(buffer, np.repeat(mono[:, np.newaxis], channels, axis=1), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def _multipart(name: str, transcript: str, audio: bytes) -> bytes:
    parts = [
        f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="name"\r\n\r\n{name}\r\n'.encode(),
        f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="transcript"\r\n\r\n{transcript}\r\n'.encode(),
        f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="audio_sample"; filename="a.wav"\r\n'.encode()
        + b"Content-Type: audio/wav\r\n\r\n"
        + audio
        + f"\r\n--{_BOUNDARY}--\r\n".encode(),
    ]
    return b"".join(parts)


def _files(voices: Path) -> list[str]:
    """The voices directory's entries, less the registry's own lock and generation files."""
    return sorted(p.name for p in voices.iterdir() if p.name not in (LOCK_FILE, GENERATION_FILE))


def _listed(gateway: GatewayProcess) -> dict[str, dict[str, object]]:
    return {v["id"]: v for v in httpx.get(f"{gateway.url}/v1/audio/voices?all=true").json()["voices"]}


def _kill_and_restart(gateway: GatewayProcess) -> None:
    gateway.send_signal(signal.SIGKILL)
    assert gateway.wait(timeout=10) == -signal.SIGKILL
    gateway.start()


def _assert_whole_or_absent(gateway: GatewayProcess, voices: Path, name: str, seconds: float) -> bool:
    """The voice is complete (listed, both files, its own audio) or entirely gone; nothing else is left."""
    files = _files(voices)
    voice = _listed(gateway).get(name)
    if voice is None:
        assert files == [], files
        return False
    assert files == [f"{name}.json", f"{name}.wav"], files
    assert voice["duration"] == pytest.approx(seconds, abs=0.01)
    assert sf.info(voices / f"{name}.wav").duration == pytest.approx(seconds, abs=0.01)
    return True


def _delete_all(gateway: GatewayProcess) -> None:
    for voice_id, voice in _listed(gateway).items():
        if voice["type"] == "uploaded":
            assert httpx.delete(f"{gateway.url}/v1/audio/voices/{voice_id}").status_code == 200


def test_parallel_uploads_of_one_name_have_exactly_one_winner(gateway: GatewayProcess, voices: Path) -> None:
    # Each take has its own length, so the stored files show whose they are; half of them
    # spell the name in capitals, which must collide as well (case-insensitive file systems).
    takes = 12

    def upload(take: int) -> httpx.Response:
        return httpx.post(
            f"{gateway.url}/v1/audio/voices",
            data={"name": "contested" if take % 2 else "CONTESTED", "transcript": f"take {take}"},
            files={"audio_sample": ("take.wav", _recording(1.5 + 0.25 * take), "audio/wav")},
            timeout=120,
        )

    with ThreadPoolExecutor(takes) as pool:
        responses = list(pool.map(upload, range(takes)))

    statuses = sorted(r.status_code for r in responses)
    assert statuses == [201] + [409] * (takes - 1), [r.text for r in responses]
    assert all(r.json()["error"]["code"] == "voice_exists" for r in responses if r.status_code == 409)
    winner = next(r.json() for r in responses if r.status_code == 201)
    take = int(winner["transcript"].removeprefix("take "))
    assert winner["duration"] == pytest.approx(1.5 + 0.25 * take, abs=0.01)
    assert _files(voices) == [f"{winner['id']}.json", f"{winner['id']}.wav"]
    assert json.loads((voices / f"{winner['id']}.json").read_text())["transcript"] == winner["transcript"]
    assert sf.info(voices / f"{winner['id']}.wav").duration == pytest.approx(winner["duration"], abs=0.001)

    gateway.stop()
    gateway.start()
    assert _listed(gateway)[winner["id"]]["transcript"] == winner["transcript"]
    _delete_all(gateway)


def test_crash_while_an_upload_is_received_leaves_nothing(gateway: GatewayProcess, voices: Path) -> None:
    body = _multipart("half-received", "never finished", _recording(3.0))
    rest_may_go = threading.Event()
    outcome: list[BaseException | httpx.Response] = []

    def chunks() -> Iterator[bytes]:
        yield body[: len(body) // 2]
        rest_may_go.wait(timeout=30)
        yield body[len(body) // 2 :]

    def send() -> None:
        try:
            outcome.append(
                httpx.post(
                    f"{gateway.url}/v1/audio/voices",
                    content=chunks(),
                    headers={"content-type": f"multipart/form-data; boundary={_BOUNDARY}"},
                    timeout=30,
                )
            )
        except httpx.TransportError as exc:
            outcome.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(1.0)  # the first half is in the gateway, which waits for the rest
    _kill_and_restart(gateway)
    rest_may_go.set()
    sender.join(timeout=30)

    assert len(outcome) == 1 and isinstance(outcome[0], httpx.TransportError), outcome
    assert not _assert_whole_or_absent(gateway, voices, "half-received", 3.0)


def test_crash_while_an_upload_is_stored_leaves_a_whole_voice_or_none(gateway: GatewayProcess, voices: Path) -> None:
    # A long stereo 48 kHz recording takes a while to decode, resample and store; the kill
    # lands at staggered moments after the request is on the wire, from "not yet parsed"
    # to "long committed".
    seconds = 25.0
    body = _multipart("crash-test", "whole or nothing", _recording(seconds, rate=48_000, channels=2))
    head = (
        f"POST /v1/audio/voices HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
        f"Content-Type: multipart/form-data; boundary={_BOUNDARY}\r\nConnection: close\r\n\r\n"
    ).encode()
    survived = []
    for delay in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 3.0):
        with socket.create_connection(("127.0.0.1", gateway.port)) as connection:
            connection.sendall(head + body)
            time.sleep(delay)
            _kill_and_restart(gateway)
        survived.append(_assert_whole_or_absent(gateway, voices, "crash-test", seconds))
        _delete_all(gateway)
    # The extremes are certain: killed at once the upload is lost, after 3 s it is stored.
    assert survived[0] is False and survived[-1] is True, survived


def test_deletion_is_immediate_and_survives_a_crash(gateway: GatewayProcess, voices: Path) -> None:
    created = httpx.post(
        f"{gateway.url}/v1/audio/voices",
        data={"name": "short-lived", "transcript": "Here today."},
        files={"audio_sample": ("a.wav", _recording(2.0), "audio/wav")},
    )
    assert created.status_code == 201, created.text
    speech = {"model": "piper", "voice": "short-lived", "input": "Hello.", "response_format": "pcm"}
    # Piper cannot clone: while the voice exists, the answer says so.
    before = httpx.post(f"{gateway.url}/v1/audio/speech", json=speech)
    assert before.json()["error"]["code"] == "unsupported_voice"

    deleted = httpx.delete(f"{gateway.url}/v1/audio/voices/short-lived")
    assert deleted.status_code == 200

    assert "short-lived" not in _listed(gateway)
    after = httpx.post(f"{gateway.url}/v1/audio/speech", json=speech)
    assert after.status_code == 400 and after.json()["error"]["code"] == "voice_not_found"
    assert httpx.delete(f"{gateway.url}/v1/audio/voices/short-lived").status_code == 404
    assert _files(voices) == []

    _kill_and_restart(gateway)
    assert "short-lived" not in _listed(gateway)
    again = httpx.post(
        f"{gateway.url}/v1/audio/voices",
        data={"name": "short-lived"},
        files={"audio_sample": ("a.wav", _recording(2.0), "audio/wav")},
    )
    assert again.status_code == 201, again.text
    _delete_all(gateway)
