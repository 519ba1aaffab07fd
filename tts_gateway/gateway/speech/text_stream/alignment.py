"""Which characters each audio message speaks, and when: an estimate.

The models behind the gateway expose no durations (Piper returns a sentence's audio whole), so
the alignment is estimated: each character gets a weight, the time it takes to say relative to
the others, and a phrase's audio is shared among its characters in proportion to their weights.

Weights: a letter or digit 1, whitespace 0.5, a comma, colon, semicolon or dash 2 (the voice
pauses), a sentence end 3, anything else 0.5. Within a message the characters follow each other
without gaps, so the times increase and the last character ends with the message's audio.

A phrase's audio may arrive in several messages before its length is known. Each message but
the last then takes the characters that the audio so far should have covered, at the speaking
rate measured on the earlier phrases of the context (``ms_per_weight``, starting at
``_INITIAL_MS_PER_WEIGHT``), always leaving at least one character for the last message, which
takes all the rest.

A model that takes text as it arrives speaks one phrase that grows (:meth:`PhraseAligner.extend`)
while its audio comes: a message then never takes characters not yet sent to the model.

Times are in milliseconds relative to the start of the message's audio, as ElevenLabs sends
them (clients add up the messages' durations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

_INITIAL_MS_PER_WEIGHT: Final = 60.0
_PAUSES: Final = frozenset(",:;—–")  # noqa: RUF001
_SENTENCE_ENDS: Final = frozenset(".!?…。！？")  # noqa: RUF001


def char_weight(char: str) -> float:
    if char.isalnum():
        return 1.0
    if char in _SENTENCE_ENDS:
        return 3.0
    if char in _PAUSES:
        return 2.0
    return 0.5


@dataclass(frozen=True)
class CharAlignment:
    chars: tuple[str, ...]
    start_ms: tuple[int, ...]
    duration_ms: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "chars": list(self.chars),
            "charStartTimesMs": list(self.start_ms),
            "charDurationsMs": list(self.duration_ms),
        }


def spread(text: str, audio_ms: float) -> CharAlignment:
    """``text``'s characters laid end to end over ``audio_ms``, each in proportion to its weight."""
    weights = [char_weight(char) for char in text]
    total = sum(weights) or 1.0
    starts: list[int] = []
    durations: list[int] = []
    elapsed = 0.0
    for weight in weights:
        start = round(elapsed * audio_ms / total)
        elapsed += weight
        end = round(elapsed * audio_ms / total)
        starts.append(start)
        durations.append(end - start)
    return CharAlignment(tuple(text), tuple(starts), tuple(durations))


class PhraseAligner:
    """Hands out one phrase's characters message by message (see the module's docstring)."""

    def __init__(self, text: str, ms_per_weight: float = _INITIAL_MS_PER_WEIGHT) -> None:
        self._text = text
        self._weights = [char_weight(char) for char in text]
        self._ms_per_weight = ms_per_weight
        self._next = 0
        self._audio_ms = 0.0

    def extend(self, text: str) -> None:
        """More of the phrase: ``text`` was sent to a model that speaks it after what came before."""
        self._text += text
        self._weights.extend(char_weight(char) for char in text)

    @property
    def pending(self) -> int:
        """Characters not yet laid over audio."""
        return len(self._text) - self._next

    def take(self, audio_ms: float, *, last: bool) -> CharAlignment:
        """The characters spoken by the next ``audio_ms`` of the phrase's audio."""
        self._audio_ms += audio_ms
        if last:
            end = len(self._text)
        else:
            budget = self._audio_ms / self._ms_per_weight
            end = self._next
            covered = sum(self._weights[: self._next])
            while end < len(self._text) - 1 and covered + self._weights[end] <= budget:
                covered += self._weights[end]
                end += 1
        piece, self._next = self._text[self._next : end], end
        return spread(piece, audio_ms)

    @property
    def measured_ms_per_weight(self) -> float | None:
        """The speaking rate of the whole phrase, once all its audio was taken."""
        total = sum(self._weights)
        if self._next < len(self._text) or total == 0:
            return None
        return self._audio_ms / total
