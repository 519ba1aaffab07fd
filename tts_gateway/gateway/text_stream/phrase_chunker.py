"""When text that arrives piece by piece (an LLM's tokens) becomes a phrase worth synthesising.

A phrase is cut, as soon as the text allows:

- at the end of a sentence, once the character after it has arrived (so "3.5" and "Dr. Smith"
  stay whole: :func:`split_sentences` decides what ends a sentence);
- for the first phrase of a context, at a clause break (a comma, colon or dash before a space) once
  ``first_clause_chars`` characters are buffered: the listener hears something sooner;
- once the buffer holds the schedule's character count for this phrase (ElevenLabs'
  ``chunk_length_schedule``: the first entry for the first phrase, the second for the second, the
  last one for every later phrase), at the last space, so no word is cut.

``flush`` forces everything buffered out. In ``auto_mode`` the client sends whole phrases, so every
piece is a phrase at once and nothing is held back for the schedule.

Phrases are slices of the input, whitespace included, so that the phrases of a context joined
together are exactly the text it was sent: the alignment sent back with the audio covers every
character once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from tts_gateway.gateway.text_splitting import split_sentences

DEFAULT_SCHEDULE: Final = (120, 160, 250, 290)
# ElevenLabs' bounds for one entry of ``chunk_length_schedule``.
SCHEDULE_MIN: Final = 50
SCHEDULE_MAX: Final = 500

# Stands in for the next word when it has not arrived yet.
_NEXT_WORD: Final = "Next"
_CLAUSE_BREAK: Final = re.compile(r"(?:[,:]|\s[—–-])[\"'”’»)\]}]*(?=\s)")  # noqa: RUF001
# What text normalisation rewrites (numbers, money, times, units...), in need of the words around it.
_NEEDS_NEIGHBOURS: Final = re.compile(r"[\d$€£¥%&@#+=/°]")
# Large enough that split_sentences never cuts a sentence for length: the schedule does that here.
_NO_LENGTH_CAP: Final = 1 << 20


class PhraseChunker:
    def __init__(
        self, schedule: Sequence[int] = DEFAULT_SCHEDULE, *, auto_mode: bool = False, first_clause_chars: int = 24
    ) -> None:
        if not schedule or any(length < 1 for length in schedule):
            raise ValueError("the schedule needs at least one positive character count")
        self._schedule = tuple(schedule)
        self._auto_mode = auto_mode
        self._first_clause_chars = first_clause_chars
        self._buffer = ""
        self._phrases = 0

    @property
    def buffered(self) -> int:
        """Characters received and not yet handed out in a phrase."""
        return len(self._buffer)

    def push(self, text: str) -> list[str]:
        """Add a piece of text; return the phrases it completes (possibly none)."""
        self._buffer += text
        if self._auto_mode:
            return self.flush()
        phrases = []
        while (cut := self._cut()) > 0:
            phrases.append(self._take(cut))
        return phrases

    def flush(self) -> list[str]:
        """Everything buffered, as one phrase (none if it is only whitespace)."""
        if not self._buffer.strip():
            return []
        return [self._take(len(self._buffer))]

    def take_words(self, *, keep_numbers_whole: bool = False) -> list[str]:
        """The buffered text up to its last space, as one phrase (a model that takes words as they come).

        ``keep_numbers_whole``: a last word with a digit or a symbol stays buffered until a word
        without one follows it, so that the normaliser reads it with its neighbours ("5 kg",
        "$3 million", "10:30 am").
        """
        cut = _last_space(self._buffer, len(self._buffer))
        while keep_numbers_whole and cut > 0 and _NEEDS_NEIGHBOURS.search(self._buffer[:cut].split()[-1]):
            cut = _last_space(self._buffer, len(self._buffer[:cut].rstrip()))
        if cut <= 0 or not self._buffer[:cut].strip():
            return []
        return [self._take(cut)]

    def _take(self, cut: int) -> str:
        phrase, self._buffer = self._buffer[:cut], self._buffer[cut:]
        self._phrases += 1
        return phrase

    def _cut(self) -> int:
        """Where the next phrase ends in the buffer, or 0 while none is complete."""
        sentence = _sentence_end(self._buffer)
        if sentence:
            return sentence
        if self._phrases == 0:
            clause = _clause_end(self._buffer, self._first_clause_chars)
            if clause:
                return clause
        threshold = self._schedule[min(self._phrases, len(self._schedule) - 1)]
        if len(self._buffer.strip()) >= threshold:
            return _last_space(self._buffer, len(self._buffer))
        return 0


def _sentence_end(buffer: str) -> int:
    """The end of the buffer's first complete sentence (0 if none).

    A sentence end counts once the space after it has arrived: what follows the last space may
    still be growing. The word after the space, as far as it has arrived, goes to
    :func:`split_sentences` too, which needs it ("e.g. this", "No. 5"); when nothing has
    arrived yet a capital stands in for it, taking the likelier reading.
    """
    head_end = _last_space(buffer, len(buffer))
    if head_end <= 0:
        return 0
    probe = buffer[:head_end] + (buffer[head_end:] or _NEXT_WORD)
    sentences = split_sentences(probe, max_chars=_NO_LENGTH_CAP)
    if len(sentences) < 2:
        return 0
    return _end_of(buffer, sentences[0])


def _clause_end(buffer: str, min_chars: int) -> int:
    for match in _CLAUSE_BREAK.finditer(buffer):
        if len(buffer[: match.end()].strip()) >= min_chars:
            return match.end()
    return 0


def _last_space(text: str, end: int) -> int:
    """The position just after the last whitespace character before ``end`` (0 if none)."""
    for index in range(end - 1, -1, -1):
        if text[index].isspace():
            return index + 1 if text[:index].strip() else 0
    return 0


def _end_of(buffer: str, piece: str) -> int:
    """Where ``piece`` (the buffer's first sentence, whitespace collapsed) ends in ``buffer``."""
    wanted = sum(1 for char in piece if not char.isspace())
    seen = 0
    for index, char in enumerate(buffer):
        if not char.isspace():
            seen += 1
            if seen == wanted:
                return index + 1
    return len(buffer)
