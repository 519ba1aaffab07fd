"""Sentence splitting rules, one test per rule, plus a seeded no-text-lost property test."""

# Full-width CJK punctuation is the point of several tests here.
# ruff: noqa: RUF001

from __future__ import annotations

import random

import pytest

from tts_gateway.gateway.speech.text_splitting import split_sentences


def test_english_sentence_punctuation() -> None:
    assert split_sentences("Hello world. This is a test! Is it? Yes; it is.") == [
        "Hello world.",
        "This is a test!",
        "Is it?",
        "Yes;",
        "it is.",
    ]


def test_chinese_and_japanese_punctuation_needs_no_space() -> None:
    assert split_sentences("你好。今天天气很好！你呢？我很好；谢谢。") == [
        "你好。",
        "今天天气很好！",
        "你呢？",
        "我很好；",
        "谢谢。",
    ]
    assert split_sentences("今日は晴れです。明日は雨でしょう！") == ["今日は晴れです。", "明日は雨でしょう！"]


@pytest.mark.parametrize(
    "text",
    [
        "Mr. Smith met Mrs. Brown and Ms. Green.",
        "Dr. Jones lives on St. Mary's road.",
        "It was England vs. France tonight.",
        "Bring fruit, e.g. Apples or pears.",
        "Use a codec, i.e. Opus for speech.",
        "Apples, pears, etc. Are all fine.",
        "The U.S. Senate and Ph.D. Students met.",
    ],
)
def test_abbreviations_do_not_end_sentences(text: str) -> None:
    assert split_sentences(text) == [text]


def test_no_before_a_number_does_not_end_a_sentence_but_a_final_no_does() -> None:
    assert split_sentences("Ask for No. 5 at Mt. Fuji. I said no. Then I left.") == [
        "Ask for No. 5 at Mt. Fuji.",
        "I said no.",
        "Then I left.",
    ]


def test_paralinguistic_tags_stay_whole_and_wrapping_pairs_are_not_cut_apart() -> None:
    text = "[laughter] Hi. <strong>This. Is. Loud!</strong> Then calm. <laughter>Oh. Well.</laughter> Bye."
    assert split_sentences(text) == [
        "[laughter] Hi.",
        "<strong>This. Is. Loud!</strong> Then calm.",
        "<laughter>Oh. Well.</laughter> Bye.",
    ]


def test_initials_do_not_end_sentences_but_the_pronoun_i_does() -> None:
    assert split_sentences("J. R. R. Tolkien wrote it. So did I. Then I slept.") == [
        "J. R. R. Tolkien wrote it.",
        "So did I.",
        "Then I slept.",
    ]


def test_decimals_urls_and_emails_stay_whole() -> None:
    text = "Pi is 3.14 roughly. See https://example.com/a.b?c=d!x or mail john.doe@example.org. Bye."

    assert split_sentences(text) == [
        "Pi is 3.14 roughly.",
        "See https://example.com/a.b?c=d!x or mail john.doe@example.org.",
        "Bye.",
    ]


def test_ellipsis_inside_a_clause_does_not_split_but_one_before_a_new_sentence_does() -> None:
    assert split_sentences("Well... maybe not. I was thinking… Maybe yes. Wait…what?") == [
        "Well... maybe not.",
        "I was thinking…",
        "Maybe yes.",
        "Wait…what?",
    ]


def test_closing_quotes_and_brackets_stay_with_their_sentence() -> None:
    assert split_sentences('"Stop!" He froze. (It was late.) She said: \u201cGo.\u201d Then silence.') == [
        '"Stop!"',
        "He froze.",
        "(It was late.)",
        "She said: \u201cGo.\u201d",
        "Then silence.",
    ]
    assert split_sentences("「真的吗？」他问。") == ["「真的吗？」", "他问。"]


def test_quoted_question_followed_by_lowercase_continues_the_sentence() -> None:
    assert split_sentences('"Why?" she asked. Nobody knew.') == ['"Why?" she asked.', "Nobody knew."]


def test_line_breaks_and_paragraphs_end_sentences() -> None:
    text = "Title\nFirst line without a stop\n\nNew paragraph. Second sentence\n\n\nLast"

    assert split_sentences(text) == [
        "Title",
        "First line without a stop",
        "New paragraph.",
        "Second sentence",
        "Last",
    ]


def test_hard_wrapped_prose_is_joined_back() -> None:
    assert split_sentences("This sentence was wrapped\nin the middle by an editor. Next one.") == [
        "This sentence was wrapped in the middle by an editor.",
        "Next one.",
    ]


def test_whitespace_is_normalised_and_empty_input_gives_nothing() -> None:
    assert split_sentences("  lots \t of\u00a0\u00a0whitespace\u3000here.  \r\n  ") == ["lots of whitespace here."]
    assert split_sentences("") == []
    assert split_sentences(" \n\n\t ") == []


def test_long_sentence_is_cut_at_clause_punctuation_first() -> None:
    text = (
        "This long sentence has several clauses, which all matter to the listener,"
        " and it keeps going on and on: without any stop — until it finally ends."
    )

    pieces = split_sentences(text, max_chars=60)

    assert pieces == [
        "This long sentence has several clauses,",
        "which all matter to the listener,",
        "and it keeps going on and on: without any stop —",
        "until it finally ends.",
    ]


def test_long_sentence_without_clauses_is_cut_at_spaces() -> None:
    text = "one two three four five six seven eight nine ten eleven twelve thirteen"

    pieces = split_sentences(text, max_chars=20)

    assert pieces == ["one two three four", "five six seven eight", "nine ten eleven", "twelve thirteen"]
    assert all(len(piece) <= 20 for piece in pieces)


def test_numbers_with_commas_and_colons_are_not_cut_points() -> None:
    pieces = split_sentences("The sum of 1,000,000 and more at 10:30 is large, they say", max_chars=50)

    assert pieces == ["The sum of 1,000,000 and more at 10:30 is large,", "they say"]


def test_chinese_long_sentence_is_cut_at_clause_marks_then_hard_cut() -> None:
    assert split_sentences("这是一个很长的句子，有逗号分隔，还有顿号、以及更多内容。", max_chars=12) == [
        "这是一个很长的句子，",
        "有逗号分隔，还有顿号、",
        "以及更多内容。",
    ]
    assert split_sentences("没有任何标点符号的一个很长很长的中文句子", max_chars=8) == [
        "没有任何标点符号",
        "的一个很长很长的",
        "中文句子",
    ]


def test_tiny_leading_clause_is_not_cut_off_when_a_space_is_available() -> None:
    text = "Yes, this sentence continues for quite a while without more commas at all"

    assert split_sentences(text, max_chars=40)[0] == "Yes, this sentence continues for quite a"


def test_first_max_chars_caps_only_the_first_piece() -> None:
    text = "A first sentence that is rather long, with a clause. A second sentence, also long, follows it."

    pieces = split_sentences(text, max_chars=200, first_max_chars=40)

    assert pieces == [
        "A first sentence that is rather long,",
        "with a clause.",
        "A second sentence, also long, follows it.",
    ]


def test_first_max_chars_larger_than_max_chars_does_not_loosen_the_cap() -> None:
    pieces = split_sentences("word " * 30, max_chars=20, first_max_chars=100)

    assert all(len(piece) <= 20 for piece in pieces)


def test_short_sentences_are_joined_with_the_next_one() -> None:
    text = "Thank you for calling. All of our agents are busy at the moment. Hold on. Bye."

    assert split_sentences(text, min_chars=40) == [
        "Thank you for calling. All of our agents are busy at the moment.",
        "Hold on. Bye.",
    ]
    assert split_sentences(text, min_chars=0) == [
        "Thank you for calling.",
        "All of our agents are busy at the moment.",
        "Hold on.",
        "Bye.",
    ]


def test_a_short_sentence_stays_alone_when_joining_would_pass_the_cap() -> None:
    text = "Hi there. A second sentence that is long enough to fill the first piece."

    assert split_sentences(text, first_max_chars=40, min_chars=20) == [
        "Hi there.",
        "A second sentence that is long enough to fill the first piece.",
    ]
    assert split_sentences(text, first_max_chars=100, min_chars=20) == [text]


def test_short_cjk_sentences_are_joined_without_a_space_each_character_counting_as_three() -> None:
    text = "你好。今天天气很好！你呢？我很好。"
    assert split_sentences(text, min_chars=10) == ["你好。今天天气很好！", "你呢？我很好。"]
    # A Chinese sentence after a closing quote: still no space.
    assert split_sentences("他说：“好。”然后走了。", min_chars=40) == ["他说：“好。”然后走了。"]
    # 15 characters take about as long to say as 45 Latin ones: not short at 40.
    text = "流式语音合成需要尽快开始播放。第一句话先被合成。"
    assert split_sentences(text, min_chars=40) == ["流式语音合成需要尽快开始播放。", "第一句话先被合成。"]


def test_a_joined_line_without_a_sentence_end_keeps_a_space() -> None:
    # Korean spaces its words; a heading line has no full stop to end it.
    assert split_sentences("제목\n안녕하세요 반갑습니다.", min_chars=40) == ["제목 안녕하세요 반갑습니다."]
    assert split_sentences("标题\n正文开始了。", min_chars=40) == ["标题 正文开始了。"]


def test_invalid_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_chars"):
        split_sentences("Hi.", max_chars=0)
    with pytest.raises(ValueError, match="first_max_chars"):
        split_sentences("Hi.", first_max_chars=0)
    with pytest.raises(ValueError, match="min_chars"):
        split_sentences("Hi.", min_chars=-1)


ATOMS = [
    *["Hello", "world", "the", "a", "I", "Mr.", "Dr.", "e.g.", "i.e.", "etc.", "J.", "U.S.", "1,000", "10:30"],
    *["3.14", "https://a.example/b?c=d", "x@y.org", "你好", "世界", "今日は", "晴れ"],
    *[".", "!", "?", ";", "…", "...", ",", ":", "—", '"', "'", "\u201d", "\u2019", "(", ")", "¿", "¡"],
    *["。", "！", "？", "；", "，", "、", "：", "「", "」"],
    *[" ", " ", " ", "  ", "\n", "\n\n", "\r\n", "\t", "\u3000", "\u00a0", "\u2028"],
]


def test_no_text_is_ever_lost_and_limits_hold() -> None:
    rng = random.Random(20240601)
    for _ in range(3000):
        text = "".join(rng.choice(ATOMS) for _ in range(rng.randint(0, 120)))
        max_chars = rng.choice([1, 2, 7, 20, 60, 250])
        first_max_chars = rng.choice([None, 1, 5, 30])
        min_chars = rng.choice([0, 10, 40])

        pieces = split_sentences(text, max_chars=max_chars, first_max_chars=first_max_chars, min_chars=min_chars)

        assert "".join("".join(pieces).split()) == "".join(text.split()), text
        for piece in pieces:
            assert piece, text
            assert piece == " ".join(piece.split()), text
            assert len(piece) <= max_chars, text
        if pieces and first_max_chars is not None:
            assert len(pieces[0]) <= first_max_chars, text
