"""Text normalisation: every case is an exact expected reading, in English, Chinese and mixed text."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from tts_gateway.gateway.speech.text_normalization import TextNormalizer, language_runs


@pytest.fixture(scope="module")
def normalizer() -> Iterator[TextNormalizer]:
    normalizer = TextNormalizer()
    yield normalizer
    normalizer.close()


CASES = [
    # English: money
    ("It costs $5 today.", "It costs five dollars today."),
    ("It costs $5.99 today.", "It costs five dollars and ninety nine cents today."),
    ("It costs $1.01.", "It costs one dollar and one cent."),
    ("$0.50 is enough.", "fifty cents is enough."),
    ("That is $1,000,000.", "That is one million dollars."),
    ("Only $5 million.", "Only five million dollars."),
    (
        "I paid €12.50 and £3.20, then $0.50.",
        "I paid twelve euros and fifty cents and three pounds and twenty pence, then fifty cents.",
    ),
    ("The price is ¥100.", "The price is one hundred yen."),
    # English: percentages, numbers
    ("3.5% of people agreed.", "three point five percent of people agreed."),
    ("Prices rose 100%.", "Prices rose one hundred percent."),
    ("It is 0.5 or 3.14159.", "It is zero point five or three point one four one five nine."),
    ("It was -12 degrees.", "It was negative twelve degrees."),
    ("It was −12 degrees.", "It was negative twelve degrees."),  # noqa: RUF001 (a real minus sign)
    (
        "1,234 people and 1,234,567 more.",
        "one thousand two hundred and thirty four people and "
        "one million two hundred thirty four thousand five hundred and sixty seven more.",
    ),
    ("I have 1000 cards.", "I have one thousand cards."),
    ("Room 101 is free.", "Room one hundred and one is free."),
    ("He came 1st, she came 2nd and I came 23rd.", "He came first, she came second and I came twenty third."),
    ("The score was 10-20.", "The score was ten to twenty."),
    # English: years, dates, times
    ("The year 1999 was great.", "The year nineteen ninety nine was great."),
    ("The 1990s were fun.", "The nineteen nineties were fun."),
    ("On 2024-03-03 we met.", "On the third of march twenty twenty four we met."),
    ("Jan. 5, 2024 was cold.", "the fifth of january, twenty twenty four was cold."),
    ("Meet me at 10:30am.", "Meet me at ten thirty AM."),
    ("Meet me at 5 pm.", "Meet me at five PM."),
    ("The train leaves at 17:45.", "The train leaves at seventeen forty five."),
    # English: units and temperatures
    ("It was -5°C outside.", "It was negative five degrees Celsius outside."),
    ("It was 72°F in the shade.", "It was seventy two degrees Fahrenheit in the shade."),
    ("It weighs 25kg and runs 3.2 km.", "It weighs twenty five kilograms and runs three point two kilometers."),
    ("Drive at 60 mph.", "Drive at sixty miles per hour."),
    # English: phone numbers
    ("Call 555-123-4567 now.", "Call five five five, one two three, four five six seven now."),
    ("Call +1 555 123 4567 now.", "Call plus one, five five five, one two three, four five six seven now."),
    ("Call (555) 123-4567.", "Call five five five, one two three, four five six seven."),
    # English: abbreviations
    ("Dr. Smith lives at 42 St. James St.", "doctor Smith lives at forty two Saint James Street."),
    ("He lives on Main Ave. Then we go.", "He lives on Main Avenue. Then we go."),
    ("Ms. Lee met Prof. Chen and Sr. Diaz.", "Miss Lee met Professor Chen and Senior Diaz."),
    ("We are open 24/7.", "We are open twenty four seven."),
    ("Mr. and Mrs. Smith came.", "Mister and Misses Smith came."),
    ("Ask for No. 5 please.", "Ask for number five please."),
    ("You are #1 here.", "You are number one here."),
    ("We need apples, pears etc. Then we go.", "We need apples, pears et cetera. Then we go."),
    ("Cats vs. dogs, e.g. mine.", "Cats versus dogs, for example mine."),
    ("Ask Martin Luther King Jr. today.", "Ask Martin Luther King junior today."),
    ("We climbed Mt. Everest in 1953.", "We climbed Mount Everest in nineteen fifty three."),
    # English: e-mail, URLs, names with numbers
    ("Mail bob@example.com today.", "Mail bob at example dot com today."),
    ("Visit www.example.com today.", "Visit WWW dot example dot com today."),
    ("See https://openai.com for details.", "See HTTPS colon slash slash openai dot com for details."),
    ("COVID-19 is over.", "COVID-nineteen is over."),
    # Unchanged: words already, versions (the grammar would garble them), other scripts
    ("Hello world, how are you today?", "Hello world, how are you today?"),
    ("Meet me at five thirty.", "Meet me at five thirty."),
    ("v2.0 is out, version 1.2.3 too.", "v2.0 is out, version 1.2.3 too."),
    ("今天天气很好。", "今天天气很好。"),
    ("今日は2024年3月3日です。", "今日は2024年3月3日です。"),
    ("Привет 5 раз", "Привет 5 раз"),
    # Paralinguistic tags pass through
    ("[laughter] I have 5 dogs.", "[laughter] I have five dogs."),
    ("<strong>5</strong> dogs barked.", "<strong>five</strong> dogs barked."),
    ("[laughter]我有2个苹果。<strong>真的</strong>", "[laughter]我有两个苹果。<strong>真的</strong>"),
    # Chinese
    ("2024年3月3日", "二零二四年三月三日"),
    ("价格是5元", "价格是五元"),
    ("今天-5°C", "今天负五摄氏度"),
    ("电话：13812345678", "电话：幺三八幺二三四五六七八"),  # noqa: RUF001
    ("3.5%的人", "百分之三点五的人"),
    ("10:30开会", "十点三十分开会"),
    ("共1,234人", "共一千二百三十四人"),
    ("第3名", "第三名"),
    ("第2名和2个人", "第二名和两个人"),
    ("我有2个苹果。", "我有两个苹果。"),
    ("身高1.8m，时速100km/h。", "身高一点八米，时速每小时一百公里。"),  # noqa: RUF001
    ("2/3的人", "三分之二的人"),
    ("1990年代", "一九九零年代"),
    ("我花了$5", "我花了五美元"),
    ("这本书¥5。", "这本书五元。"),
    # Thousands separators after a currency sign (the grammar alone reads "¥1,200" as 一元,两百)
    ("这本书¥1,200。", "这本书一千二百元。"),
    ("花了$1,200。", "花了一千二百美元。"),
    ("共有12,345,678人。", "共有一千二百三十四万五千六百七十八人。"),
    ("选项1,2,3都行。", "选项一,二,三都行。"),
    # Mixed: each run in its own language, numbers with their neighbours
    ("我在Apple工作了5年", "我在Apple工作了五年"),
    ("It costs $5 today，价格是5元。", "It costs five dollars today，价格是五元。"),  # noqa: RUF001
    ("It costs 5元.", "It costs 五元."),
    ("他是Dr. Smith，住在42号。", "他是doctor Smith，住在四十二号。"),  # noqa: RUF001
    ("COVID-19疫情", "COVID-十九疫情"),
    # No letters at all: English, unless there is a Han character
    ("12345", "twelve thousand three hundred and forty five"),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_reads(normalizer: TextNormalizer, text: str, expected: str) -> None:
    assert normalizer.normalize(text) == expected


def test_the_table_is_large_and_has_no_duplicates() -> None:
    assert len(CASES) >= 60
    assert len({text for text, _ in CASES}) == len(CASES)


def test_line_breaks_and_spacing_survive(normalizer: TextNormalizer) -> None:
    text = "First line costs $5.\n\nSecond  line at 5 pm.\n"
    assert normalizer.normalize(text) == "First line costs five dollars.\n\nSecond  line at five PM.\n"


def test_long_tokens_are_left_alone(normalizer: TextNormalizer) -> None:
    url = "https://example.com/" + "a1" * 40
    assert normalizer.normalize(f"Open {url} now.") == f"Open {url} now."


def test_language_runs_give_numbers_the_language_of_their_neighbours() -> None:
    def runs(text: str) -> list[tuple[str, str]]:
        return [(text[start:end], language) for start, end, language in language_runs(text)]

    assert runs("我在Apple工作了5年") == [("我在", "zh"), ("Apple", "en"), ("工作了5年", "zh")]
    assert runs("Meet me at 5 pm") == [("Meet me at 5 pm", "en")]
    assert runs("It costs 5元.") == [("It costs ", "en"), ("5元.", "zh")]
    assert runs("身高1.8m") == [("身高1.8m", "zh")]
    assert runs("COVID-19疫情") == [("COVID-", "en"), ("19疫情", "zh")]
    assert runs("[laughter]5个") == [("[laughter]5个", "zh")]
    assert runs("Привет 5") == [("Привет 5", "other")]
    assert runs("") == []


async def test_async_matches_and_the_loop_runs_on_meanwhile(
    normalizer: TextNormalizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The normalisation waits until another task on the loop lets it go: on the loop's own thread
    it would wait forever (the wait's timeout fails it)."""
    text = " and ".join(f"{n} apples" for n in range(1, 30)) + "."
    normalize = normalizer.normalize
    release = threading.Event()

    def held(value: str) -> str:
        assert release.wait(10), "the loop did not run while the text was being normalised"
        return normalize(value)

    monkeypatch.setattr(normalizer, "normalize", held)

    async def meanwhile() -> None:
        await asyncio.sleep(0.05)
        release.set()

    task = asyncio.create_task(meanwhile())
    result = await normalizer.normalize_async(text)
    await task
    assert result == normalize(text)
    assert result.startswith("one apples and two apples")


async def test_async_returns_plain_text_at_once(normalizer: TextNormalizer) -> None:
    assert await normalizer.normalize_async("Nothing to do here.") == "Nothing to do here."


def test_the_cache_changes_no_reading() -> None:
    uncached = TextNormalizer(cached_windows=0)
    try:
        assert [uncached.normalize(text) for text, _ in CASES] == [expected for _, expected in CASES]
    finally:
        uncached.close()
