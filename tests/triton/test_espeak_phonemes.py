"""Piper's phonemes through :mod:`tts_gateway.models.piper.espeak_phonemes`: what piper's bridge gives."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from piper import espeakbridge

from tts_gateway.models.piper import PiperEngine
from tts_gateway.models.piper.espeak_phonemes import VoiceOnce, clause_phonemes

TEXTS = (
    "",
    "Hello",
    "Wait: what? No! Yes; maybe, perhaps.",
    "He paid $3.50 on 12/03/2024 at 5pm, didn't he?",
    "Café naïve — «quoted» … and 日本語.",
    "Dr. Smith went to St. Paul's.\nThen home.\n\nThe end",
    "Why?! (a) [b] {c} \"d\" 'e'",
    "Hi... there " * 40,
)

# piper's own bridge, in a process where nothing replaced it.
_BRIDGE = textwrap.dedent(
    """
    import json
    import sys
    from pathlib import Path

    import piper
    from piper import espeakbridge

    espeakbridge.initialize(str(Path(piper.__file__).parent / "espeak-ng-data"))
    espeakbridge.set_voice("en-us")
    print(json.dumps([espeakbridge.get_phonemes(text) for text in json.loads(sys.stdin.read())]))
    """
)


@pytest.fixture(scope="module")
def engine() -> PiperEngine:
    engine = PiperEngine()
    assert list(engine.synthesize("Hello."))  # piper sets espeak-ng up for the voice on first use
    return engine


def test_clauses_are_the_bridges(engine: PiperEngine) -> None:
    bridge = subprocess.run(
        [sys.executable, "-c", _BRIDGE], input=json.dumps(TEXTS), capture_output=True, text=True, check=True
    )
    expected = [[tuple(clause) for clause in clauses] for clauses in json.loads(bridge.stdout)]
    assert [clause_phonemes(text) for text in TEXTS] == expected
    assert {clause[1] for clauses in expected for clause in clauses} >= {".", "?", "!", ",", ":", ";", ""}


def test_a_voice_phonemizes_through_it(engine: PiperEngine) -> None:
    assert espeakbridge.get_phonemes is clause_phonemes


def test_a_null_character_is_refused_as_by_the_bridge(engine: PiperEngine) -> None:
    with pytest.raises(ValueError, match="null character"):
        clause_phonemes("one\0two")


def test_the_voice_is_set_only_when_it_changes(engine: PiperEngine) -> None:
    assert isinstance(espeakbridge.set_voice, VoiceOnce)
    calls: list[str] = []
    set_voice = VoiceOnce(calls.append)
    for voice in ("en-us", "en-us", "de", "de", "en-us"):
        set_voice(voice)
    assert calls == ["en-us", "de", "en-us"]


def test_a_voice_espeak_refused_is_set_again_next_time() -> None:
    attempts: list[str] = []

    def refuse_once(voice: str) -> None:
        attempts.append(voice)
        if len(attempts) == 1:
            raise RuntimeError("espeak-ng could not load the voice")

    set_voice = VoiceOnce(refuse_once)
    with pytest.raises(RuntimeError):
        set_voice("xx")
    set_voice("xx")
    set_voice("xx")
    assert attempts == ["xx", "xx"]
