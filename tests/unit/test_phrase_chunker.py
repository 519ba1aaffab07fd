"""When streamed text becomes a phrase: one test per rule, plus a seeded no-text-lost property test."""

from __future__ import annotations

import random

from tts_gateway.gateway.speech.text_stream import phrase_chunker
from tts_gateway.gateway.speech.text_stream.phrase_chunker import MAX_PHRASE_CHARS, SCHEDULE_MAX, PhraseChunker


def feed(chunker: PhraseChunker, pieces: list[str]) -> list[str]:
    phrases: list[str] = []
    for piece in pieces:
        phrases += chunker.push(piece)
    return phrases


def tokens(text: str) -> list[str]:
    """Words with their leading space, as LLMs stream them."""
    words = text.split(" ")
    return [words[0], *(f" {word}" for word in words[1:])]


def test_a_sentence_is_a_phrase_once_the_next_word_starts() -> None:
    chunker = PhraseChunker()
    assert feed(chunker, tokens("It is late.")) == []
    assert chunker.push(" Go") == ["It is late."]
    assert chunker.flush() == [" Go"]


def test_a_full_stop_inside_a_number_or_after_an_abbreviation_ends_nothing() -> None:
    chunker = PhraseChunker()
    assert feed(chunker, tokens("Dr. Smith paid 3.50 today")) == []
    assert chunker.flush() == ["Dr. Smith paid 3.50 today"]


def test_the_first_phrase_may_end_at_a_clause_break() -> None:
    chunker = PhraseChunker()
    phrases = feed(chunker, tokens("Thank you for waiting so long, the next part"))
    assert phrases == ["Thank you for waiting so long,"]


def test_later_phrases_do_not_end_at_clause_breaks() -> None:
    chunker = PhraseChunker()
    feed(chunker, tokens("Thank you for waiting so long, the answer is simple, and it is short"))
    assert chunker.flush() == [" the answer is simple, and it is short"]


def test_the_schedule_cuts_long_text_without_punctuation_at_a_space() -> None:
    chunker = PhraseChunker([50, 60])
    words = tokens("word " * 40)
    phrases = feed(chunker, words)
    assert phrases
    # Cut at the last space once the count is reached: the word still arriving waits for the next phrase.
    assert 50 - len("word ") <= len(phrases[0].strip()) < 50 + len("word ")
    assert all(phrase.endswith(" ") for phrase in phrases)
    assert all(60 - len("word ") <= len(phrase.strip()) < 60 + len("word ") for phrase in phrases[1:])


def test_flush_forces_the_buffer_out() -> None:
    chunker = PhraseChunker()
    chunker.push("Hel")
    assert chunker.flush() == ["Hel"]
    assert chunker.buffered == 0
    assert chunker.flush() == []


def test_auto_mode_makes_every_piece_a_phrase() -> None:
    chunker = PhraseChunker(auto_mode=True)
    assert chunker.push("Short one") == ["Short one"]
    assert chunker.push("   ") == []


def test_try_trigger_takes_only_complete_words() -> None:
    chunker = PhraseChunker()
    chunker.push("some words and a half-wri")
    assert chunker.take_words() == ["some words and a "]
    assert chunker.flush() == ["half-wri"]


def test_no_text_is_lost_or_reordered() -> None:
    rng = random.Random(7)
    vocabulary = ["Hello", "world.", "I", "paid", "$3.50,", "Mr.", "Smith!", "ok?", "yes;", "—", "3.14", "no"]
    for _ in range(200):
        text = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(1, 60)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 20)))) if len(text) > 1 else []
        pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        chunker = PhraseChunker([50, 80], auto_mode=rng.random() < 0.2)
        phrases = feed(chunker, pieces) + chunker.flush()
        assert "".join(phrases) == text
        assert all(phrase.strip() for phrase in phrases)


def test_words_with_numbers_wait_for_a_plain_word_after_them() -> None:
    chunker = PhraseChunker()
    taken: list[str] = []
    for piece in tokens("It costs $5 million, or 10:30 am on 5 May today"):
        chunker.push(piece)
        taken += chunker.take_words(keep_numbers_whole=True)
    assert taken == ["It ", "costs ", "$5 million, ", "or ", "10:30 am ", "on ", "5 May "]
    assert chunker.flush() == ["today"]


def test_no_phrase_is_longer_than_a_phrase_may_be() -> None:
    """However the text comes (one message or many, with or without sentence ends), a phrase fits a speech request."""
    words = "word " * 1200
    clauses = "this clause runs on, " * 300
    cases = [words, clauses, "x" * 5000, "A sentence that goes on. " * 200, "中文没有空格，" * 400]  # noqa: RUF001
    for text in (case.rstrip() for case in cases):
        for chunker in (PhraseChunker(), PhraseChunker(auto_mode=True)):
            phrases = chunker.push(text) + chunker.flush()
            assert "".join(phrases) == text
            assert all(len(phrase.strip()) <= MAX_PHRASE_CHARS for phrase in phrases)
        chunker = PhraseChunker([SCHEDULE_MAX])
        triggered = chunker.push(text[:400]) + chunker.take_words() + chunker.push(text[400:]) + chunker.flush()
        assert "".join(triggered) == text
        assert all(len(phrase.strip()) <= MAX_PHRASE_CHARS for phrase in triggered)


def test_a_long_sentence_is_cut_at_a_clause_break_or_a_space() -> None:
    text = "one two three, " * 100
    phrases = PhraseChunker().push(text)
    assert phrases
    assert all(phrase.endswith(", ") or phrase.endswith(",") for phrase in phrases[1:-1])


def test_cutting_is_linear_in_the_text() -> None:
    """Ten times the text takes about ten times the steps (counted, not timed): every cut looks at one
    window of the buffer, never at all of it."""
    calls = 0
    real = phrase_chunker.split_sentences

    def counting(text: str, **kwargs: int) -> list[str]:
        nonlocal calls
        calls += len(text)
        return real(text, **kwargs)

    def work(text: str) -> int:
        nonlocal calls
        calls = 0
        chunker = PhraseChunker()
        chunker.push(text)
        chunker.flush()
        return calls

    phrase_chunker.split_sentences = counting  # type: ignore[assignment]
    try:
        small, large = work("This is a sentence. " * 500), work("This is a sentence. " * 5000)
        words_small, words_large = work("word " * 2000), work("word " * 20000)
    finally:
        phrase_chunker.split_sentences = real
    assert large <= 11 * small
    assert words_large <= 11 * max(words_small, 1)
