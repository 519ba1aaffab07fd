"""ElevenLabs' REST text-to-speech API through the real gateway process, spoken by the embedded default
(Piper), called by ElevenLabs' own SDK (``elevenlabs``) as an application would."""

from __future__ import annotations

import base64
from collections.abc import Callable

import httpx
import pytest
from elevenlabs import VoiceSettings
from elevenlabs.client import ElevenLabs
from elevenlabs.core.api_error import ApiError
from elevenlabs.errors import UnprocessableEntityError
from openai import OpenAI

from tests.audio_checks import DecodedAudio, decode_elevenlabs
from tests.e2e.gateway_process import GatewayProcess
from tests.speech_recognition import transcribe

pytestmark = pytest.mark.triton

SHORT = "The quick brown fox jumps over the lazy dog."
TWO_SENTENCES = "It costs 5 dollars today. The shop opens at noon."


@pytest.fixture(scope="module")
def sdk(gateway: GatewayProcess) -> ElevenLabs:
    return ElevenLabs(base_url=gateway.url, api_key="unused")


def assert_spoken(audio: DecodedAudio, rate: int, expected_seconds: float) -> None:
    assert audio.sample_rate == rate
    assert audio.channels == 1
    assert expected_seconds * 0.8 <= audio.duration <= expected_seconds * 1.2 + 0.15, audio.duration
    assert audio.rms > 0.01, f"audio is (nearly) silent: rms {audio.rms:.4f}"


@pytest.mark.parametrize(
    ("output_format", "rate"),
    [
        ("mp3_44100_128", 44100),
        ("mp3_22050_32", 22050),
        ("pcm_16000", 16000),
        ("pcm_44100", 44100),
        ("ulaw_8000", 8000),
        ("alaw_8000", 8000),
        ("opus_48000_64", 48000),
        ("wav_22050", 22050),
    ],
)
def test_convert_speaks_in_the_format_asked_for(
    sdk: ElevenLabs, piper_seconds: Callable[..., float], output_format: str, rate: int
) -> None:
    data = b"".join(
        sdk.text_to_speech.convert("joe", text=SHORT, model_id="eleven_multilingual_v2", output_format=output_format)  # type: ignore[arg-type]
    )
    assert_spoken(decode_elevenlabs(data, output_format), rate, piper_seconds(SHORT))


def test_the_default_format_is_elevenlabs_mp3(sdk: ElevenLabs, gateway: GatewayProcess) -> None:
    response = httpx.post(f"{gateway.url}/v1/text-to-speech/joe", json={"text": SHORT}, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"] == "audio/mpeg"
    assert decode_elevenlabs(response.content, "mp3_44100_128").sample_rate == 44100


@pytest.mark.parametrize("output_format", ["mp3_22050_32", "pcm_24000"])
def test_stream_sends_audio_in_pieces(sdk: ElevenLabs, piper_seconds: Callable[..., float], output_format: str) -> None:
    text = f"{SHORT} {TWO_SENTENCES}"
    pieces = list(sdk.text_to_speech.stream("joe", text=text, output_format=output_format))  # type: ignore[arg-type]
    assert len(pieces) > 1
    audio = decode_elevenlabs(b"".join(pieces), output_format)
    # Normalisation reads "5" as "five", which Piper's own reference (given the raw text) may say differently.
    assert_spoken(audio, int(output_format.split("_")[1]), piper_seconds(text.replace("5", "five")))


def test_speed_and_seed_and_ignored_fields_are_accepted(sdk: ElevenLabs, piper_seconds: Callable[..., float]) -> None:
    data = b"".join(
        sdk.text_to_speech.convert(
            "joe",
            text=SHORT,
            output_format="pcm_24000",
            voice_settings=VoiceSettings(speed=1.5, stability=0.5, similarity_boost=0.75),
            seed=7,
            language_code="en",
            previous_text="Before.",
            next_text="After.",
            apply_text_normalization="off",
            optimize_streaming_latency=3,
            enable_logging=False,
        )
    )
    assert_spoken(decode_elevenlabs(data, "pcm_24000"), 24000, piper_seconds(SHORT, 1.5))


def test_convert_with_timestamps_aligns_every_character(sdk: ElevenLabs) -> None:
    result = sdk.text_to_speech.convert_with_timestamps("joe", text=TWO_SENTENCES, output_format="pcm_22050")
    audio = decode_elevenlabs(base64.b64decode(result.audio_base_64), "pcm_22050")
    assert audio.rms > 0.01
    assert result.alignment is not None and result.normalized_alignment is not None
    assert "".join(result.alignment.characters) == TWO_SENTENCES
    # The model reads the normalised text: the number as a word.
    assert (
        "".join(result.normalized_alignment.characters).strip()
        == "It costs five dollars today. The shop opens at noon."
    )
    for alignment in (result.alignment, result.normalized_alignment):
        starts, ends = alignment.character_start_times_seconds, alignment.character_end_times_seconds
        assert starts == sorted(starts)
        assert all(start <= end for start, end in zip(starts, ends, strict=True))
        assert ends[-1] == pytest.approx(audio.duration, abs=0.02)


def test_stream_with_timestamps_aligns_each_piece_in_order(sdk: ElevenLabs) -> None:
    text = f"{SHORT} {TWO_SENTENCES}"
    pieces = list(sdk.text_to_speech.stream_with_timestamps("joe", text=text, output_format="mp3_44100_64"))
    assert len(pieces) > 1
    audio = decode_elevenlabs(b"".join(base64.b64decode(p.audio_base_64) for p in pieces), "mp3_44100_64")
    assert audio.sample_rate == 44100 and audio.rms > 0.01
    chars = [c for p in pieces if p.alignment is not None for c in p.alignment.characters]
    starts = [s for p in pieces if p.alignment is not None for s in p.alignment.character_start_times_seconds]
    assert "".join(chars) == text
    assert starts == sorted(starts)
    # Times run from the start of the response, not of each piece.
    assert starts[-1] > audio.duration / 2


def test_asr_hears_what_was_asked_for(sdk: ElevenLabs) -> None:
    data = b"".join(sdk.text_to_speech.convert("joe", text=SHORT, output_format="pcm_16000"))
    heard = set(transcribe(decode_elevenlabs(data, "pcm_16000")).split())
    # Piper draws fresh noise for every synthesis, and at 16 kHz PocketSphinx has heard as few as 3 of
    # these (noise or silence gives none of them).
    assert len(heard & {"quick", "brown", "fox", "jumps", "lazy", "dog"}) >= 3, heard


def test_voices_are_listed_searched_and_looked_up(sdk: ElevenLabs) -> None:
    listed = sdk.voices.get_all()
    assert [v.voice_id for v in listed.voices] == ["joe"]
    assert listed.voices[0].category == "premade"
    page = sdk.voices.search(search="jo", page_size=5)
    assert [v.voice_id for v in page.voices] == ["joe"] and page.total_count == 1 and not page.has_more
    assert sdk.voices.search(search="nobody").voices == []
    assert sdk.voices.get("joe").name == "joe"
    with pytest.raises(ApiError) as missing:
        sdk.voices.get("nobody")
    assert missing.value.status_code == 404
    assert missing.value.body["detail"]["status"] == "voice_not_found"


def test_models_in_elevenlabs_shape_for_elevenlabs_clients_only(
    sdk: ElevenLabs, client: OpenAI, gateway: GatewayProcess
) -> None:
    models = sdk.models.list()
    assert [m.model_id for m in models] == ["piper"]
    assert models[0].can_do_text_to_speech
    # OpenAI's clients, which send their key as a bearer token, still get OpenAI's list.
    assert "tts-1" in {model.id for model in client.models.list()}
    both = httpx.get(f"{gateway.url}/v1/models", headers={"xi-api-key": "k", "Authorization": "Bearer k"}, timeout=10)
    assert both.json()["object"] == "list"


def test_errors_come_in_elevenlabs_envelope(sdk: ElevenLabs, gateway: GatewayProcess) -> None:
    with pytest.raises(ApiError) as bad_format:
        b"".join(sdk.text_to_speech.convert("joe", text=SHORT, output_format="mp3_8000_8"))  # type: ignore[arg-type]
    assert bad_format.value.status_code == 400
    assert bad_format.value.body["detail"]["status"] == "invalid_output_format"
    assert "mp3_44100_<32" in bad_format.value.body["detail"]["message"]
    for speak in (sdk.text_to_speech.convert, sdk.text_to_speech.stream):
        with pytest.raises(ApiError) as bad_voice:
            b"".join(speak("nobody", text=SHORT))
        assert bad_voice.value.status_code == 404
        assert bad_voice.value.body["detail"]["status"] == "voice_not_found"
        assert "nobody" in bad_voice.value.body["detail"]["message"]
    with pytest.raises(ApiError) as bad_voice:
        sdk.text_to_speech.convert_with_timestamps("nobody", text=SHORT)
    assert bad_voice.value.status_code == 404
    with pytest.raises(UnprocessableEntityError) as empty:
        sdk.text_to_speech.convert_with_timestamps("joe", text="   ")
    assert empty.value.body["detail"]["message"].startswith("text:")
    response = httpx.post(f"{gateway.url}/v1/text-to-speech/joe/stream", content=b"{", timeout=10)
    assert response.status_code == 422 and set(response.json()["detail"]) == {"status", "message"}
    json_header = {"content-type": "application/json"}
    not_utf8 = httpx.post(f"{gateway.url}/v1/text-to-speech/joe", content=b"\xff", headers=json_header, timeout=10)
    assert not_utf8.status_code == 400 and not_utf8.json()["detail"]["status"] == "invalid_request"


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("GET", "/v1/text-to-speech/joe", "POST"), ("DELETE", "/v1/voices/joe", "GET"), ("POST", "/v1/voices", "GET")],
)
def test_a_method_a_path_does_not_serve_is_405_in_elevenlabs_envelope(
    gateway: GatewayProcess, method: str, path: str, allow: str
) -> None:
    response = httpx.request(method, f"{gateway.url}{path}", timeout=10)
    assert response.status_code == 405 and response.headers["allow"] == allow
    assert response.json()["detail"]["status"] == "method_not_allowed"
