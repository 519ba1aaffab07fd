"""``speed`` as OpenAI means it, through the real gateway and Triton on the CPU default (Piper).

The duration at ``speed`` is the one at 1.0 divided by ``speed``, pauses between sentences
included, and the response starts no later than at 1.0; streamed (``piper_stream``, the
default) and whole (``TTS_BACKEND_MODE=offline``, the ``piper`` model).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.audio_checks import DecodedAudio, decode
from tests.e2e.gateway_process import GatewayProcess
from tests.speech_recognition import which_was_said
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = pytest.mark.triton

TWO_SENTENCES = (
    "The weather was lovely today, so we walked along the river to the park. "
    "Then we sat on a bench and watched the boats go by."
)
SPOKEN = "the weather was lovely today so we walked along the river to the park"
# Piper's durations are drawn with noise: two runs at one speed differ by a few percent.
TOLERANCE = 0.10
# Amplitude below which a sample counts as silence; one 24 kHz frame of margin for the onset.
SILENCE = 0.02
ONSET_MARGIN_S = 0.03


@pytest.fixture(scope="module", params=["stream", "offline"])
def speech_url(
    request: pytest.FixtureRequest,
    gateway: GatewayProcess,
    cpu_triton: EmbeddedTriton,
    voices_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    if request.param == "stream":
        yield f"{gateway.url}/v1/audio/speech"
        return
    log = tmp_path_factory.mktemp("gateway-offline") / "gateway.log"
    offline = GatewayProcess(
        log, {"TTS_TRITON_URL": cpu_triton.grpc_url, "TTS_VOICES_DIR": str(voices_dir), "TTS_BACKEND_MODE": "offline"}
    )
    offline.start()
    try:
        yield f"{offline.url}/v1/audio/speech"
    finally:
        offline.stop()


def speak(url: str, text: str, speed: float) -> DecodedAudio:
    body = {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm", "speed": speed}
    response = httpx.post(url, json=body, timeout=300)
    assert response.status_code == 200, response.text
    return decode(response.content, "pcm")


def leading_silence(audio: DecodedAudio) -> float:
    loud = np.flatnonzero(np.abs(audio.samples) > SILENCE)
    assert loud.size, "the audio is silent"
    return float(loud[0]) / audio.sample_rate


@pytest.fixture(scope="module")
def natural(speech_url: str) -> DecodedAudio:
    return speak(speech_url, TWO_SENTENCES, 1.0)


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_duration_is_the_natural_one_over_speed(speech_url: str, natural: DecodedAudio, speed: float) -> None:
    changed = speak(speech_url, TWO_SENTENCES, speed)
    ratio = changed.duration / natural.duration
    assert abs(ratio * speed - 1) <= TOLERANCE, f"speed {speed}: {ratio:.3f} times the natural duration"
    assert leading_silence(changed) <= leading_silence(natural) + ONSET_MARGIN_S


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_the_words_are_heard_at_another_speed(speech_url: str, speed: float) -> None:
    audio = speak(speech_url, TWO_SENTENCES.split(". ")[0] + ".", speed)
    assert which_was_said(audio, [SPOKEN, "the weather was awful today so we stayed at home by the fire"]) == SPOKEN
