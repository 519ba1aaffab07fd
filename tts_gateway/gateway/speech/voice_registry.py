"""Voices: built into a model, shipped in ``ref_audios/``, or uploaded over the API.

A reference voice is a recording plus its transcript; CosyVoice2 clones it. The
recording is decoded, validated and normalised (mono, 16 kHz) once, when the voice
is loaded or uploaded, and kept in memory; the model caches what it derives from
it (speech tokens, speaker embedding) by the recording's hash.

Uploaded voices are stored as ``NAME.wav`` + ``NAME.json`` in the voices directory.
Each file is written to a temporary name, fsynced and renamed into place; the JSON
file is written last and is the commit marker, so a crash mid-upload leaves no
half voice (a stray ``.wav`` without its ``.json`` is ignored and cleaned up).

Several gateway processes (``serve --workers N``) share one voices directory, so the
directory, not any process's memory, holds the truth:

- A change (upload, delete) holds an exclusive ``flock`` on ``.lock`` in the directory
  from its first temporary file to its commit. Under it the process rereads the
  directory, checks the name, commits, and then replaces ``.generation`` with a new
  random token. Names are therefore unique across processes, and no process ever sees
  another's upload in flight.
- Every read (``get``, ``resolve``, ``describe``, ``reference_voices``) compares the
  token with the one its view of the voices was built from, and rescans the directory
  when they differ. The token is random rather than a counter, so it cannot come back
  to a value a reader last saw, even if the file is deleted or restored; a missing
  file (a new directory, or one an older version wrote) reads as an empty token.

Files changed by hand, without the lock, are seen at the next change made over the API
or at the next start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, Field

from tts_gateway import file_lock
from tts_gateway.gateway.errors import ConflictError, ForbiddenError, InvalidRequestError, NotFoundError
from tts_gateway.gateway.speech.reference_audio import ReferenceAudio, ReferenceAudioError, load_reference_audio
from tts_gateway.gateway.speech.request import clean_text
from tts_gateway.gateway.triton.model_catalog import ModelCatalog, SpeechModel

logger = logging.getLogger(__name__)

VOICE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
MAX_TRANSCRIPT_CHARS = 1000
LOCK_FILE: Final = ".lock"
GENERATION_FILE: Final = ".generation"
# Rescans a reader repeats while writers keep changing the directory under it.
_RESCANS: Final = 3
# A file's identity on disk: inode, size, modification time.
_FileIdentity = tuple[int, int, int]


class VoiceInfo(BaseModel):
    """A voice as the voice listings (OpenAI's and ElevenLabs') describe it."""

    id: str
    name: str
    type: Literal["builtin", "reference", "uploaded"]
    models: list[str] = Field(description="models that can speak with this voice")
    transcript: str | None = None
    duration: float | None = None
    created_at: int | None = None


@dataclass(frozen=True)
class ReferenceVoice:
    id: str
    kind: Literal["reference", "uploaded"]
    audio: ReferenceAudio
    transcript: str | None
    created_at: int


@dataclass(frozen=True)
class ResolvedVoice:
    """The voice a request will use: a model's own voice, or a reference to clone."""

    id: str
    reference: ReferenceVoice | None = None


@dataclass(frozen=True)
class _Upload:
    """One ``NAME.json`` as last read: the files' contents/identity, and its voice (None: broken)."""

    metadata: bytes
    audio_file: _FileIdentity | None
    voice: ReferenceVoice | None


@dataclass(frozen=True)
class _View:
    """One consistent picture of the voices, replaced whole, so no thread ever sees half of one."""

    generation: bytes | None  # the token it was read at; None: never read
    uploads: Mapping[str, _Upload]
    voices: Mapping[str, ReferenceVoice]


def check_voice_id(name: str) -> str:
    """``name`` if it is a valid voice id: ASCII only, so it is a safe file name everywhere."""
    if not VOICE_ID_PATTERN.fullmatch(name):
        raise InvalidRequestError(
            "voice name must be 1-64 characters of letters, digits, '_' or '-', starting with a letter or digit",
            param="name",
            code="invalid_voice_name",
        )
    return name


def _read_generation(path: str) -> bytes:
    """The directory's change token, read on every request.

    Measured on ext4: os.open + os.read + os.close costs ~4.4 us, a bare os.stat ~2.1 us. The
    read is exact; (inode, size, mtime) is not: inodes are reused and mtime has the kernel's
    coarse clock tick, so two changes in one tick can leave all three as they were.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return b""
    try:
        return os.read(fd, 64)
    finally:
        os.close(fd)


def _identity(path: Path) -> _FileIdentity | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _write_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data``: readers see the old file or the new one, never part of one.

    ``durable`` also makes it survive a power loss (fsync of the file and of the directory).
    """
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with tmp.open("wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class VoiceRegistry:
    def __init__(
        self,
        ref_audios_dir: Path,
        voices_dir: Path,
        *,
        min_seconds: float,
        max_seconds: float,
        aliases: Mapping[str, str],
    ) -> None:
        self._ref_audios_dir = ref_audios_dir
        self._voices_dir = voices_dir
        self._generation_file = os.fspath(voices_dir / GENERATION_FILE)
        self._min_seconds = min_seconds
        self._max_seconds = max_seconds
        self._aliases = dict(aliases)
        self._shipped: dict[str, ReferenceVoice] = {}
        self._view = _View(None, {}, {})
        # Orders this process's changes without tying up a thread per waiter on the file lock.
        self._write_lock = asyncio.Lock()

    # -- loading ---------------------------------------------------------------------------------

    def load(self) -> None:
        """Load shipped and uploaded voices; a broken voice file is logged and skipped. Blocks."""
        self._shipped = self._load_shipped()
        with self._exclusive():
            self._remove_leftovers()
            # A new token also publishes an upload whose writer died between its commit and its
            # token: that writer's process restarts through here.
            self._view = self._scan(self._new_generation())
        logger.info("loaded %d reference voices", len(self._view.voices))

    def _load_shipped(self) -> dict[str, ReferenceVoice]:
        shipped: dict[str, ReferenceVoice] = {}
        for wav in sorted(self._ref_audios_dir.glob("*.wav")):
            if not VOICE_ID_PATTERN.fullmatch(wav.stem):
                logger.warning("skipping voice %s: invalid name", wav)
                continue
            transcript_file = wav.with_suffix(".txt")
            try:
                text = transcript_file.read_text(encoding="utf-8") if transcript_file.exists() else ""
                transcript = clean_text(text).strip()
                audio = self._decode(wav)
                created_at = int(wav.stat().st_mtime)
            except (OSError, ValueError) as exc:
                logger.warning("skipping voice %s: %s", wav, exc)
                continue
            shipped[wav.stem] = ReferenceVoice(wav.stem, "reference", audio, transcript or None, created_at)
        return shipped

    def _decode(self, wav: Path) -> ReferenceAudio:
        return load_reference_audio(wav.read_bytes(), min_seconds=self._min_seconds, max_seconds=self._max_seconds)

    def _remove_leftovers(self) -> None:
        """Delete what writers that died mid-upload left: audio without its commit marker, temporary files.

        Only under the lock: every writer holds it from its first temporary file to its commit,
        so nothing found now is in flight. Without the lock, a worker starting up would delete
        the half-written upload of a worker already serving; sparing young files instead would
        rest on a guess of how slow a disk can be.
        """
        for stray in self._voices_dir.glob("*.wav"):
            if not stray.with_suffix(".json").exists():
                logger.warning("removing %s: upload never completed", stray)
                stray.unlink(missing_ok=True)
        for leftover in self._voices_dir.glob(".*.tmp"):
            leftover.unlink(missing_ok=True)

    # -- the shared directory --------------------------------------------------------------------

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the voices directory's lock: one change at a time in all processes and threads that share it.
        Blocks: never call it on the event loop."""
        self._voices_dir.mkdir(parents=True, exist_ok=True)
        with file_lock.exclusive(self._voices_dir / LOCK_FILE):
            yield

    def _new_generation(self) -> bytes:
        """Tell every process sharing the directory that it changed; under the lock only.

        Not fsynced: the token only has to outlive the processes that read it, and after a
        power loss every one of them starts afresh.
        """
        token = uuid.uuid4().hex.encode("ascii")
        _write_atomic(self._voices_dir / GENERATION_FILE, token, durable=False)
        return token

    def _current(self) -> Mapping[str, ReferenceVoice]:
        """The voices as of now: one small file read, and a rescan if any process changed them.

        Runs on the event loop for every request. The rescan after a change runs right here,
        synchronously, because ``resolve`` is synchronous: it happens once per change in each
        process, and decodes only new or replaced recordings (milliseconds each).
        """
        view = self._view
        generation = _read_generation(self._generation_file)
        if generation != view.generation:
            view = self._sync(generation)
        return view.voices

    def _sync(self, generation: bytes) -> _View:
        """Rescan without the lock, so readers never wait for writers.

        A writer changes one voice at a time and commits before it replaces the token, so
        each voice a scan finds is whole, from before or after that change. If the token moved
        during the scan, the scan may straddle two changes and is repeated; if it keeps moving,
        the last scan is kept with the token it started from, and the next read scans again.
        """
        view = self._scan(generation)
        for _ in range(_RESCANS):
            now = _read_generation(self._generation_file)
            if now == view.generation:
                break
            view = self._scan(now)
        self._view = view
        return view

    def _reread(self) -> _View:
        """The directory as it is now, for a change about to be made; under the lock only."""
        self._view = self._scan(_read_generation(self._generation_file))
        return self._view

    def _scan(self, generation: bytes | None) -> _View:
        """Read the uploaded voices, reusing those whose files did not change since the last scan."""
        previous = self._view.uploads
        uploads: dict[str, _Upload] = {}
        for meta_file in sorted(self._voices_dir.glob("*.json")):
            upload = self._read_upload(meta_file, previous.get(meta_file.stem))
            if upload is not None:
                uploads[meta_file.stem] = upload
        return self._view_of(generation, uploads)

    def _view_of(self, generation: bytes | None, uploads: Mapping[str, _Upload]) -> _View:
        voices = dict(self._shipped)
        voices.update((name, upload.voice) for name, upload in uploads.items() if upload.voice is not None)
        return _View(generation, uploads, voices)

    def _read_upload(self, meta_file: Path, previous: _Upload | None) -> _Upload | None:
        """The voice ``meta_file`` commits, without a voice if it is broken; None if it was just deleted.

        Each upload's metadata is unique (its ``revision``), so unchanged metadata and audio
        file mean an unchanged voice; a broken one is reported once, not at every rescan.
        """
        wav = meta_file.with_suffix(".wav")
        try:
            metadata = meta_file.read_bytes()
        except FileNotFoundError:
            return None  # deleted since the directory was listed
        except OSError:
            metadata = b""  # e.g. a directory: read again below, for the reason
        audio_file = _identity(wav)
        if previous is not None and (previous.metadata, previous.audio_file) == (metadata, audio_file):
            return previous
        try:
            voice = self._decode_upload(meta_file, metadata, wav)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, FileNotFoundError) and not meta_file.exists():
                return None  # deleted while it was read
            logger.warning("skipping voice %s: %s", meta_file, exc)
            return _Upload(metadata, audio_file, None)
        return _Upload(metadata, audio_file, voice)

    def _decode_upload(self, meta_file: Path, metadata: bytes, wav: Path) -> ReferenceVoice:
        name = meta_file.stem
        if not VOICE_ID_PATTERN.fullmatch(name) or name in self._shipped:
            raise ValueError("invalid name, or the name of a shipped voice")
        meta = json.loads(metadata or meta_file.read_bytes())
        if not isinstance(meta, dict):
            raise TypeError("not a JSON object")
        stored = meta.get("transcript") or ""
        if not isinstance(stored, str):
            raise TypeError("transcript is not a string")
        transcript, created_at = clean_text(stored), int(meta["created_at"])
        return ReferenceVoice(name, "uploaded", self._decode(wav), transcript or None, created_at)

    # -- queries ---------------------------------------------------------------------------------

    def get(self, voice_id: str) -> ReferenceVoice | None:
        return self._current().get(voice_id)

    def reference_voices(self) -> Iterable[ReferenceVoice]:
        return self._current().values()

    def resolve(self, name: str, model: SpeechModel, catalog: ModelCatalog) -> ResolvedVoice:
        """Pick the voice ``name`` means for ``model``, or explain why there is none.

        OpenAI voice names are soft aliases: they clone their shipped reference voice
        on models that can clone and fall back to the model's own default voice on
        models that cannot, so stock clients work with every model.
        """
        if name in model.builtin_voices:
            return ResolvedVoice(name)
        voices = self._current()
        reference = voices.get(name)
        if reference is not None:
            if not model.supports_cloning:
                raise InvalidRequestError(
                    f"model {model.id!r} cannot clone voices, so it cannot speak with reference voice {name!r};"
                    f" its voices: {', '.join(model.builtin_voices) or 'none'}",
                    param="voice",
                    code="unsupported_voice",
                )
            return ResolvedVoice(name, reference)
        if name in self._aliases:
            target = voices.get(self._aliases[name])
            if model.supports_cloning and target is not None:
                return ResolvedVoice(target.id, target)
            if model.default_voice is not None:
                return ResolvedVoice(model.default_voice)
        owners = [m.id for m in catalog.models.values() if name in m.builtin_voices]
        if owners:
            raise InvalidRequestError(f"voice {name!r} belongs to model {owners[0]!r}, not {model.id!r}", param="voice")
        raise InvalidRequestError(
            f"voice {name!r} does not exist; GET /v1/audio/voices lists the voices",
            param="voice",
            code="voice_not_found",
        )

    def describe(
        self, catalog: ModelCatalog, model: SpeechModel | None = None, *, everything: bool = False
    ) -> list[VoiceInfo]:
        """The voices some deployed model can speak, or only ``model``'s; ``everything`` adds the voices none can.

        Clients such as Open WebUI offer every listed voice, so one no model can speak (a reference
        voice where no deployed model clones) is left out unless asked for.
        """
        models = [model] if model is not None else list(catalog.models.values())
        infos: list[VoiceInfo] = []
        cloning_models = [m.id for m in models if m.supports_cloning]
        for speaker in models:
            infos.extend(VoiceInfo(id=v, name=v, type="builtin", models=[speaker.id]) for v in speaker.builtin_voices)
        if cloning_models or everything:
            infos.extend(
                VoiceInfo(
                    id=v.id,
                    name=v.id,
                    type=v.kind,
                    models=cloning_models,
                    transcript=v.transcript,
                    duration=round(v.audio.duration, 3),
                    created_at=v.created_at,
                )
                for v in sorted(self._current().values(), key=lambda v: v.id)
            )
        return infos

    # -- uploads ---------------------------------------------------------------------------------

    async def add_upload(
        self, name: str, data: bytes, transcript: str | None, reserved: Iterable[str] = ()
    ) -> ReferenceVoice:
        check_voice_id(name)
        if transcript is not None:
            try:
                transcript = clean_text(transcript).strip() or None
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param="transcript") from exc
        if transcript is not None and len(transcript) > MAX_TRANSCRIPT_CHARS:
            raise InvalidRequestError(
                f"transcript is longer than {MAX_TRANSCRIPT_CHARS} characters", param="transcript"
            )
        try:
            audio = await asyncio.to_thread(
                load_reference_audio, data, min_seconds=self._min_seconds, max_seconds=self._max_seconds
            )
        except ReferenceAudioError as exc:
            raise InvalidRequestError(str(exc), param="audio_sample", code="invalid_audio") from exc
        taken = (*reserved, *self._aliases)
        async with self._write_lock:
            return await asyncio.to_thread(self._commit_upload, name, audio, transcript, taken)

    def _commit_upload(
        self, name: str, audio: ReferenceAudio, transcript: str | None, taken: tuple[str, ...]
    ) -> ReferenceVoice:
        with self._exclusive():
            view = self._reread()
            # Case-insensitively: NAME.wav must not collide on case-insensitive file systems.
            if name.casefold() in {n.casefold() for n in (*view.voices, *taken)}:
                raise ConflictError(f"a voice named {name!r} already exists", param="name", code="voice_exists")
            voice = ReferenceVoice(name, "uploaded", audio, transcript, int(time.time()))
            # The revision makes every upload's metadata unique: other processes tell a voice
            # deleted and uploaded again under its name from the one they hold.
            meta = {
                "name": name,
                "transcript": transcript,
                "created_at": voice.created_at,
                "revision": uuid.uuid4().hex,
            }
            metadata = json.dumps(meta, ensure_ascii=False).encode("utf-8")
            audio_file = self._persist(voice, metadata)
            uploads = {**view.uploads, name: _Upload(metadata, audio_file, voice)}
            self._view = self._view_of(self._new_generation(), uploads)
        return voice

    def _persist(self, voice: ReferenceVoice, meta: bytes) -> _FileIdentity | None:
        wav = self._voices_dir / f"{voice.id}.wav"
        _write_atomic(wav, voice.audio.to_wav_bytes())
        try:
            _write_atomic(self._voices_dir / f"{voice.id}.json", meta)
        except BaseException:
            # E.g. the disk filled up: leave nothing behind for the failed upload.
            wav.unlink(missing_ok=True)
            raise
        return _identity(wav)

    async def delete(self, voice_id: str, builtin: Iterable[str] = ()) -> None:
        """Delete an uploaded voice; ``builtin``: the deployed models' own voices, which cannot be deleted."""
        if voice_id in builtin:
            raise ForbiddenError(
                f"voice {voice_id!r} is built into a model and cannot be deleted",
                param="voice_id",
                code="voice_read_only",
            )
        async with self._write_lock:
            await asyncio.to_thread(self._commit_delete, voice_id)

    def _commit_delete(self, voice_id: str) -> None:
        with self._exclusive():
            view = self._reread()
            voice = view.voices.get(voice_id)
            if voice is None:
                raise NotFoundError(f"voice {voice_id!r} does not exist", param="voice_id", code="voice_not_found")
            if voice.kind != "uploaded":
                raise ForbiddenError(
                    f"voice {voice_id!r} ships with the server and cannot be deleted over the API",
                    param="voice_id",
                    code="voice_read_only",
                )
            self._remove_files(voice_id)
            uploads = {name: upload for name, upload in view.uploads.items() if name != voice_id}
            self._view = self._view_of(self._new_generation(), uploads)

    def _remove_files(self, voice_id: str) -> None:
        (self._voices_dir / f"{voice_id}.json").unlink(missing_ok=True)
        (self._voices_dir / f"{voice_id}.wav").unlink(missing_ok=True)
        _fsync_dir(self._voices_dir)
