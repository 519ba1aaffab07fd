"""The fixed text set every benchmark sends: short, medium and long, in English and Chinese."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchText:
    name: str
    language: str
    text: str


FIVE_SENTENCES = (
    "The morning train left the station a few minutes late. "
    "Most passengers were reading, or looking out at the fields. "
    "A child near the window counted the cows as they passed. "
    "By the time the sun was high, the hills had turned to flat farmland. "
    "Nobody noticed when the train finally slowed down for the coast."
)

TEXTS: tuple[BenchText, ...] = (
    BenchText("short-en", "en", "The quick brown fox jumps over the lazy dog."),
    BenchText(
        "medium-en",
        "en",
        "Streaming speech should start quickly. The first sentence is synthesised while the rest waits, "
        "so the listener hears audio before the whole answer exists.",
    ),
    BenchText("long-en", "en", FIVE_SENTENCES),
    BenchText("short-zh", "zh", "今天天气很好，我们一起去公园散步吧。"),  # noqa: RUF001
    BenchText(
        "medium-zh",
        "zh",
        "流式语音合成需要尽快开始播放。第一句话先被合成，后面的句子排队等待，这样听众不必等整段文字完成。",  # noqa: RUF001
    ),
    BenchText(
        "long-zh",
        "zh",
        "早上的火车晚了几分钟才离开车站。大多数乘客在看书，或者望着窗外的田野。"  # noqa: RUF001
        "靠窗的孩子数着经过的奶牛。太阳升高的时候，山丘已经变成了平坦的农田。"  # noqa: RUF001
        "火车终于在海边减速的时候，没有人注意到。",  # noqa: RUF001
    ),
)


def select_texts(names: Sequence[str] | None, languages: Iterable[str]) -> tuple[BenchText, ...]:
    """The texts named (all by default) that a model speaking ``languages`` can say."""
    known = {t.name: t for t in TEXTS}
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        raise ValueError(f"unknown texts {unknown}; known: {sorted(known)}")
    spoken = set(languages)
    chosen = [known[name] for name in names] if names else list(TEXTS)
    return tuple(t for t in chosen if t.language in spoken)
