"""The input layout of a CosyVoice2 generation whose text arrives in pieces (the paper's "bistream" mode).

CosyVoice2's LLM was trained on sequences that interleave text and speech: ``<|sos|>``, then rounds
of 5 text tokens and 15 speech tokens, each round's speech closed by the fill token (``<|eos3|>``
in the HF vocabulary, row ``speech_token_size + 2`` of upstream's ``llm_decoder``), and once the text
is complete its rest, ``<|task_id|>`` and speech up to ``<|eos1|>``. The fill token is a target
only: the next round's text follows the last speech token directly.

:class:`BistreamLayout` decides what the LLM is fed, following upstream's ``Qwen2LM.inference_bistream``
token for token (its frontend hands the text over one token at a time, so a round starts as soon
as 5 text tokens are there):

- the prompt's text starts the text queue; the prompt's speech tokens are interleaved with it,
  15 per 5 text tokens, before anything is generated;
- when the prompt's speech is used up, the LLM generates until it draws the fill token; from then
  on the fill is forced after every 15 speech tokens, and each round needs 5 more text tokens;
- when text runs out before its end is signalled, the generation waits;
- after the end, the queued text and ``<|task_id|>`` follow, and the LLM generates to a stop id.
  Upstream appends them to the input of its last forward pass again (that input is already in the
  cache, so it is fed twice), and the model is served here as upstream serves it. Prompt speech
  not interleaved by then is dropped, as upstream does.

The layout is plain host bookkeeping; the engine (:mod:`.llm_engine`) feeds what it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Final

from tts_gateway.models.cosyvoice2.model import vocab

FILL_ID: Final = vocab.EOS3_ID
TEXT_PER_ROUND: Final = 5
SPEECH_PER_ROUND: Final = 15


class Stage(Enum):
    """What the generation does now."""

    WAITING = "waiting"  # needs more text (or its end) before anything can be fed
    ROUND = "round"  # generating speech up to the next fill token
    FINAL = "final"  # the text is complete: generating up to a stop id
    DONE = "done"


class BistreamLayout:
    """Upstream's bistream input schedule for one generation; every id is an LLM vocabulary id."""

    def __init__(self, prompt_text_ids: Sequence[int], prompt_speech_ids: Sequence[int]) -> None:
        self._text: list[int] = list(prompt_text_ids)
        self._prompt_speech: list[int] = list(prompt_speech_ids)
        self._ended = False
        # Upstream's ``lm_input``: accumulated and not yet fed until the first forward pass, then the
        # input of the latest one.
        self._lm_input: list[int] = [vocab.SOS_ID]
        self._decoded = False
        # Ids upstream has fed that the engine has not: the 15th speech token of a round, whose forward
        # pass upstream runs only to replace its draw by the forced fill.
        self._owed: list[int] = []
        self._since_fill: int | None = None
        self.stage = Stage.WAITING

    @property
    def text_complete(self) -> bool:
        return self._ended

    def add_text(self, ids: Sequence[int]) -> None:
        if self._ended:
            raise ValueError("text added after its end")
        if any(not 0 <= i < vocab.TEXT_VOCAB_SIZE for i in ids):
            raise ValueError(f"text token ids must lie in [0, {vocab.TEXT_VOCAB_SIZE})")
        self._text.extend(int(i) for i in ids)

    def end_text(self) -> None:
        self._ended = True

    def next_feed(self) -> list[int] | None:
        """The ids to append to the cache before the next draw, or None while more text is needed.

        Only called while :attr:`stage` is WAITING; moves it to ROUND or FINAL when it returns ids.
        """
        assert self.stage is Stage.WAITING
        while self._prompt_speech and len(self._text) >= TEXT_PER_ROUND:
            self._lm_input += self._take_text(TEXT_PER_ROUND) + self._prompt_speech[:SPEECH_PER_ROUND]
            del self._prompt_speech[:SPEECH_PER_ROUND]
        if not self._prompt_speech:
            needs_text = self._decoded or len(self._lm_input) == 1
            if not needs_text:
                return self._start(Stage.ROUND, [])
            if len(self._text) >= TEXT_PER_ROUND:
                return self._start(Stage.ROUND, self._take_text(TEXT_PER_ROUND))
        if not self._ended:
            return None
        return self._start(Stage.FINAL, [*self._take_text(len(self._text)), vocab.TASK_ID_ID])

    def on_token(self, token_id: int) -> bool:
        """Account for a drawn id; returns whether it is a speech token to pass on.

        A fill (drawn or forced after the 15th speech token) ends the round: :attr:`stage` is WAITING
        again. A stop id in the final stage ends the generation (DONE).
        """
        if self.stage is Stage.FINAL:
            if vocab.id_to_speech_token(token_id) is None:
                self.stage = Stage.DONE
                return False
            self._lm_input = [token_id]
            return True
        assert self.stage is Stage.ROUND
        if token_id == FILL_ID:
            self._since_fill = 0
            self.stage = Stage.WAITING
            return False
        self._lm_input = [token_id]
        if self._since_fill is not None:
            self._since_fill += 1
            if self._since_fill == SPEECH_PER_ROUND:
                self._owed = [token_id]
                self._since_fill = 0
                self.stage = Stage.WAITING
        return True

    def _start(self, stage: Stage, ids: list[int]) -> list[int]:
        if self._decoded and stage is Stage.ROUND:
            self._lm_input = ids
        else:
            self._lm_input = [*self._lm_input, *ids]
        feed = [*self._owed, *self._lm_input] if self._decoded else list(self._lm_input)
        self._owed = []
        self._decoded = True
        self.stage = stage
        return feed

    def _take_text(self, count: int) -> list[int]:
        taken = self._text[:count]
        del self._text[:count]
        return taken
