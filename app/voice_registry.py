"""Voices: built into a model, shipped in ``ref_audios/``, or uploaded over the API.

A reference voice is a recording plus its transcript; CosyVoice2 clones it. The
recording is decoded, validated and normalised (mono, 16 kHz) once, when the voice
is loaded or uploaded, and kept in memory; the backend caches what it derives from
it (speech tokens, speaker embedding) by the recording's hash.

Uploaded voices are stored as ``NAME.wav`` + ``NAME.json`` in the voices directory.
Each file is written to a temporary name, fsynced and renamed into place; the JSON
file is written last and is the commit marker, so a crash mid-upload leaves no
half voice (a stray ``.wav`` without its ``.json`` is ignored and cleaned up).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from app.errors import ConflictError, InvalidRequestError, NotFoundError
from app.model_catalog import ModelCatalog, SpeechModel
from app.protocol import VoiceInfo, clean_text
from app.reference_audio import ReferenceAudio, ReferenceAudioError, load_reference_audio

logger = logging.getLogger(__name__)

VOICE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
MAX_TRANSCRIPT_CHARS = 1000


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


def check_voice_id(name: str) -> str:
    """``name`` if it is a valid voice id: ASCII only, so it is a safe file name everywhere."""
    if not VOICE_ID_PATTERN.fullmatch(name):
        raise InvalidRequestError(
            "voice name must be 1-64 characters of letters, digits, '_' or '-', starting with a letter or digit",
            param="name",
            code="invalid_voice_name",
        )
    return name


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with tmp.open("wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
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
        self._min_seconds = min_seconds
        self._max_seconds = max_seconds
        self._aliases = dict(aliases)
        self._voices: dict[str, ReferenceVoice] = {}
        self._write_lock = asyncio.Lock()

    # -- loading ---------------------------------------------------------------------------------

    def load(self) -> None:
        """Load shipped and uploaded voices; a broken voice file is logged and skipped."""
        self._voices_dir.mkdir(parents=True, exist_ok=True)
        for wav in sorted(self._ref_audios_dir.glob("*.wav")):
            transcript_file = wav.with_suffix(".txt")
            try:
                text = transcript_file.read_text(encoding="utf-8") if transcript_file.exists() else ""
                transcript = clean_text(text).strip()
            except (OSError, ValueError) as exc:
                logger.warning("skipping voice %s: unreadable transcript (%s)", wav, exc)
                continue
            self._load_one(wav, "reference", transcript, int(wav.stat().st_mtime))
        for meta_file in sorted(self._voices_dir.glob("*.json")):
            try:
                meta = json.loads(meta_file.read_text(encoding="utf-8"))
                if not isinstance(meta, dict):
                    raise TypeError("not a JSON object")
                stored = meta.get("transcript") or ""
                if not isinstance(stored, str):
                    raise TypeError("transcript is not a string")
                transcript, created_at = clean_text(stored), int(meta["created_at"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("skipping voice metadata %s: %s", meta_file, exc)
                continue
            self._load_one(meta_file.with_suffix(".wav"), "uploaded", transcript, created_at)
        for stray in self._voices_dir.glob("*.wav"):
            if not stray.with_suffix(".json").exists():
                logger.warning("removing %s: upload never completed", stray)
                stray.unlink(missing_ok=True)
        for leftover in self._voices_dir.glob(".*.tmp"):
            leftover.unlink(missing_ok=True)
        logger.info("loaded %d reference voices", len(self._voices))

    def _load_one(
        self, wav: Path, kind: Literal["reference", "uploaded"], transcript: str | None, created_at: int
    ) -> None:
        voice_id = wav.stem
        if not VOICE_ID_PATTERN.fullmatch(voice_id) or voice_id in self._voices:
            logger.warning("skipping voice %s: invalid or duplicate name", wav)
            return
        try:
            audio = load_reference_audio(wav.read_bytes(), min_seconds=self._min_seconds, max_seconds=self._max_seconds)
        except (OSError, ReferenceAudioError) as exc:
            logger.warning("skipping voice %s: %s", wav, exc)
            return
        self._voices[voice_id] = ReferenceVoice(voice_id, kind, audio, transcript or None, created_at)

    # -- queries ---------------------------------------------------------------------------------

    def get(self, voice_id: str) -> ReferenceVoice | None:
        return self._voices.get(voice_id)

    def reference_voices(self) -> Iterable[ReferenceVoice]:
        return self._voices.values()

    def resolve(self, name: str, model: SpeechModel, catalog: ModelCatalog) -> ResolvedVoice:
        """Pick the voice ``name`` means for ``model``, or explain why there is none.

        OpenAI voice names are soft aliases: they clone their shipped reference voice
        on models that can clone and fall back to the model's own default voice on
        models that cannot, so stock clients work with every model.
        """
        if name in model.builtin_voices:
            return ResolvedVoice(name)
        reference = self._voices.get(name)
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
            target = self._voices.get(self._aliases[name])
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

    def describe(self, catalog: ModelCatalog) -> list[VoiceInfo]:
        infos: list[VoiceInfo] = []
        cloning_models = [m.id for m in catalog.models.values() if m.supports_cloning]
        for model in catalog.models.values():
            infos.extend(VoiceInfo(id=v, name=v, type="builtin", models=[model.id]) for v in model.builtin_voices)
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
            for v in sorted(self._voices.values(), key=lambda v: v.id)
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
        async with self._write_lock:
            # Case-insensitively: NAME.wav must not collide on case-insensitive file systems.
            taken = {n.casefold() for n in (*self._voices, *reserved, *self._aliases)}
            if name.casefold() in taken:
                raise ConflictError(f"a voice named {name!r} already exists", param="name", code="voice_exists")
            voice = ReferenceVoice(name, "uploaded", audio, transcript, int(time.time()))
            meta = {"name": name, "transcript": transcript, "created_at": voice.created_at}
            await asyncio.to_thread(self._persist, voice, json.dumps(meta, ensure_ascii=False).encode("utf-8"))
            self._voices[name] = voice
        return voice

    def _persist(self, voice: ReferenceVoice, meta: bytes) -> None:
        self._voices_dir.mkdir(parents=True, exist_ok=True)
        wav = self._voices_dir / f"{voice.id}.wav"
        _write_atomic(wav, voice.audio.to_wav_bytes())
        try:
            _write_atomic(self._voices_dir / f"{voice.id}.json", meta)
        except BaseException:
            # E.g. the disk filled up: leave nothing behind for the failed upload.
            wav.unlink(missing_ok=True)
            raise

    async def delete(self, voice_id: str) -> None:
        async with self._write_lock:
            voice = self._voices.get(voice_id)
            if voice is None:
                raise NotFoundError(f"voice {voice_id!r} does not exist", param="voice_id", code="voice_not_found")
            if voice.kind != "uploaded":
                raise InvalidRequestError(
                    f"voice {voice_id!r} ships with the server and cannot be deleted over the API",
                    param="voice_id",
                    code="voice_read_only",
                )
            await asyncio.to_thread(self._remove_files, voice_id)
            del self._voices[voice_id]

    def _remove_files(self, voice_id: str) -> None:
        (self._voices_dir / f"{voice_id}.json").unlink(missing_ok=True)
        (self._voices_dir / f"{voice_id}.wav").unlink(missing_ok=True)
        _fsync_dir(self._voices_dir)
