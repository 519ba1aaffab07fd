"""ElevenLabs' REST requests in the gateway's terms: model ids, the speech request the speech service plans,
what is accepted and ignored, and the listings' shapes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import cast

import pytest
from pydantic import ValidationError

from tts_gateway.gateway.api.elevenlabs_api import (
    ElevenLabsModel,
    ElevenLabsVoice,
    TextToSpeechBody,
    TextToSpeechQuery,
    gateway_model,
)
from tts_gateway.gateway.api.elevenlabs_speech import ElevenLabsAudio
from tts_gateway.gateway.speech.service import SpeechStream
from tts_gateway.gateway.speech.text_stream.output_format import OutputFormat
from tts_gateway.gateway.speech.voice_registry import VoiceInfo
from tts_gateway.gateway.triton.model_catalog import SpeechModel


@pytest.mark.parametrize(
    ("model_id", "model"),
    [(None, "tts-1"), ("", "tts-1"), ("eleven_flash_v2_5", "tts-1"), ("eleven_v3", "tts-1"), ("piper", "piper")],
)
def test_elevenlabs_model_ids_mean_the_default_model(model_id: str | None, model: str) -> None:
    assert gateway_model(model_id) == model


def test_a_request_becomes_a_pcm_speech_request_with_its_settings() -> None:
    body = TextToSpeechBody.model_validate(
        {
            "text": "Hello\x07 there.",
            "model_id": "eleven_multilingual_v2",
            "voice_settings": {"speed": 1.2, "stability": 0.5, "use_speaker_boost": True},
            "seed": 42,
            "apply_text_normalization": "off",
            "language_code": "en",
            "previous_text": "Before.",
            "next_text": "After.",
            "pronunciation_dictionary_locators": [],
        }
    )
    request = body.speech_request("joe")
    assert (request.model, request.voice_id, request.response_format) == ("tts-1", "joe", "pcm")
    assert (request.speed, request.seed, request.text_normalization) == (1.2, 42, False)
    assert request.input == "Hello  there."  # control characters have no spoken form


@pytest.mark.parametrize(("setting", "normalize"), [("auto", None), ("on", True), ("off", False)])
def test_text_normalization_follows_the_server_unless_set(setting: str, normalize: bool | None) -> None:
    body = TextToSpeechBody.model_validate({"text": "5 kg", "apply_text_normalization": setting})
    request = body.speech_request("joe")
    assert request.text_normalization is normalize and request.speed == 1.0 and request.seed is None


@pytest.mark.parametrize(
    "body",
    [
        {"text": "   "},
        {"text": ""},
        {"text": "x" * 4097},
        {"text": "hi", "voice_settings": {"speed": 9}},
        {"text": "hi", "seed": -1},
        {"text": "hi", "apply_text_normalization": "sometimes"},
        {"model_id": "eleven_v3"},
    ],
)
def test_bad_bodies_are_refused(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        TextToSpeechBody.model_validate(body)


def test_query_defaults_to_elevenlabs_mp3_and_refuses_bad_latency() -> None:
    assert TextToSpeechQuery().output_format == "mp3_44100_128"
    with pytest.raises(ValidationError):
        TextToSpeechQuery.model_validate({"optimize_streaming_latency": 5})


def test_voices_and_models_in_elevenlabs_shape() -> None:
    shipped = VoiceInfo(id="lumen", name="lumen", type="reference", models=["cosyvoice2"], transcript="Hi.")
    uploaded = VoiceInfo(id="grandpa", name="grandpa", type="uploaded", models=["cosyvoice2"], created_at=7)
    assert ElevenLabsVoice.of(shipped).category == "premade"
    voice = ElevenLabsVoice.of(uploaded)
    assert (voice.voice_id, voice.category, voice.high_quality_base_model_ids) == ("grandpa", "cloned", ["cosyvoice2"])
    assert voice.created_at_unix == 7
    model = SpeechModel(
        id="piper",
        description="Piper",
        sample_rate=22050,
        supports_cloning=False,
        speed_variants=frozenset(),
        builtin_voices=("joe",),
        languages=("en",),
        inputs=frozenset(),
        offline_model="piper",
        stream_model=None,
    )
    card = ElevenLabsModel.of(model).model_dump()
    assert card["model_id"] == "piper" and card["can_do_text_to_speech"] is True
    assert card["languages"] == [{"language_id": "en", "name": "en"}]


class EndlessSpeech:
    """A speech stream whose 16-bit PCM keeps coming until it is closed."""

    closed = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        return b"\x00\x00" * 4800

    async def aclose(self) -> None:
        self.closed = True


async def test_a_response_left_early_lets_go_of_its_encoder() -> None:
    fmt = OutputFormat.parse("mp3_44100_128")
    converter = fmt.converter()
    speech = EndlessSpeech()
    response = ElevenLabsAudio(fmt, converter, cast(SpeechStream, speech), "text", "text")
    audio = response.audio()
    assert await anext(aiter(audio))
    await response.aclose()  # the client left
    assert speech.closed
    # The mp3 encoder is closed with the response, not left to Python's next full collection.
    with pytest.raises(RuntimeError, match="finished"):
        converter.convert(b"\x00\x00" * 4800)
