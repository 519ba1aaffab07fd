"""Sentence splitting for pipelined synthesis.

Synthesis starts on the first sentence while later ones are still queued, so the
first piece decides the time to first audio and every piece should read as a
natural unit. The rules are deliberately conservative: when in doubt a sentence
is not split (a long sentence only costs latency, a wrong split costs prosody),
and no character of the input is ever dropped apart from whitespace.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from typing import Final

from tts_gateway.gateway.speech.paralinguistic_tags import WRAPPED_SPANS

# Closing quotes and brackets that belong to the sentence they follow.
_CLOSERS: Final = "\"'”’»)]}」』）】〉》"  # noqa: RUF001
_LATIN_ENDS: Final = ".!?;…"
_CJK_ENDS: Final = "。！？；"  # noqa: RUF001
_ENDS: Final = re.escape(_LATIN_ENDS + _CJK_ENDS)
_END_RUN: Final = re.compile(f"[{_ENDS}][{_ENDS}{re.escape(_CLOSERS)}]*")

# Words that end in a full stop without ending a sentence (compared lowercased,
# without their final dot).
_ABBREVIATIONS: Final = frozenset(
    {"mr", "mrs", "ms", "dr", "prof", "st", "sr", "jr", "vs", "etc", "e.g", "i.e", "cf", "approx", "mt", "ave"}
)
# Abbreviations that end no sentence when a number follows ("No. 5"); "no." alone may.
_BEFORE_NUMBERS: Final = frozenset({"no", "nos", "fig", "vol", "ch", "p", "pp"})
# Leading characters ignored when reading the word before a full stop: "(e.g.".
_OPENERS: Final = "\"'“‘«([{¿¡"  # noqa: RUF001
# Single capitals except "I" ("J. R. R. Tolkien") and dotted abbreviations ("U.S.", "Ph.D.").
_INITIALS: Final = re.compile(r"[A-HJ-Z]|(?:[A-Za-z]{1,2}\.)+[A-Za-z]{1,2}")

# Where an over-long sentence may be cut: after clause punctuation (Latin commas and
# colons only before a space, so "1,000" and "10:30" stay whole), an em dash, or
# the CJK comma, enumeration comma, colon and semicolon.
_CLAUSE_BREAK: Final = re.compile(
    f"(?:[,:](?=[{re.escape(_CLOSERS)}]*\\s)|[—，、：；])[{re.escape(_CLOSERS)}]*"  # noqa: RUF001
)


def split_sentences(
    text: str, *, max_chars: int = 250, first_max_chars: int | None = None, min_chars: int = 0
) -> list[str]:
    """Split ``text`` into sentences of at most ``max_chars`` characters.

    Sentences end at ``. ! ? ; …`` followed by a space (not after abbreviations,
    initials or before a lowercase continuation), at their CJK full-width forms,
    and at line breaks, except before a lowercase letter (hard-wrapped prose).
    Longer sentences are cut at clause punctuation, then at spaces, then anywhere
    (text without spaces, such as Chinese). ``first_max_chars`` caps the first
    piece so the first audio is ready sooner. A piece shorter than ``min_chars``
    (a CJK character counting as three: it takes about as long to say) is joined
    with the next one while the two fit the cap. Whitespace is collapsed to single
    spaces; empty pieces are dropped.
    """
    if max_chars < 1:
        raise ValueError("max_chars must be at least 1")
    if first_max_chars is not None and first_max_chars < 1:
        raise ValueError("first_max_chars must be at least 1")
    if min_chars < 0:
        raise ValueError("min_chars must not be negative")
    first_cap = max_chars if first_max_chars is None else min(first_max_chars, max_chars)
    pieces: list[str] = []
    for block in _blocks(text):
        for sentence in _sentences(block):
            pieces.extend(_fit(sentence, first_cap if not pieces else max_chars, max_chars))
    return _join_short(pieces, min_chars, first_cap, max_chars)


def _blocks(text: str) -> Iterator[str]:
    """Paragraphs and lines, whitespace-normalised; wrapped lines are joined back."""
    lines: list[str] = []
    for raw_line in text.splitlines():
        line = " ".join(raw_line.split())
        if lines and (not line or not line[0].islower()):
            yield " ".join(lines)
            lines = []
        if line:
            lines.append(line)
    if lines:
        yield " ".join(lines)


def _sentences(block: str) -> Iterator[str]:
    start = 0
    # Tag pairs that wrap words (CosyVoice2's "<strong>...</strong>") are never cut apart.
    wrapped = [span.span() for span in WRAPPED_SPANS.finditer(block)]
    for match in _END_RUN.finditer(block):
        if any(left < match.start() < right for left, right in wrapped):
            continue
        if _ends_sentence(block, match):
            sentence = block[start : match.end()].strip()
            if sentence:
                yield sentence
            start = match.end()
    rest = block[start:].strip()
    if rest:
        yield rest


def _ends_sentence(block: str, match: re.Match[str]) -> bool:
    run = match.group()
    if any(char in _CJK_ENDS for char in run):
        return True
    end = match.end()  # blocks are normalised: a single space separates words
    if end < len(block) and block[end] != " ":
        return False  # 3.14, example.com, "wait...what"
    if ";" in run:
        return True
    if block[end + 1 : end + 2].islower():
        return False  # "Well... maybe", "e.g. this", '"Why?" she asked'
    if run == ".":
        word = block[block.rfind(" ", 0, match.start()) + 1 : match.start()].lstrip(_OPENERS)
        if word.lower() in _ABBREVIATIONS or _INITIALS.fullmatch(word):
            return False
        if word.lower() in _BEFORE_NUMBERS and block[end + 1 : end + 2].isdigit():
            return False  # "No. 5", "Fig. 3"
    return True


def _join_short(pieces: list[str], min_chars: int, first_cap: int, cap: int) -> list[str]:
    """Pieces shorter than ``min_chars`` joined with the pieces after them, within the caps.

    A short sentence plays briefly, and the next one is only started once the current
    one has audio: it may not be ready when the short one ends ("Thank you for calling."
    gives 1.4 s of speech). One piece also reads with more natural prosody.
    """
    if min_chars <= 0:
        return pieces
    joined: list[str] = []
    for piece in pieces:
        if joined and _spoken_length(last := joined[-1]) < min_chars:
            candidate = f"{last}{_joiner(last)}{piece}"
            if len(candidate) <= (first_cap if len(joined) == 1 else cap):
                joined[-1] = candidate
                continue
        joined.append(piece)
    return joined


def _joiner(piece: str) -> str:
    """No space after a CJK sentence end (Chinese and Japanese put none between sentences), a space
    otherwise: Korean spaces its words, and a line without an end keeps its pause."""
    return "" if piece.rstrip(_CLOSERS).endswith(tuple(_CJK_ENDS)) else " "


def _spoken_length(piece: str) -> int:
    """Characters, a CJK one counted as three (about 4-5 are said a second, against 15 Latin ones)."""
    return sum(3 if _wide(char) else 1 for char in piece)


def _wide(char: str) -> bool:
    return unicodedata.east_asian_width(char) in "WF"


def _fit(sentence: str, first_cap: int, cap: int) -> Iterator[str]:
    """Cut ``sentence`` into pieces of at most ``first_cap``, then ``cap``, characters."""
    rest = sentence
    limit = first_cap
    while len(rest) > limit:
        cut = cut_position(rest, limit)
        yield rest[:cut].strip()
        rest = rest[cut:].strip()
        limit = cap
    if rest:
        yield rest


def cut_position(text: str, limit: int) -> int:
    """Where to cut ``text`` so the first part has at most ``limit`` characters.

    The last clause break wins, then the last space, as long as the first part
    is at least a third of the limit (tiny pieces sound choppy); failing that any
    break or space, and a hard cut at the limit as the last resort.
    """
    window = text[: limit + 1]
    clauses = [m.end() for m in _CLAUSE_BREAK.finditer(window) if m.end() <= limit]
    spaces = [i for i, char in enumerate(window) if char == " "]
    for candidates in (clauses, spaces):
        if candidates and candidates[-1] >= limit // 3:
            return candidates[-1]
    return max(clauses[-1:] + spaces[-1:], default=0) or limit
