"""The paralinguistic tags CosyVoice2 understands, which text processing must leave whole.

Events (``[laughter]``, ``[breath]``...) stand alone; ``<strong>…</strong>`` and
``<laughter>…</laughter>`` wrap the words they colour. Neither the text normaliser nor the
sentence splitter may change a tag or separate a wrapping pair.
"""

from __future__ import annotations

import re
from typing import Final

_EVENTS: Final = (
    "breath",
    "laughter",
    "noise",
    "cough",
    "clucking",
    "accent",
    "quick_breath",
    "hissing",
    "sigh",
    "vocalized-noise",
    "lipsmack",
    "mn",
)
_WRAPPERS: Final = ("strong", "laughter")

TAGS: Final = re.compile(rf"\[(?:{'|'.join(map(re.escape, _EVENTS))})\]|</?(?:{'|'.join(_WRAPPERS)})>")
WRAPPED_SPANS: Final = re.compile(rf"<({'|'.join(_WRAPPERS)})>.*?</\1>", re.DOTALL)
