"""Voice resolution rules and the on-disk life of uploaded voices."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from app.errors import ConflictError, InvalidRequestError, NotFoundError
from app.model_catalog import ModelCatalog, SpeechModel
from app.voice_registry import VoiceRegistry

REF_AUDIOS = Path(__file__).resolve().parents[2] / "ref_audios"


def _model(name: str, *, cloning: bool, voices: tuple[str, ...] = ()) -> SpeechModel:
    return SpeechModel(
        id=name,
        description="",
        sample_rate=24_000,
        supports_cloning=cloning,
        speed_variants=frozenset({name}),
        builtin_voices=voices,
        languages=("en",),
        inputs=frozenset({"target_text"}),
        offline_model=name,
        stream_model=None,
    )


PIPER = _model("piper", cloning=False, voices=("joe",))
COSY = _model("cosyvoice2", cloning=True)
CATALOG = ModelCatalog([PIPER, COSY])


def _wav(seconds: float = 2.0, rate: int = 22_050) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buffer = io.BytesIO()
    sf.write(buffer, 0.3 * np.sin(2 * np.pi * 200 * t), rate, format="WAV")
    return buffer.getvalue()


@pytest.fixture()
def registry(tmp_path: Path) -> VoiceRegistry:
    reg = VoiceRegistry(REF_AUDIOS, tmp_path / "voices", min_seconds=1.0, max_seconds=30.0, aliases={"alloy": "lumen"})
    reg.load()
    return reg


def test_shipped_voices_load_with_transcripts(registry: VoiceRegistry) -> None:
    lumen = registry.get("lumen")
    assert lumen is not None and lumen.kind == "reference"
    assert lumen.transcript and lumen.transcript.startswith("The morning light")
    assert lumen.audio.sample_rate == 16_000


def test_resolution_rules(registry: VoiceRegistry) -> None:
    assert registry.resolve("joe", PIPER, CATALOG).reference is None
    cloned = registry.resolve("lumen", COSY, CATALOG)
    assert cloned.reference is not None and cloned.id == "lumen"
    # OpenAI names clone their shipped voice where possible, else use the model's own voice.
    assert registry.resolve("alloy", COSY, CATALOG).id == "lumen"
    assert registry.resolve("alloy", PIPER, CATALOG).id == "joe"
    with pytest.raises(InvalidRequestError, match="cannot clone"):
        registry.resolve("lumen", PIPER, CATALOG)
    with pytest.raises(InvalidRequestError, match="belongs to model 'piper'"):
        registry.resolve("joe", COSY, CATALOG)
    with pytest.raises(InvalidRequestError, match="does not exist") as info:
        registry.resolve("nobody", COSY, CATALOG)
    assert info.value.param == "voice"


async def test_upload_is_persisted_and_reloaded(registry: VoiceRegistry, tmp_path: Path) -> None:
    voice = await registry.add_upload("mine", _wav(), " hello there ")
    assert voice.transcript == "hello there"
    assert sorted(p.name for p in (tmp_path / "voices").iterdir()) == ["mine.json", "mine.wav"]
    meta = json.loads((tmp_path / "voices" / "mine.json").read_text())
    assert meta["transcript"] == "hello there"

    reloaded = VoiceRegistry(REF_AUDIOS, tmp_path / "voices", min_seconds=1.0, max_seconds=30.0, aliases={})
    reloaded.load()
    again = reloaded.get("mine")
    assert again is not None and again.kind == "uploaded"
    # Stored as 16-bit PCM: the same recording to within quantisation.
    assert again.audio.samples.shape == voice.audio.samples.shape
    assert np.abs(again.audio.samples - voice.audio.samples).max() < 1e-3


async def test_upload_conflicts_and_bad_names(registry: VoiceRegistry) -> None:
    await registry.add_upload("taken", _wav(), None)
    with pytest.raises(ConflictError):
        await registry.add_upload("taken", _wav(), None)
    with pytest.raises(ConflictError):
        await registry.add_upload("joe", _wav(), None, reserved=["joe"])
    with pytest.raises(ConflictError):
        await registry.add_upload("TAKEN", _wav(), None)
    for bad in ("../x", "a/b", "", ".hidden", "x" * 65, "näme"):
        with pytest.raises(InvalidRequestError):
            await registry.add_upload(bad, _wav(), None)


async def test_delete_rules(registry: VoiceRegistry, tmp_path: Path) -> None:
    await registry.add_upload("gone", _wav(), None)
    await registry.delete("gone")
    assert registry.get("gone") is None
    assert list((tmp_path / "voices").iterdir()) == []
    with pytest.raises(NotFoundError):
        await registry.delete("gone")
    with pytest.raises(InvalidRequestError, match="cannot be deleted"):
        await registry.delete("lumen")


def test_half_written_upload_is_ignored_and_cleaned(tmp_path: Path) -> None:
    voices = tmp_path / "voices"
    voices.mkdir()
    (voices / "half.wav").write_bytes(_wav())  # crash after the audio, before the commit marker
    (voices / ".other.wav.123.tmp").write_bytes(b"partial")
    (voices / "broken.json").write_text("{not json")
    (voices / "listed.json").write_text("[1]")
    reg = VoiceRegistry(REF_AUDIOS, voices, min_seconds=1.0, max_seconds=30.0, aliases={})
    reg.load()
    assert reg.get("half") is None and reg.get("broken") is None
    assert sorted(p.name for p in voices.iterdir()) == ["broken.json", "listed.json"]
