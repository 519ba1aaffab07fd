"""Text normalisation: numbers, money, dates, times, units and abbreviations as words.

Speech models read words, not symbols: Piper says "dollar five" for "$5", and CosyVoice2's
LLM is prompted with text its upstream frontend would have spelt out. Every speech request's
input therefore goes through :class:`TextNormalizer` before it is split into sentences.

The grammars are WeTextProcessing's (the ``wetext`` runtime: the same English and Chinese
grammars upstream CosyVoice uses, precompiled into the wheel and run by ``kaldifst``, so
nothing is built or downloaded at run time). What this module adds around them:

- **Language per run.** Chinese runs go to the Chinese grammar, Latin-script runs to the
  English one, and a number, symbol or punctuation mark takes the language of the letters it
  touches ("工作了5年" is Chinese, "at 5 pm" English, "It costs 5元" reads the number in
  Chinese because it is written against 元). Other scripts (Japanese kana, Hangul, Cyrillic...)
  and numbers written against them are left as they are: no grammar here speaks them.
- **Only what needs it.** The English grammar costs about 0.05 ms per character, so it is run
  on small windows (a token with a digit, a symbol or a known abbreviation, with the neighbours
  that change its reading: "5 pm", "March 3, 2024"), never on whole sentences; text that is
  already words is not touched at all. :meth:`TextNormalizer.normalize_async` runs on a thread of its
  own; the grammars run in C++ without the GIL, so the event loop is not held up meanwhile.
- **Fixes for what the English grammar reads wrong**, as rewrites into forms it reads right:
  money with cents ("$5.99" would be "five point nine nine dollars"), numbers of one thousand and
  a bit ("1,234" would lose its "one", "1000" would be "ten hundred"), decades ("1990s"), phone
  numbers separated by spaces or dots, "+", "#", "No. 5", "St." and a few Latin abbreviations.
- **Protected spans.** The paralinguistic tags CosyVoice2 understands (``[laughter]``,
  ``<strong>…</strong>``...) are never passed to a grammar; a token the grammar cannot parse,
  or one longer than :data:`MAX_TOKEN_CHARS`, is left unchanged rather than garbled.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Final, Literal, cast

from tts_gateway.gateway.speech.paralinguistic_tags import TAGS

logger = logging.getLogger(__name__)

Language = Literal["en", "zh", "other"]

# Longer tokens (long URLs, hashes, base64) are left as they are.
MAX_TOKEN_CHARS: Final = 64

_HAN: Final = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
# CJK punctuation and full-width forms (digits and signs included) belong to Chinese text.
_CJK_MARKS: Final = "\u3001-\u303f\uff01-\uff60\uffe0-\uffe6"
_LATIN: Final = "A-Za-z\u00c0-\u024f"
_KANA: Final = re.compile("[\u3040-\u30ff]")
# Letter runs: Chinese, Latin, any other script. Everything between them is neutral.
_RUNS: Final = re.compile(f"(?P<zh>[{_HAN}{_CJK_MARKS}]+)|(?P<en>[{_LATIN}]+)|(?P<other>[^\\W\\d_{_LATIN}{_HAN}]+)")
_JAPANESE_RUNS: Final = re.compile(f"(?P<en>[{_LATIN}]+)|(?P<other>[^\\W\\d_{_LATIN}]+|[{_CJK_MARKS}]+)")

# Anything a grammar may change. Text without a match is returned as it is, at once.
_WORTH_A_LOOK: Final = re.compile(
    r"[0-9\uff10-\uff19$€£¥￥%°℃#@&+=/]|[A-Za-z]\.[A-Za-z]|\b(?:Dr|Mr|Mrs|Ms|Mt|Jr|No|St|etc|vs|Prof|Sr|Ave|approx)\."
)
# English tokens sent to the grammar (with the neighbours that change their reading).
_EN_TOKEN: Final = re.compile(r"[0-9$€£¥%°#@&+=/]|[A-Za-z]\.[A-Za-z]|^\W*(?:Dr|Mr|Mrs|Ms|Mt|Jr)\.")
# Tokens the English grammar garbles ("v2.0" as "v two.zero", "1.2.3" as "one.two point three"):
# left alone, and kept out of their neighbours' windows.
_EN_UNREADABLE: Final = re.compile(r"\d\.\d+\.\d|[A-Za-z]\d+\.\d")
# Chinese: stretches of non-Han characters with a digit or a sign, and context around them.
_ZH_CLUSTER: Final = re.compile(f"[^\\s{_HAN}\u3001-\u303f\uff0c\uff1a\uff1b\uff01\uff1f]+")
_ZH_NEEDS: Final = re.compile(r"[0-9\uff10-\uff19$€£¥￥%°℃]")
_ZH_CONTEXT: Final = 4
# Thousands separators: the Chinese grammar reads "1,200" but garbles it after a currency sign
# ("¥1,200" as 一元,两百), so they are dropped before it reads a window.
_ZH_THOUSANDS: Final = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# Characters in one Chinese grammar call at most (windows that overlap are merged up to this).
_ZH_WINDOW_CHARS: Final = 32
# Words this short after a number may be its unit ("km", "pm"); in Chinese runs, Latin letters this
# short written right after a number are read as its unit.
_UNIT_CHARS: Final = 4
_UNIT_AFTER: Final = frozenset("0123456789°%/.")


# A grammar's reading of a window of text.
_Read = Callable[[str], str]


def _rewrite(pattern: str, replace: Callable[[re.Match[str]], str] | str) -> Callable[[str], str]:
    compiled = re.compile(pattern)
    return lambda text: compiled.sub(replace, text)


_MINOR_UNITS: Final = {"$": ("cent", "cents"), "€": ("cent", "cents"), "£": ("penny", "pence")}


def _money_with_cents(match: re.Match[str]) -> str:
    """``$5.99`` as ``$5 and 99 cents``, both of which the grammar reads."""
    symbol, whole, cents = match.group(1), match.group(2), int(match.group(3))
    parts = [] if whole.strip("0,") == "" and cents else [f"{symbol}{whole}"]
    if cents:
        singular, plural = _MINOR_UNITS[symbol]
        parts.append(f"{cents} {singular if cents == 1 else plural}")
    return " and ".join(parts)


def _one_thousand_and(match: re.Match[str]) -> str:
    """``1,234`` and ``1005`` as ``1 thousand 234`` and ``1 thousand 5``."""
    rest = int(match.group(1))
    return f"1 thousand {rest}" if rest else "1 thousand"


def _phone(match: re.Match[str]) -> str:
    """Phone numbers with spaces or dots in the hyphenated form the grammar reads digit by digit."""
    return "-".join(group for group in match.groups() if group)


_NUMBER_START: Final = r"(?<![\w.,])"
_NUMBER_END: Final = r"(?!\d|[.,]\d)"
_EN_REWRITES: Final = (
    # A minus sign or an en dash between numbers is a hyphen to the grammar.
    _rewrite("\u2212", "-"),
    _rewrite(r"(?<=\d)\u2013(?=\d)", "-"),
    _rewrite(
        r"(?<![\w+])(?:(\+\d{1,3})[ .-])?\(?(\d{3})\)?[ .-](\d{3})[ .-](\d{4})(?![\d-])",
        _phone,
    ),
    _rewrite(r"(?<![\w.,])([$€£])(\d{1,3}(?:,\d{3})+|\d+)\.(\d\d)" + _NUMBER_END, _money_with_cents),
    _rewrite(_NUMBER_START + r"1,(\d{3})" + _NUMBER_END, _one_thousand_and),
    _rewrite(_NUMBER_START + r"10(0\d)" + _NUMBER_END, _one_thousand_and),
    _rewrite(r"(?<![\w+])\+(?=\d)", "plus "),
    _rewrite(r"(?<!\w)#(?=\d)", "number "),
    _rewrite(r"\b[Nn]o\.\s?(?=\d)", "number "),
    # An abbreviation may end a sentence: its full stop stays where the next word starts one (or
    # nothing follows). "St." before a capitalised word is a saint's name, not a sentence end.
    _rewrite(r"\bSt\.(?=\s+[A-Z])", "Saint"),
    _rewrite(r"\bSt\.(?=\s*$)", "Street."),
    _rewrite(r"\bSt\.", "Street"),
    _rewrite(r"\bAve\.(?=\s+[A-Z]|\s*$)", "Avenue."),
    _rewrite(r"\bAve\.", "Avenue"),
    _rewrite(r"\betc\.(?=\s+[A-Z]|\s*$)", "et cetera."),
    _rewrite(r"\betc\.", "et cetera"),
    # Read as a fraction ("twenty four sevenths") by the grammar.
    _rewrite(r"(?<![\w/])24/7(?![\w/])", "twenty four seven"),
    _rewrite(r"\bvs\.", "versus"),
    _rewrite(r"(?<!\w)e\.g\.", "for example"),
    _rewrite(r"(?<!\w)i\.e\.", "that is"),
    _rewrite(r"\bapprox\.", "approximately"),
    _rewrite(r"\bProf\.", "Professor"),
    _rewrite(r"\bSr\.", "Senior"),
)
# What wetext raises for input its grammars have no path for (an assertion in its token parser,
# or a RuntimeError when no path exists).
_GRAMMAR_ERRORS: Final = (AssertionError, RuntimeError, IndexError, ValueError)
# Tokens in one English grammar call at most, so no call takes long ("1 and 2 and 3 and ...").
_WINDOW_TOKENS: Final = 8
_SCALE_WORDS: Final = frozenset({"hundred", "thousand", "million", "billion", "trillion"})
# Short words after a number that are no unit: they would only lengthen (and merge) windows.
_FUNCTION_WORDS: Final = frozenset(
    {"a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "from", "if", "in", "into", "is", "it"}
    | {"me", "my", "no", "not", "of", "on", "or", "our", "so", "than", "that", "the", "then", "this", "to"}
    | {"up", "us", "was", "we", "were", "what", "when", "with", "you", "your"}
)
_PUNCTUATION: Final = ",.;:!?\"'()[]"
_DECADE: Final = re.compile(_NUMBER_START + r"((?:1\d|20)\d0)s\b")
_PLURALS: Final = (("ty", "ties"), ("hundred", "hundreds"), ("thousand", "thousands"), ("ten", "tens"))


class TextNormalizer:
    """English and Chinese text normalisation; build once per process (the grammars take ~50 MB).

    The grammars' readings of the last ``cached_windows`` windows are kept (each language): the
    same few forms ("$5", "10:30am", "2024") come back all the time, and a reading costs about
    a millisecond to compute and a microsecond to look up.
    """

    def __init__(self, cached_windows: int = 4096) -> None:
        # Imported here: reading the grammars takes a second or two, paid once, at start-up.
        from wetext import Normalizer

        self._en: _Read = Normalizer(lang="en", operator="tn").normalize
        self._zh: _Read = Normalizer(lang="zh", operator="tn").normalize
        if cached_windows:
            self._en = functools.lru_cache(maxsize=cached_windows)(self._en)
            self._zh = functools.lru_cache(maxsize=cached_windows)(self._zh)
        self.normalize("It costs $5 at 10:30am on 2024-03-03. 价格是5元。")  # warms both grammars
        # One thread runs the requests' normalisations: the grammars are never used by two threads
        # at once, and kaldifst releases the GIL while it composes, so the event loop runs on.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="text-normalization")

    def normalize(self, text: str) -> str:
        """``text`` with numbers, symbols and abbreviations written as words, in their run's language."""
        return "".join(self._pieces(text))

    async def normalize_async(self, text: str) -> str:
        """:meth:`normalize` on the normaliser's thread (at once for text with nothing to normalise)."""
        if not _WORTH_A_LOOK.search(text):
            return text
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.normalize, text)

    def close(self) -> None:
        """Stop the normaliser's thread (normalisations queued for it are dropped)."""
        self._thread.shutdown(wait=False, cancel_futures=True)

    # -- runs ----------------------------------------------------------------------------------------

    def _pieces(self, text: str) -> Iterator[str]:
        """The normalised text piece by piece."""
        if not _WORTH_A_LOOK.search(text):
            yield text
            return
        languages = language_runs(text)
        for start, end, language in languages:
            chunk = text[start:end]
            if language == "other" or not _WORTH_A_LOOK.search(chunk):
                yield chunk
                continue
            normalise = self._english if language == "en" else self._chinese
            position = 0
            for tag in TAGS.finditer(chunk):
                yield from normalise(chunk[position : tag.start()])
                yield tag.group()
                position = tag.end()
            yield from normalise(chunk[position:])

    # -- English -------------------------------------------------------------------------------------

    def _english(self, text: str) -> Iterator[str]:
        for rewrite in _EN_REWRITES:
            text = rewrite(text)
        text = _DECADE.sub(self._decade, text)
        # Tokens and the whitespace between them: tokens at even indexes.
        parts = re.split(r"(\s+)", text)
        readable = [len(token) <= MAX_TOKEN_CHARS and not _EN_UNREADABLE.search(token) for token in parts[::2]]
        wanted = [ok and bool(_EN_TOKEN.search(token)) for ok, token in zip(readable, parts[::2], strict=True)]
        done = 0
        for first, last in _windows(parts, wanted, readable):
            yield "".join(parts[done : 2 * first])
            yield self._grammar(self._en, "".join(parts[2 * first : 2 * last + 1]), parts, first, last, wanted)
            done = 2 * last + 1
        yield "".join(parts[done:])

    def _decade(self, match: re.Match[str]) -> str:
        """``1990s`` as the year's reading made plural: "nineteen nineties"."""
        try:
            words = self._en(match.group(1)).split()
        except _GRAMMAR_ERRORS:
            return match.group()
        for singular, plural in _PLURALS:
            if words[-1].endswith(singular):
                words[-1] = words[-1][: -len(singular)] + plural
                return " ".join(words)
        return " ".join([*words[:-1], words[-1] + "s"])

    def _grammar(self, grammar: _Read, window: str, parts: list[str], first: int, last: int, wanted: list[bool]) -> str:
        """The grammar's reading of ``window``; token by token where it fails on the whole window."""
        try:
            return _keep_edges(window, grammar(window))
        except _GRAMMAR_ERRORS:  # the English grammar asserts on some inputs ("#1"): read the tokens alone
            logger.debug("normalising %r failed; trying its tokens one by one", window)
        pieces = []
        for index in range(2 * first, 2 * last + 1):
            piece = parts[index]
            if index % 2 == 0 and wanted[index // 2]:
                try:
                    piece = _keep_edges(piece, grammar(piece))
                except _GRAMMAR_ERRORS:
                    logger.debug("left %r as it is: the grammar cannot read it", piece)
            pieces.append(piece)
        return "".join(pieces)

    # -- Chinese -------------------------------------------------------------------------------------

    def _chinese(self, text: str) -> Iterator[str]:
        spans: list[tuple[int, int]] = []
        previous_end = 0  # of the last cluster read
        for cluster in _ZH_CLUSTER.finditer(text):
            if not _ZH_NEEDS.search(cluster.group()) or len(cluster.group()) > MAX_TOKEN_CHARS:
                continue
            start, end = max(0, cluster.start() - _ZH_CONTEXT), min(len(text), cluster.end() + _ZH_CONTEXT)
            if spans and start <= spans[-1][1]:
                if end - spans[-1][0] <= _ZH_WINDOW_CHARS:
                    spans[-1] = (spans[-1][0], end)
                    previous_end = cluster.end()
                    continue
                # Too long to merge: the windows part between the two clusters, neither cut.
                start = max(previous_end, start)
                spans[-1] = (spans[-1][0], start)
            spans.append((start, end))
            previous_end = cluster.end()
        done = 0
        for start, end in spans:
            yield text[done:start]
            window = _ZH_THOUSANDS.sub("", text[start:end])
            try:
                # The grammar reads 2 as 两 before a measure word, ordinals included: "第2名" is 第二名.
                yield _keep_edges(window, self._zh(window).replace("第两", "第二"))
            except _GRAMMAR_ERRORS:
                logger.debug("left %r as it is: the grammar cannot read it", window)
                yield window
            done = end
        yield text[done:]


def language_runs(text: str) -> list[tuple[int, int, Language]]:
    """``text`` cut into runs ``(start, end, language)`` that cover it, in order.

    Letters decide: Han characters (and CJK punctuation) are Chinese, Latin letters English,
    other scripts "other". In text with Japanese kana, Han characters are Japanese ("other").
    A neutral token (digits, symbols, punctuation) takes the language of the letters it is
    written against, Chinese first; a free-standing one that of the next word ("5 apples",
    "5 个"), or the last word at the end; text without letters is Chinese if it has a Han
    character and English otherwise. Whitespace stays with the run before it.
    """
    masked = TAGS.sub(lambda tag: " " * len(tag.group()), text)
    pattern = _JAPANESE_RUNS if _KANA.search(masked) else _RUNS
    letters: list[tuple[int, int, Language | None]] = [
        (match.start(), match.end(), cast(Language, match.lastgroup)) for match in pattern.finditer(masked)
    ]
    runs = _Runs("zh" if re.search(f"[{_HAN}]", masked) else "en")
    previous: Language | None = None
    position = 0
    for start, end, language in [*letters, (len(text), len(text), None)]:
        runs.neutral(masked, position, start, previous, language)
        if language == "en" and end - start <= _UNIT_CHARS and runs.unit_position(masked, start):
            language = "zh"  # a unit written against a Chinese number: "1.8m", "-5°C", "100km/h"
        if language is not None:
            runs.add(start, end, language)
            previous = language
        position = end
    return runs.runs


class _Runs:
    """Language runs being built, adjacent runs of one language merged."""

    def __init__(self, fallback: Language) -> None:
        self.fallback = fallback
        self.runs: list[tuple[int, int, Language]] = []

    def add(self, start: int, end: int, language: Language) -> None:
        if start >= end:
            return
        if self.runs and self.runs[-1][2] == language and self.runs[-1][1] == start:
            self.runs[-1] = (self.runs[-1][0], end, language)
        else:
            self.runs.append((start, end, language))

    def unit_position(self, masked: str, start: int) -> bool:
        """Whether letters at ``start`` follow a number or sign of a Chinese run directly."""
        return bool(self.runs) and self.runs[-1][1:] == (start, "zh") and masked[start - 1] in _UNIT_AFTER

    def neutral(self, masked: str, start: int, end: int, before: Language | None, after: Language | None) -> None:
        """Label the neutral stretch ``masked[start:end]`` between letters of ``before`` and ``after``."""
        current = before or self.fallback
        position = start
        for token in re.finditer(r"\S+", masked[start:end]):
            token_start, token_end = start + token.start(), start + token.end()
            touches_before = before is not None and token_start == start
            if touches_before and before == "en" and masked[token_start] == "-" and token_end - token_start > 1:
                # A hyphen after Latin letters joins them ("COVID-19"): it is no minus sign.
                self.add(position, token_start + 1, "en")
                position = token_start = token_start + 1
                touches_before = False
            touches_after = after is not None and token_end == end
            language: Language
            if touches_before and touches_after:
                language = "zh" if "zh" in (before, after) else cast(Language, before)
            elif touches_before:
                language = cast(Language, before)
            elif touches_after:
                language = cast(Language, after)
            else:
                language = after or before or self.fallback
            self.add(position, token_start, current)
            self.add(token_start, token_end, language)
            current = language
            position = token_end
        self.add(position, end, current)


def _windows(parts: list[str], wanted: list[bool], readable: list[bool]) -> Iterator[tuple[int, int]]:
    """Token ranges ``(first, last)`` to normalise: each wanted token with the neighbours it reads with.

    Every character costs grammar time, so a neighbour joins only where it may change the
    reading: a capitalised word before (a month), a short word or a scale word after (a unit,
    "pm", "million").

    Windows that overlap or touch are merged up to :data:`_WINDOW_TOKENS` tokens (each grammar
    call stays short); none reaches across a line break or takes a token that is not ``readable``.
    """

    def context(index: int, separator: int, before: bool) -> bool:
        """Whether the token at ``index`` gives the wanted one beside it context the grammar reads."""
        if not (0 <= index < len(wanted) and readable[index]) or "\n" in parts[separator]:
            return False
        word = parts[2 * index].strip(_PUNCTUATION)
        if wanted[index]:
            return True
        if before:  # a month ("Jan. 5", "March 3")
            return word[:1].isupper()
        lowered = word.lower()
        return (len(word) <= _UNIT_CHARS and lowered not in _FUNCTION_WORDS) or lowered in _SCALE_WORDS

    window: tuple[int, int] | None = None
    for index, want in enumerate(wanted):
        if not want:
            continue
        first = index - 1 if context(index - 1, 2 * index - 1, before=True) else index
        last = index + 1 if context(index + 1, 2 * index + 1, before=False) else index
        if window is not None and (first <= window[1] or (first == window[1] + 1 and "\n" not in parts[2 * first - 1])):
            if last - window[0] < _WINDOW_TOKENS:
                window = (window[0], last)
                continue
            first = max(first, window[1] + 1)  # too long to merge: the next window starts after it
        if window is not None:
            yield window
        window = (first, last) if first <= last else None
    if window is not None:
        yield window


def _keep_edges(original: str, normalised: str) -> str:
    """``normalised`` with the leading and trailing whitespace of ``original`` (the grammars strip it)."""
    stripped = original.strip()
    if not stripped:
        return original
    head = original[: len(original) - len(original.lstrip())]
    tail = original[len(original.rstrip()) :]
    return f"{head}{normalised.strip()}{tail}"
