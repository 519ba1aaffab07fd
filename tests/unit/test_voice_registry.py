"""Voice resolution rules and the on-disk life of uploaded voices."""

from __future__ import annotations

import asyncio
import fcntl
import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tts_gateway.gateway.errors import ConflictError, ForbiddenError, InvalidRequestError, NotFoundError
from tts_gateway.gateway.speech.voice_registry import GENERATION_FILE, LOCK_FILE, VoiceRegistry
from tts_gateway.gateway.triton.model_catalog import ModelCatalog, SpeechModel
from tts_gateway.paths import REFERENCE_VOICES

ROOT = Path(__file__).resolve().parents[2]
REF_AUDIOS = REFERENCE_VOICES


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


def _wav(seconds: float = 2.0, rate: int = 22_050, pitch: float = 200.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buffer = io.BytesIO()
    sf.write(buffer, 0.3 * np.sin(2 * np.pi * pitch * t), rate, format="WAV")
    return buffer.getvalue()


def _loaded(voices: Path, aliases: Mapping[str, str] | None = None) -> VoiceRegistry:
    registry = VoiceRegistry(REF_AUDIOS, voices, min_seconds=1.0, max_seconds=30.0, aliases=aliases or {})
    registry.load()
    return registry


def _files(directory: Path) -> list[str]:
    """The directory's entries, less the registry's own bookkeeping files."""
    return sorted(p.name for p in directory.iterdir() if p.name not in (LOCK_FILE, GENERATION_FILE))


@pytest.fixture()
def registry(tmp_path: Path) -> VoiceRegistry:
    return _loaded(tmp_path / "voices", {"alloy": "lumen"})


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
    assert _files(tmp_path / "voices") == ["mine.json", "mine.wav"]
    meta = json.loads((tmp_path / "voices" / "mine.json").read_text())
    assert meta["transcript"] == "hello there"

    reloaded = _loaded(tmp_path / "voices")
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
    assert _files(tmp_path / "voices") == []
    with pytest.raises(NotFoundError):
        await registry.delete("gone")
    with pytest.raises(ForbiddenError, match="ships with the server and cannot be deleted") as shipped:
        await registry.delete("lumen")
    assert shipped.value.status_code == 403 and shipped.value.code == "voice_read_only"
    with pytest.raises(ForbiddenError, match="built into a model and cannot be deleted") as builtin:
        await registry.delete("joe", CATALOG.builtin_voices)
    assert builtin.value.code == "voice_read_only"


def test_listing_offers_only_voices_some_model_can_speak(registry: VoiceRegistry) -> None:
    piper_only = ModelCatalog([PIPER])
    assert [(v.id, v.models) for v in registry.describe(piper_only)] == [("joe", ["piper"])]
    everything = {v.id: v.models for v in registry.describe(piper_only, everything=True)}
    assert everything == {"joe": ["piper"], "harbor": [], "lumen": []}
    both = {v.id: v.models for v in registry.describe(CATALOG)}
    assert both == {"joe": ["piper"], "harbor": ["cosyvoice2"], "lumen": ["cosyvoice2"]}
    assert {v.id for v in registry.describe(CATALOG, COSY)} == {"harbor", "lumen"}
    assert {v.id for v in registry.describe(CATALOG, PIPER)} == {"joe"}


def test_half_written_upload_is_ignored_and_cleaned(tmp_path: Path) -> None:
    voices = tmp_path / "voices"
    voices.mkdir()
    (voices / "half.wav").write_bytes(_wav())  # crash after the audio, before the commit marker
    (voices / ".other.wav.123.tmp").write_bytes(b"partial")
    (voices / "broken.json").write_text("{not json")
    (voices / "listed.json").write_text("[1]")
    reg = _loaded(voices)
    assert reg.get("half") is None and reg.get("broken") is None
    assert _files(voices) == ["broken.json", "listed.json"]


@pytest.mark.parametrize(
    "name",
    [
        "abc\n",  # "$" alone would accept a trailing newline
        "a\x00b",
        "..",
        "/etc/passwd",
        "a\\b",
        "a\u2215b",  # division slash, looks like "/"
        "ａｂｃ",  # fullwidth letters  # noqa: RUF001
        "x" * 65,
        " lead",
        "-dash-first",
    ],
)
async def test_hostile_voice_names_are_rejected_and_nothing_is_written(
    registry: VoiceRegistry, tmp_path: Path, name: str
) -> None:
    before = sorted(os.listdir(tmp_path / "voices"))
    with pytest.raises(InvalidRequestError) as info:
        await registry.add_upload(name, _wav(), None)

    assert info.value.param == "name"
    assert sorted(os.listdir(tmp_path / "voices")) == before
    assert os.listdir(tmp_path) == ["voices"]


async def test_transcript_control_characters_become_spaces(registry: VoiceRegistry, tmp_path: Path) -> None:
    voice = await registry.add_upload("ctrl", _wav(), "\x00Say\x00 it\x1b[0m\x0cnow\x7f")

    assert voice.transcript == "Say  it [0m now"
    assert json.loads((tmp_path / "voices" / "ctrl.json").read_text())["transcript"] == "Say  it [0m now"
    with pytest.raises(InvalidRequestError, match="lone surrogate") as info:
        await registry.add_upload("surrogate", _wav(), "bad \ud800 text")
    assert info.value.param == "transcript"


def test_stored_transcripts_are_cleaned_on_load(tmp_path: Path) -> None:
    voices = tmp_path / "voices"
    voices.mkdir()
    for name, transcript in (("old", "from\u0000 before"), ("odd", "\ud800")):
        (voices / f"{name}.wav").write_bytes(_wav())
        (voices / f"{name}.json").write_text(json.dumps({"transcript": transcript, "created_at": 1}))
    reg = _loaded(voices)

    old = reg.get("old")
    assert old is not None and old.transcript == "from  before"
    assert reg.get("odd") is None


async def test_concurrent_uploads_of_one_name_have_one_winner(registry: VoiceRegistry, tmp_path: Path) -> None:
    # Different lengths, so the stored recording shows whose it is.
    uploads = [registry.add_upload("race", _wav(1.5 + 0.1 * i), f"take {i}") for i in range(8)]
    results = await asyncio.gather(*uploads, return_exceptions=True)

    winners = [r for r in results if not isinstance(r, BaseException)]
    assert len(winners) == 1
    assert all(isinstance(r, ConflictError) for r in results if r is not winners[0])
    stored, rate = sf.read(tmp_path / "voices" / "race.wav")
    assert stored.size == winners[0].audio.samples.size and rate == 16_000
    assert json.loads((tmp_path / "voices" / "race.json").read_text())["transcript"] == winners[0].transcript


async def test_failed_commit_leaves_no_audio_behind(registry: VoiceRegistry, tmp_path: Path) -> None:
    (tmp_path / "voices" / "blocked.json").mkdir()  # the commit marker cannot be renamed over a directory

    with pytest.raises(OSError):
        await registry.add_upload("blocked", _wav(), None)

    assert registry.get("blocked") is None
    assert _files(tmp_path / "voices") == ["blocked.json"]


async def test_deletion_is_durable(registry: VoiceRegistry, tmp_path: Path) -> None:
    await registry.add_upload("brief", _wav(), "here for a moment")
    await registry.delete("brief")

    reloaded = _loaded(tmp_path / "voices")
    assert reloaded.get("brief") is None


# Runs one upload in a child process that SIGKILLs itself just before its Nth file-system
# step (fsync or rename): a real crash, so no ``finally`` or cleanup of the registry runs.
_CRASHING_UPLOAD = """
import asyncio, os, signal, sys
from pathlib import Path

from tts_gateway.gateway.speech.voice_registry import VoiceRegistry

voices, sample, crash_before = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
steps = 0

def crashing(step):
    def wrapper(*args):
        global steps
        steps += 1
        if steps == crash_before:
            os.kill(os.getpid(), signal.SIGKILL)
        return step(*args)
    return wrapper

os.fsync, os.replace = crashing(os.fsync), crashing(os.replace)
registry = VoiceRegistry(voices / "none", voices, min_seconds=1.0, max_seconds=30.0, aliases={})
asyncio.run(registry.add_upload("crashy", sample.read_bytes(), "survives whole or not at all"))
print(steps)
"""
# fsync+rename of the audio, fsync of the directory, the same for the JSON commit marker,
# then the rename of the new generation token (not fsynced: it need not survive a reboot).
_PERSIST_STEPS = 7


def _run_crashing_upload(tmp_path: Path, crash_before: int) -> subprocess.CompletedProcess[str]:
    sample = tmp_path / "sample.wav"
    sample.write_bytes(_wav(2.0))
    return subprocess.run(
        [sys.executable, "-c", _CRASHING_UPLOAD, str(tmp_path / "voices"), str(sample), str(crash_before)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )


def test_upload_without_a_crash_takes_the_expected_steps(tmp_path: Path) -> None:
    done = _run_crashing_upload(tmp_path, crash_before=0)

    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == _PERSIST_STEPS


@pytest.mark.parametrize("crash_before", range(1, _PERSIST_STEPS + 1))
def test_crash_at_any_step_leaves_a_whole_voice_or_none(tmp_path: Path, crash_before: int) -> None:
    crashed = _run_crashing_upload(tmp_path, crash_before)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr

    registry = _loaded(tmp_path / "voices")

    voice = registry.get("crashy")
    left = _files(tmp_path / "voices")
    # The JSON rename (step 5) commits the upload.
    if crash_before > 5:
        assert voice is not None and voice.transcript == "survives whole or not at all"
        assert voice.audio.duration == pytest.approx(2.0, abs=0.01)
        assert left == ["crashy.json", "crashy.wav"]
    else:
        assert voice is None
        assert left == []


# -- several processes sharing one voices directory ---------------------------------------------
# Two registries on one directory in one process share nothing but the files, as two worker
# processes do.


async def test_changes_through_one_registry_are_seen_by_another(tmp_path: Path) -> None:
    voices = tmp_path / "voices"
    writer, reader = _loaded(voices), _loaded(voices)
    assert reader.get("shared") is None

    await writer.add_upload("shared", _wav(2.0), "first take")
    first = reader.resolve("shared", COSY, CATALOG).reference
    assert first is not None and first.transcript == "first take"
    assert first.audio.duration == pytest.approx(2.0, abs=0.01)
    assert "shared" in {v.id for v in reader.describe(CATALOG)}
    with pytest.raises(ConflictError):
        await reader.add_upload("SHARED", _wav(), None)

    # Deleted and uploaded again, as long and with the same transcript, while the reader does
    # not look: name, sizes and (likely) inodes come back, the recording is another.
    await writer.delete("shared")
    await writer.add_upload("shared", _wav(2.0, pitch=300.0), "first take")
    second = reader.get("shared")
    assert second is not None and second.audio.samples.shape == first.audio.samples.shape
    assert np.abs(second.audio.samples - first.audio.samples).max() > 0.5

    await reader.delete("shared")
    assert writer.get("shared") is None
    assert "shared" not in {v.id for v in writer.describe(CATALOG)}
    with pytest.raises(InvalidRequestError, match="does not exist"):
        writer.resolve("shared", COSY, CATALOG)
    with pytest.raises(NotFoundError):
        await writer.delete("shared")
    assert _files(voices) == []


async def test_rescans_keep_unchanged_voices_and_report_a_broken_one_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    voices = tmp_path / "voices"
    writer, reader = _loaded(voices), _loaded(voices)
    await writer.add_upload("kept", _wav(), None)
    kept = reader.get("kept")
    assert kept is not None
    (voices / "broken.json").write_text("{not json")  # by hand: noticed at the next change

    with caplog.at_level(logging.WARNING, logger="tts_gateway.gateway.speech.voice_registry"):
        for name in ("one", "two", "three"):
            await writer.add_upload(name, _wav(), None)
            assert reader.get(name) is not None

    assert reader.get("kept") is kept  # not decoded again
    broken = [r for r in caplog.records if "broken.json" in r.getMessage()]
    assert len(broken) == 2  # once in each registry, not at every rescan
    assert reader.get("broken") is None


async def test_a_directory_without_a_generation_file_works(tmp_path: Path) -> None:
    voices = tmp_path / "voices"
    voices.mkdir()
    # As an older version stored it: no token, no revision in the metadata.
    (voices / "old.wav").write_bytes(_wav())
    (voices / "old.json").write_text(json.dumps({"name": "old", "transcript": "from before", "created_at": 1}))
    never_loaded = VoiceRegistry(REF_AUDIOS, voices, min_seconds=1.0, max_seconds=30.0, aliases={})
    old = never_loaded.get("old")
    assert old is not None and old.transcript == "from before"
    assert not (voices / GENERATION_FILE).exists()

    writer, reader = _loaded(voices), _loaded(voices)
    (voices / GENERATION_FILE).unlink()
    assert reader.get("old") is not None
    await writer.add_upload("new", _wav(), None)
    assert reader.get("new") is not None and never_loaded.get("new") is not None


def test_a_starting_registry_leaves_an_upload_in_flight_alone(tmp_path: Path) -> None:
    voices = tmp_path / "voices"
    voices.mkdir()
    # Another process's upload, between its audio and its commit marker, holding the lock.
    lock = os.open(voices / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    (voices / "inflight.wav").write_bytes(_wav())
    pending = voices / ".inflight.json.0123.tmp"
    pending.write_text(json.dumps({"name": "inflight", "transcript": "made it", "created_at": 1}))

    starting = VoiceRegistry(REF_AUDIOS, voices, min_seconds=1.0, max_seconds=30.0, aliases={})
    loader = threading.Thread(target=starting.load, daemon=True)
    try:
        loader.start()
        loader.join(timeout=1.0)
        assert loader.is_alive()  # waits for the lock rather than cleaning up under the writer
        assert _files(voices) == [pending.name, "inflight.wav"]
        os.replace(pending, voices / "inflight.json")
    finally:
        os.close(lock)  # releases the lock (also when an assertion failed: no thread left waiting)
    loader.join(timeout=30)
    assert not loader.is_alive()
    voice = starting.get("inflight")
    assert voice is not None and voice.transcript == "made it"
    assert _files(voices) == ["inflight.json", "inflight.wav"]


_RACING_UPLOAD = """
import asyncio, sys, time
from pathlib import Path

from tts_gateway.gateway.errors import ConflictError
from tts_gateway.gateway.speech.voice_registry import VoiceRegistry

voices, go, name, seconds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], float(sys.argv[4])
sample = Path(sys.argv[5]).read_bytes()
registry = VoiceRegistry(voices / "none", voices, min_seconds=1.0, max_seconds=30.0, aliases={})
registry.load()
print("ready", flush=True)
while not go.exists():
    time.sleep(0.001)
try:
    asyncio.run(registry.add_upload(name, sample, f"{seconds}"))
except ConflictError:
    print("conflict")
else:
    print("won")
"""


_RACERS = 6


def test_processes_racing_for_one_name_have_one_winner(tmp_path: Path) -> None:
    voices, go = tmp_path / "voices", tmp_path / "go"
    racers = []
    for i in range(_RACERS):
        # Each its own length, so the stored files show whose they are; half spell the name in capitals.
        seconds = 1.5 + 0.25 * i
        sample = tmp_path / f"take{i}.wav"
        sample.write_bytes(_wav(seconds))
        name = "race" if i % 2 else "RACE"
        args = [sys.executable, "-c", _RACING_UPLOAD, str(voices), str(go), name, str(seconds), str(sample)]
        racers.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))
    try:
        for racer in racers:
            assert racer.stdout is not None and racer.stdout.readline() == "ready\n"
        go.touch()
        outcomes = [racer.communicate(timeout=60) for racer in racers]
    finally:
        for racer in racers:
            racer.kill()
            racer.wait()

    assert all(racer.returncode == 0 for racer in racers), [err for _, err in outcomes]
    results = [out.strip() for out, _ in outcomes]
    assert sorted(results) == ["conflict"] * (_RACERS - 1) + ["won"], results
    winner = results.index("won")
    name, seconds = ("race" if winner % 2 else "RACE"), 1.5 + 0.25 * winner
    assert _files(voices) == [f"{name}.json", f"{name}.wav"]
    assert json.loads((voices / f"{name}.json").read_text())["transcript"] == f"{seconds}"
    assert sf.info(voices / f"{name}.wav").duration == pytest.approx(seconds, abs=0.01)
    stored = _loaded(voices).get(name)
    assert stored is not None and stored.audio.duration == pytest.approx(seconds, abs=0.01)
