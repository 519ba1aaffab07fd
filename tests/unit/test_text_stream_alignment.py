"""The estimated character alignment: complete, monotonic, within each message's audio."""

from __future__ import annotations

import pytest

from tts_gateway.gateway.speech.text_stream.alignment import PhraseAligner, spread


def check(alignment_chars: tuple[str, ...], starts: tuple[int, ...], durations: tuple[int, ...], ms: float) -> None:
    assert len(alignment_chars) == len(starts) == len(durations)
    ends = [start + duration for start, duration in zip(starts, durations, strict=True)]
    assert all(duration >= 0 for duration in durations)
    assert list(starts) == sorted(starts)
    assert all(end <= round(ms) for end in ends)
    assert all(later >= earlier for earlier, later in zip(ends, starts[1:], strict=False))


def test_spread_fills_the_audio_and_weights_pauses() -> None:
    alignment = spread("Hi, you.", 800)
    check(alignment.chars, alignment.start_ms, alignment.duration_ms, 800)
    assert alignment.start_ms[-1] + alignment.duration_ms[-1] == 800
    comma, letter = alignment.duration_ms[2], alignment.duration_ms[0]
    assert comma > letter


@pytest.mark.parametrize("pieces", [[1000.0], [50.0, 400.0, 20.0], [10.0] * 30])
def test_a_phrase_split_over_messages_gives_every_character_once(pieces: list[float]) -> None:
    text = " Hello there, how are you today?"
    aligner = PhraseAligner(text)
    seen = ""
    for index, ms in enumerate(pieces):
        part = aligner.take(ms, last=index == len(pieces) - 1)
        check(part.chars, part.start_ms, part.duration_ms, ms)
        seen += "".join(part.chars)
    assert seen == text
    assert aligner.measured_ms_per_weight == pytest.approx(
        sum(pieces) / sum(1.0 if c.isalnum() else 3.0 if c in ".?" else 2.0 if c == "," else 0.5 for c in text)
    )


def test_early_messages_take_characters_at_the_measured_rate() -> None:
    aligner = PhraseAligner("abcdefghij", ms_per_weight=100)
    assert "".join(aligner.take(300, last=False).chars) == "abc"
    assert "".join(aligner.take(10_000, last=False).chars) == "defghi"  # one is kept for the last message
    assert "".join(aligner.take(100, last=True).chars) == "j"


def test_a_growing_phrase_never_aligns_text_not_yet_sent() -> None:
    aligner = PhraseAligner("Hi ")
    first = aligner.take(5_000.0, last=False)
    # Far more audio than the text: all but the last character, which waits for more audio or text.
    assert "".join(first.chars) == "Hi"
    aligner.extend("there.")
    second = aligner.take(100.0, last=False)
    rest = aligner.take(200.0, last=True)
    assert "".join(first.chars + second.chars + rest.chars) == "Hi there."
    check(second.chars, second.start_ms, second.duration_ms, 100.0)
    check(rest.chars, rest.start_ms, rest.duration_ms, 200.0)
