"""The gateway in front of the CosyVoice2 pipeline (tiny random weights, real code paths).

With random weights the audio is noise, so the checks are structural: 24 kHz, whole
40 ms tokens, reproducible under a seed, streamed in several pieces, tempo change on the
streaming path (where the gateway time-stretches), and cloning from uploaded voices.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import NotFoundError, OpenAI

from tests.audio_checks import DecodedAudio, decode
from tests.e2e.gateway_process import GatewayProcess
from tts_gateway.paths import REFERENCE_VOICES

pytestmark = [pytest.mark.triton, pytest.mark.cosyvoice]

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLES_PER_TOKEN = 960
TEXT = "The quick brown fox jumps over the lazy dog."
# How a stream's later chunks are cut depends on how many tokens arrived meanwhile (the orchestrator's
# catch-up), and the cuts shape the audio at the joins. Two text tokens of the tiny tokenizer give at
# most 40 speech tokens: a first chunk and a final one whatever the timing, so streams are bit-exact.
EXACT_TEXT = "Hello world"


@pytest.fixture(scope="module")
def cosy_client(cosy_gateway: GatewayProcess) -> OpenAI:
    return OpenAI(base_url=f"{cosy_gateway.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _pcm(client: OpenAI, voice: str = "alloy", seed: int = 7, text: str = TEXT, **extra: object) -> DecodedAudio:
    response = client.audio.speech.create(
        model="tts-1", voice=voice, input=text, response_format="pcm", extra_body={"seed": seed}, **extra
    )
    return decode(response.content, "pcm")


def test_cosyvoice2_is_the_default_model_and_clones(cosy_gateway: GatewayProcess) -> None:
    models = {m["id"]: m for m in httpx.get(f"{cosy_gateway.url}/v1/audio/models").json()["models"]}
    assert set(models) == {"cosyvoice2"}
    assert models["cosyvoice2"]["supports_cloning"] is True
    assert models["cosyvoice2"]["sample_rate"] == 24_000
    voices = {v["id"]: v for v in httpx.get(f"{cosy_gateway.url}/v1/audio/voices").json()["voices"]}
    assert voices["lumen"]["models"] == ["cosyvoice2"]


def test_speech_is_whole_tokens_and_reproducible(cosy_client: OpenAI) -> None:
    first = _pcm(cosy_client, seed=7, text=EXACT_TEXT)
    assert first.samples.size > 0 and first.samples.size % SAMPLES_PER_TOKEN == 0
    assert first.rms > 0.0
    assert np.array_equal(first.samples, _pcm(cosy_client, seed=7, text=EXACT_TEXT).samples)
    assert not np.array_equal(first.samples, _pcm(cosy_client, seed=8, text=EXACT_TEXT).samples)
    # Another voice is another prompt: other audio for the same seed.
    assert not np.array_equal(first.samples, _pcm(cosy_client, voice="harbor", seed=7, text=EXACT_TEXT).samples)
    # A longer text is cut where tokens arrived: the same seed gives the same tokens, so the same length.
    assert _pcm(cosy_client, seed=7).samples.size == _pcm(cosy_client, seed=7).samples.size


def test_streaming_arrives_in_pieces(cosy_client: OpenAI) -> None:
    pieces = []
    with cosy_client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="lumen", input=EXACT_TEXT, response_format="pcm", extra_body={"seed": 7}
    ) as response:
        pieces = list(response.iter_bytes())
    assert len(pieces) > 1
    whole = _pcm(cosy_client, voice="lumen", text=EXACT_TEXT)
    assert np.array_equal(decode(b"".join(pieces), "pcm").samples, whole.samples)


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_speed_scales_the_duration(cosy_client: OpenAI, speed: float) -> None:
    # The same seed gives the same speech tokens: only the tempo differs.
    normal = _pcm(cosy_client, seed=3)
    changed = _pcm(cosy_client, seed=3, speed=speed)
    assert abs(changed.duration * speed - normal.duration) <= 0.1 * normal.duration


def test_instructions_reach_the_model(cosy_client: OpenAI) -> None:
    plain = _pcm(cosy_client, seed=5)
    instructed = _pcm(cosy_client, seed=5, instructions="Speak slowly, with a warm and calm voice.")
    assert instructed.samples.size > 0 and instructed.samples.size % SAMPLES_PER_TOKEN == 0
    # Another LLM prompt under the same seed: other speech tokens, other audio.
    assert not np.array_equal(plain.samples, instructed.samples)


@pytest.mark.parametrize("transcript", ["Boats rocked gently in the harbor.", None])
def test_uploaded_voice_clones(cosy_gateway: GatewayProcess, cosy_client: OpenAI, transcript: str | None) -> None:
    name = "uploaded-with-text" if transcript else "uploaded-no-text"
    data = {"name": name} | ({"transcript": transcript} if transcript else {})
    files = {"audio_sample": ("harbor.wav", (REFERENCE_VOICES / "harbor.wav").read_bytes(), "audio/wav")}
    created = httpx.post(f"{cosy_gateway.url}/v1/audio/voices", data=data, files=files, timeout=60)
    assert created.status_code == 201, created.text
    audio = _pcm(cosy_client, voice=name)
    assert audio.samples.size > 0 and audio.samples.size % SAMPLES_PER_TOKEN == 0


def test_piper_is_not_deployed_here(cosy_client: OpenAI) -> None:
    with pytest.raises(NotFoundError):
        cosy_client.audio.speech.create(model="piper", voice="joe", input=TEXT)
