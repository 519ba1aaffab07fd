"""``speed`` as OpenAI means it, through the real gateway and Triton on the CPU default (Piper).

The duration at ``speed`` is the one at 1.0 divided by ``speed``, pauses between sentences
included, and the response starts no later than at 1.0; streamed (``piper_stream``, the
default) and whole (``TTS_BACKEND_MODE=offline``, the ``piper`` model).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

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
# Piper's durations are drawn with noise: two runs at one speed differ by a few percent, and the
# onset of speech by up to 30 ms (40 to 73 ms for this text, at every speed). Each figure is the
# median of a few runs, which is steady enough for these margins and still far from what a
# stretched leading silence adds (twice the onset at half the speed).
DRAWS = 3
TOLERANCE = 0.10
# Amplitude below which a sample counts as silence.
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


class Timing(NamedTuple):
    """Median duration and onset of ``DRAWS`` runs of one request."""

    duration: float
    onset: float


def timing(url: str, speed: float) -> Timing:
    runs = [speak(url, TWO_SENTENCES, speed) for _ in range(DRAWS)]
    return Timing(
        float(np.median([audio.duration for audio in runs])), float(np.median([leading_silence(a) for a in runs]))
    )


@pytest.fixture(scope="module")
def natural(speech_url: str) -> Timing:
    return timing(speech_url, 1.0)


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_duration_is_the_natural_one_over_speed(speech_url: str, natural: Timing, speed: float) -> None:
    changed = timing(speech_url, speed)
    ratio = changed.duration / natural.duration
    assert abs(ratio * speed - 1) <= TOLERANCE, f"speed {speed}: {ratio:.3f} times the natural duration"
    assert changed.onset <= natural.onset + ONSET_MARGIN_S, f"speed {speed}: speech starts at {changed.onset:.3f} s"


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_the_words_are_heard_at_another_speed(speech_url: str, speed: float) -> None:
    audio = speak(speech_url, TWO_SENTENCES.split(". ")[0] + ".", speed)
    assert which_was_said(audio, [SPOKEN, "the weather was awful today so we stayed at home by the fire"]) == SPOKEN
