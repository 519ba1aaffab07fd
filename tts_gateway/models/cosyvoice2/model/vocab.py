"""The extended vocabulary of the CosyVoice2 LLM and the prompt it is given.

The LLM is Qwen2 with its text vocabulary extended by the speech tokens, in the layout
that upstream's ``examples/grpo/cosyvoice2/pretrained_to_huggingface.py`` (FunAudioLLM/CosyVoice)
writes for the ``yuekai/cosyvoice2_llm`` HF directory:

- ids ``[0, 151663)``: the text tokenizer of ``CosyVoice-BlankEN`` (Qwen2: 151643 BPE tokens,
  ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) plus the 17 special tokens CosyVoice adds
  (``<|endofprompt|>``, ``[breath]``, ... ``[mn]``);
- ids ``151663 + k`` for speech token ``k < 6561``, spelled ``<|s_k|>``;
- then ``<|eos1|>``, ``<|eos2|>``, ``<|eos3|>`` (the three stop rows of upstream's
  ``llm_decoder``), ``<|sos|>`` and ``<|task_id|>`` (upstream's ``llm_embedding`` rows);
- the embedding matrix is padded to a multiple of 128 rows (``vocab_size`` 158336).

The prompt is ``tokenize("<|sos|>" + reference_text + target_text + "<|task_id|>")`` followed by
the reference recording's speech tokens (upstream triton_trtllm ``cosyvoice2`` model,
``parse_input``). Upstream stops at ``<|eos1|>`` only and lets eos2/eos3 through as invalid
tokens; here all three stop generation.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np
from numpy.typing import NDArray

TEXT_VOCAB_SIZE: Final = 151663
SPEECH_TOKEN_SIZE: Final = 6561
SPEECH_TOKEN_OFFSET: Final = TEXT_VOCAB_SIZE

EOS1: Final = "<|eos1|>"
EOS2: Final = "<|eos2|>"
EOS3: Final = "<|eos3|>"
SOS: Final = "<|sos|>"
TASK_ID: Final = "<|task_id|>"

EOS1_ID: Final = TEXT_VOCAB_SIZE + SPEECH_TOKEN_SIZE
EOS2_ID: Final = EOS1_ID + 1
EOS3_ID: Final = EOS1_ID + 2
SOS_ID: Final = EOS1_ID + 3
TASK_ID_ID: Final = EOS1_ID + 4

STOP_IDS: Final[tuple[int, ...]] = (EOS1_ID, EOS2_ID, EOS3_ID)
# Tokens the tokenizer knows (len(tokenizer)); the model's rows are padded beyond this.
TOKENIZER_SIZE: Final = TASK_ID_ID + 1
VOCAB_PAD_MULTIPLE: Final = 128
MODEL_VOCAB_SIZE: Final = math.ceil(TOKENIZER_SIZE / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

# The text-side specials, in id order from 151643 (Qwen2's three, then CosyVoice's additions).
TEXT_SPECIAL_TOKENS: Final[tuple[str, ...]] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endofprompt|>",
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)
FIRST_TEXT_SPECIAL_ID: Final = TEXT_VOCAB_SIZE - len(TEXT_SPECIAL_TOKENS)
ENDOFPROMPT: Final = "<|endofprompt|>"
ENDOFPROMPT_ID: Final = FIRST_TEXT_SPECIAL_ID + TEXT_SPECIAL_TOKENS.index(ENDOFPROMPT)
SPEECH_SUFFIX_TOKENS: Final[tuple[str, ...]] = (EOS1, EOS2, EOS3, SOS, TASK_ID)


class TextTokenizer(Protocol):
    """The part of a Hugging Face tokenizer this module uses."""

    def encode(self, text: str) -> list[int]: ...

    def get_added_vocab(self) -> dict[str, int]: ...

    def convert_tokens_to_ids(self, tokens: list[str]) -> int | list[int]: ...


def speech_token_string(token: int) -> str:
    """The tokenizer's spelling of speech token ``token`` (``<|s_k|>``)."""
    _check_speech_token(token)
    return f"<|s_{token}|>"


def speech_token_to_id(token: int) -> int:
    """LLM vocabulary id of speech token ``token``."""
    _check_speech_token(token)
    return SPEECH_TOKEN_OFFSET + token


def id_to_speech_token(token_id: int) -> int | None:
    """Speech token of LLM id ``token_id``, or None when the id is not a speech token."""
    token = token_id - SPEECH_TOKEN_OFFSET
    return token if 0 <= token < SPEECH_TOKEN_SIZE else None


def speech_tokens_to_ids(tokens: NDArray[np.integer[Any]] | Sequence[int]) -> list[int]:
    """LLM ids of a sequence of speech tokens."""
    array = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if array.size and (array.min() < 0 or array.max() >= SPEECH_TOKEN_SIZE):
        raise ValueError(f"speech tokens must lie in [0, {SPEECH_TOKEN_SIZE})")
    return (array + SPEECH_TOKEN_OFFSET).tolist()


def build_prompt_ids(
    tokenizer: TextTokenizer,
    reference_text: str,
    target_text: str,
    prompt_speech_tokens: NDArray[np.integer[Any]] | Sequence[int],
) -> list[int]:
    """LLM input ids for zero-shot synthesis of ``target_text`` in the reference voice.

    User text goes through :func:`text_token_ids`, so an input that spells ``<|eos1|>``
    or ``<|s_42|>`` is read as text instead of steering the LLM.
    """
    text_ids = text_token_ids(tokenizer, reference_text + target_text)
    return [SOS_ID, *text_ids, TASK_ID_ID, *speech_tokens_to_ids(prompt_speech_tokens)]


def split_prompt_ids(input_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """The text ids and speech ids of a :func:`build_prompt_ids` prompt (``<|sos|>`` text ``<|task_id|>`` speech).

    A text stream's prompt is written that way with no target text; ValueError for other layouts.
    """
    ids = list(input_ids)
    if not ids or ids[0] != SOS_ID or TASK_ID_ID not in ids:
        raise ValueError("a text stream's prompt must be <|sos|> text <|task_id|> speech tokens")
    task = ids.index(TASK_ID_ID)
    text, speech = ids[1:task], ids[task + 1 :]
    if any(not 0 <= i < TEXT_VOCAB_SIZE for i in text) or any(id_to_speech_token(i) is None for i in speech):
        raise ValueError("a text stream's prompt must be <|sos|> text <|task_id|> speech tokens")
    return text, speech


# Control tokens (speech tokens, <|sos|>, <|eos1|>, <|endofprompt|>, chat markers ...) are spelt
# <|...|>. Candidates are found by that shape and checked against the tokenizer's added
# vocabulary (too large for one alternation). Paralinguistic tags such as [laughter], [breath]
# and <strong>...</strong> are left alone: CosyVoice2 was trained to follow them in the text.
_CONTROL_TOKEN_SHAPE = re.compile(r"<\|[^<>|\s]{1,64}\|>")
_ADDED_TOKENS: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()


def build_instruct_prompt_ids(tokenizer: TextTokenizer, instructions: str, target_text: str) -> list[int]:
    """LLM input ids for instructed synthesis (upstream's ``instruct2``).

    The instruction takes the transcript's place, closed by ``<|endofprompt|>``, and the LLM gets
    no prompt speech tokens: the recording still sets the voice through the flow prompt and the
    speaker embedding, but its prosody does not compete with the instruction.
    """
    return [
        SOS_ID,
        *text_token_ids(tokenizer, instructions),
        ENDOFPROMPT_ID,
        *text_token_ids(tokenizer, target_text),
        TASK_ID_ID,
    ]


def text_token_ids(tokenizer: TextTokenizer, text: str) -> list[int]:
    """Ids of user text that never include a control token's id.

    Hugging Face tokenizers match added tokens anywhere in the input, even where the
    user typed them; a control token typed by the user is encoded character by character.
    """
    added = _added_tokens(tokenizer)
    ids: list[int] = []
    start = 0
    for match in _CONTROL_TOKEN_SHAPE.finditer(text):
        if match.group() not in added:
            continue
        if match.start() > start:
            ids.extend(tokenizer.encode(text[start : match.start()]))
        for char in match.group():
            ids.extend(tokenizer.encode(char))
        start = match.end()
    if start < len(text):
        ids.extend(tokenizer.encode(text[start:]))
    return ids


def _added_tokens(tokenizer: TextTokenizer) -> frozenset[str]:
    cached = _ADDED_TOKENS.get(tokenizer)
    if cached is None:
        cached = _ADDED_TOKENS[tokenizer] = frozenset(tokenizer.get_added_vocab())
    return cached


def check_tokenizer_layout(tokenizer: TextTokenizer) -> None:
    """Raise ValueError unless ``tokenizer`` spells the specials at the ids this module assumes.

    Loading a tokenizer of another layout (a plain Qwen2 one, a CosyVoice3 conversion) would
    otherwise produce prompts the LLM was never trained on, silently.
    """
    expected = {
        TEXT_SPECIAL_TOKENS[0]: FIRST_TEXT_SPECIAL_ID,
        TEXT_SPECIAL_TOKENS[-1]: TEXT_VOCAB_SIZE - 1,
        speech_token_string(0): SPEECH_TOKEN_OFFSET,
        speech_token_string(SPEECH_TOKEN_SIZE - 1): SPEECH_TOKEN_OFFSET + SPEECH_TOKEN_SIZE - 1,
        EOS1: EOS1_ID,
        EOS2: EOS2_ID,
        EOS3: EOS3_ID,
        SOS: SOS_ID,
        TASK_ID: TASK_ID_ID,
    }
    ids = tokenizer.convert_tokens_to_ids(list(expected))
    if not isinstance(ids, list):
        raise TypeError("convert_tokens_to_ids returned a single id for a list of tokens")
    actual = dict(zip(expected, ids, strict=True))
    wrong = {token: actual[token] for token, token_id in expected.items() if actual[token] != token_id}
    if wrong:
        raise ValueError(f"tokenizer does not have the CosyVoice2 vocabulary layout: {wrong}")


@dataclass(frozen=True)
class LengthBounds:
    """How many speech tokens the LLM must and may generate for one text."""

    min_new_tokens: int
    max_new_tokens: int


def length_bounds(
    target_text_tokens: int,
    *,
    min_token_text_ratio: float = 2.0,
    max_token_text_ratio: float = 20.0,
    max_new_tokens_cap: int | None = None,
) -> LengthBounds:
    """Generation bounds tied to the target text's token count, as upstream's CosyVoice2 LM does.

    Upstream computes ``int(n * 2)`` and ``int(n * 20)`` for ``n`` target text tokens; the cap
    bounds the audio of one request (25 tokens per second).
    """
    if target_text_tokens < 0:
        raise ValueError("target_text_tokens must be >= 0")
    if not 0 <= min_token_text_ratio <= max_token_text_ratio:
        raise ValueError("need 0 <= min_token_text_ratio <= max_token_text_ratio")
    maximum = int(target_text_tokens * max_token_text_ratio)
    if max_new_tokens_cap is not None:
        maximum = min(maximum, max_new_tokens_cap)
    minimum = min(int(target_text_tokens * min_token_text_ratio), maximum)
    return LengthBounds(min_new_tokens=minimum, max_new_tokens=maximum)


def _check_speech_token(token: int) -> None:
    if not 0 <= token < SPEECH_TOKEN_SIZE:
        raise ValueError(f"speech token {token} outside [0, {SPEECH_TOKEN_SIZE})")
