"""Text to espeak-ng phonemes for Piper voices, leaving nothing behind.

piper-tts phonemizes through its C extension ``piper.espeakbridge``. Its ``get_phonemes`` returns a
list of (phonemes, terminator, end of sentence) tuples and keeps a reference to every tuple, so
each clause it phonemizes stays in memory for good: two Python objects a clause, about a thousand a
minute in a busy Piper process, scattered through Python's memory pools so that the pages around
them cannot be given back either. :func:`install` puts :func:`clause_phonemes` in its place: the
same espeak-ng call (the extension links espeak-ng in and exports its API), made through ctypes,
with the result owned by Python alone. piper calls it under its own lock, as it calls the original;
espeak-ng keeps one state per process and is not safe to enter from two threads at once.

piper also sets the espeak-ng voice before every text it phonemizes, and espeak-ng's
``espeak_SetVoiceByName`` keeps about 1.3 KB each time it is called, even for the voice already
set: a process that speaks a few thousand sentences an hour grows by megabytes an hour.
:func:`install` also wraps ``set_voice`` so that espeak-ng is only called when the voice changes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from typing import Final, cast

from piper import espeakbridge

logger = logging.getLogger(__name__)

# espeak-ng's speak_lib.h: input encoding detected, phonemes written in IPA.
_CHARS_AUTO: Final = 0
_PHONEMES_IPA: Final = 0x02
# The clause code espeak-ng reports for the punctuation that ended a clause: pause (low bits),
# intonation (0x7000) and clause type (0xF0000); piper hands the voice the punctuation itself.
_CODE_MASK: Final = 0x000FFFFF
_SENTENCE: Final = 0x00080000
_CLAUSE: Final = 0x00040000
_TERMINATORS: Final = {
    40 | 0x0000 | _SENTENCE: ".",
    40 | 0x2000 | _SENTENCE: "?",
    45 | 0x3000 | _SENTENCE: "!",
    20 | 0x1000 | _CLAUSE: ",",
    30 | 0x0000 | _CLAUSE: ":",
    30 | 0x1000 | _CLAUSE: ";",
}

_TextToPhonemes = Callable[[object, int, int, object], bytes | None]


def clause_phonemes(text: str) -> list[tuple[str, str, bool]]:
    """``text`` as espeak-ng's clauses: (IPA phonemes, the punctuation that ended it or "", whether it
    ended a sentence). The contract of ``piper.espeakbridge.get_phonemes``; espeak-ng must be set up
    (piper does it before its first call)."""
    if "\0" in text:
        raise ValueError("text must not contain a null character")
    text_to_phonemes = _espeak_text_to_phonemes()
    if text_to_phonemes is None:
        raise RuntimeError("piper's espeakbridge exports no espeak_TextToPhonemesWithTerminator")
    source = ctypes.create_string_buffer(text.encode("utf-8"))
    # espeak-ng moves the cursor past each clause it reads and clears it after the last one.
    cursor = ctypes.c_void_p(ctypes.addressof(source))
    terminator = ctypes.c_int()
    clauses = []
    while cursor.value is not None:
        phonemes = text_to_phonemes(ctypes.byref(cursor), _CHARS_AUTO, _PHONEMES_IPA, ctypes.byref(terminator))
        if phonemes is None:  # espeak-ng could not read the text and left the cursor where it was
            raise RuntimeError("espeak-ng returned no phonemes")
        code = terminator.value & _CODE_MASK
        clauses.append((phonemes.decode("utf-8"), _TERMINATORS.get(code, ""), code & _SENTENCE == _SENTENCE))
    return clauses


class VoiceOnce:
    """``set_voice`` that calls espeak-ng only when the voice differs from the one it set last.

    Called, as piper calls the original, under piper's phonemizer lock: espeak-ng's voice is only
    ever changed through here once installed.
    """

    def __init__(self, set_voice: Callable[[str], object]) -> None:
        self.set_voice = set_voice
        self.current: str | None = None

    def __call__(self, voice: str) -> None:
        if voice != self.current:
            self.current = None  # unknown until espeak-ng has taken it: a failure sets it again next time
            self.set_voice(voice)
            self.current = voice


def install() -> bool:
    """Make piper phonemize through :func:`clause_phonemes` and set espeak-ng's voice only when it changes,
    in this process; ``False`` (piper left as it is) where its extension does not export espeak-ng's call."""
    if _espeak_text_to_phonemes() is None:
        logger.warning("piper's espeakbridge exports no espeak-ng call: its phonemizer keeps every clause it reads")
        return False
    espeakbridge.get_phonemes = clause_phonemes
    if not isinstance(espeakbridge.set_voice, VoiceOnce):
        espeakbridge.set_voice = VoiceOnce(espeakbridge.set_voice)
    return True


@functools.cache
def _espeak_text_to_phonemes() -> _TextToPhonemes | None:
    """``espeak_TextToPhonemesWithTerminator`` of the espeak-ng inside piper's extension: opening its
    file again yields the library already loaded, with the state piper set up."""
    try:
        function = ctypes.CDLL(espeakbridge.__file__).espeak_TextToPhonemesWithTerminator
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
    function.restype = ctypes.c_char_p
    return cast("_TextToPhonemes", function)
