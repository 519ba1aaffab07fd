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

No phrase holds more than :data:`MAX_PHRASE_CHARS` characters besides the whitespace around it: a
longer one is cut at its last clause break, else its last space, else at the limit (text without
spaces), as :func:`cut_position` cuts an over-long sentence. Each cut looks at a window of the
buffer no longer than a phrase, so the work is linear in the text however it is sent.

Phrases are slices of the input, whitespace included, so that the phrases of a context joined
together are exactly the text it was sent: the alignment sent back with the audio covers every
character once.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Final

from tts_gateway.gateway.speech.text_splitting import cut_position, split_sentences

DEFAULT_SCHEDULE: Final = (120, 160, 250, 290)
# ElevenLabs' bounds for one entry of ``chunk_length_schedule``.
SCHEDULE_MIN: Final = 50
SCHEDULE_MAX: Final = 500
# Well below a speech request's input limit (4,096 characters), which every phrase becomes, and
# above the schedule's longest entry.
MAX_PHRASE_CHARS: Final = 1000

# Stands in for the next word when it has not arrived yet.
_NEXT_WORD: Final = "Next"
_CLAUSE_BREAK: Final = re.compile(r"(?:[,:]|\s[—–-])[\"'”’»)\]}]*(?=\s)")  # noqa: RUF001
# What text normalisation rewrites (numbers, money, times, units...), in need of the words around it.
_NEEDS_NEIGHBOURS: Final = re.compile(r"[\d$€£¥%&@#+=/°]")
_LEADING_SPACE: Final = re.compile(r"\s*")
# Characters past a phrase's end that decide it: the word after a full stop.
_LOOKAHEAD: Final = 64
# The first look for a sentence end: most sentences end within it, and a longer look costs more.
_NEAR: Final = 128
# Text up to this long is cut on the event loop; longer text on a worker thread (some milliseconds
# per thousand characters), so that the loop serves every other client meanwhile.
_ON_LOOP_CHARS: Final = 1000


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
        """Everything buffered, as phrases (none if it is only whitespace)."""
        return self._take_upto(len(self._buffer))

    def take_words(self, *, keep_numbers_whole: bool = False) -> list[str]:
        """The buffered text up to its last space, as phrases (a model that takes words as they come).

        ``keep_numbers_whole``: a last word with a digit or a symbol stays buffered until a word
        without one follows it, so that the normaliser reads it with its neighbours ("5 kg",
        "$3 million", "10:30 am").
        """
        buffer = self._buffer
        cut = _last_space(buffer, len(buffer))
        while keep_numbers_whole and cut > 0:
            start, word = _word_before(buffer, cut)
            if not _NEEDS_NEIGHBOURS.search(word):
                break
            cut = _last_space(buffer, start)
        return self._take_upto(cut)

    def _take(self, cut: int) -> str:
        phrase, self._buffer = self._buffer[:cut], self._buffer[cut:]
        self._phrases += 1
        return phrase

    def _take_upto(self, end: int) -> list[str]:
        """The buffer's first ``end`` characters as phrases, none longer than a phrase may be."""
        phrases = []
        while end - (lead := _leading_space(self._buffer)) > MAX_PHRASE_CHARS:
            cut = _long_cut(self._buffer, lead)
            phrases.append(self._take(cut))
            end -= cut
        if end > 0 and not self._buffer[:end].isspace():
            phrases.append(self._take(end))
        return phrases

    def _cut(self) -> int:
        """Where the next phrase ends in the buffer, or 0 while none is complete."""
        buffer = self._buffer
        window = buffer[: _NEAR + _LOOKAHEAD]
        sentence = _sentence_end(window)
        if not sentence and len(window) < len(buffer):
            window = buffer[: MAX_PHRASE_CHARS + _LOOKAHEAD]
            sentence = _sentence_end(window)
        if 0 < sentence - _leading_space(buffer) <= MAX_PHRASE_CHARS:
            return sentence
        window = buffer[: MAX_PHRASE_CHARS + _LOOKAHEAD]
        if self._phrases == 0:
            clause = _clause_end(window, self._first_clause_chars)
            if clause:
                return clause
        threshold = self._schedule[min(self._phrases, len(self._schedule) - 1)]
        if len(window.strip()) < threshold:
            return 0
        lead = _leading_space(buffer)
        if len(buffer) - lead <= MAX_PHRASE_CHARS:
            return _last_space(buffer, len(buffer))
        return _long_cut(buffer, lead)


async def push_async(chunker: PhraseChunker, text: str) -> list[str]:
    """:meth:`PhraseChunker.push`, on a worker thread when ``text`` is long."""
    if len(text) <= _ON_LOOP_CHARS:
        return chunker.push(text)
    return await asyncio.to_thread(chunker.push, text)


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
    # Uncapped: a sentence too long for a phrase is cut by the caller.
    sentences = split_sentences(probe, max_chars=len(probe))
    if len(sentences) < 2:
        return 0
    return _end_of(buffer, sentences[0])


def _clause_end(window: str, min_chars: int) -> int:
    """The end of the first clause of at least ``min_chars`` characters that fits a phrase (0 if none)."""
    lead = _leading_space(window)
    for match in _CLAUSE_BREAK.finditer(window, 0, lead + MAX_PHRASE_CHARS + 1):
        if match.end() - lead >= min_chars:
            return match.end()
    return 0


def _long_cut(text: str, start: int) -> int:
    """Where to end a phrase that starts at ``start`` in ``text``, where more follows than a phrase may hold."""
    return start + cut_position(text[start : start + MAX_PHRASE_CHARS + 1], MAX_PHRASE_CHARS)


def _leading_space(text: str) -> int:
    match = _LEADING_SPACE.match(text)
    return match.end() if match else 0


def _last_space(text: str, end: int) -> int:
    """The position just after the last whitespace character before ``end`` (0 if none, or if only
    whitespace comes before it)."""
    lead = _leading_space(text)
    for index in range(end - 1, lead, -1):
        if text[index].isspace():
            return index + 1
    return 0


def _word_before(text: str, end: int) -> tuple[int, str]:
    """The last word that ends at or before ``end``, and where it starts."""
    stop = end
    while stop > 0 and text[stop - 1].isspace():
        stop -= 1
    start = stop
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    return start, text[start:stop]


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
