"""Streaming schedule of CosyVoice2: when the orchestrator has token2wav emit a chunk.

:class:`HopSchedule` decides how many new speech tokens each chunk converts. The first hop is
small (first-chunk latency is the headline number); later hops grow so that the flow model,
which re-runs over the whole prefix for every chunk, is called fewer times, and with
:attr:`HopSchedule.catch_up` a chunk takes a larger hop at once when the tokens for it have already
arrived. How the chunks are joined is :mod:`tts_gateway.models.cosyvoice2.model.hift_stream`. Plain
Python, free of torch, so the pipeline and its BLS stages import where torch is absent (the tests' Python 3.12 leg).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

DEFAULT_FIRST_HOP = 15
DEFAULT_BASE_HOP = 25
DEFAULT_PRE_LOOKAHEAD = 3
DEFAULT_TOKEN_RATE = 25.0


class HopPolicy(StrEnum):
    """How the hop (new tokens per chunk) evolves after the first chunk."""

    FIXED = "fixed"
    """Every chunk after the first converts ``base_hop`` tokens."""
    EXPONENTIAL = "exponential"
    """Chunk ``i >= 1`` converts ``base_hop * 2**(i - 1)`` tokens, optionally capped."""
    TIME_BASED = "time_based"
    """Hops grow in steps of ``first_hop`` only while synthesis runs well ahead of real time."""


@dataclass(frozen=True)
class HopSchedule:
    """Token hop sizes of a streamed request.

    ``pre_lookahead`` tokens beyond the hop must already exist before a chunk is emitted: the
    flow encoder looks that far ahead, so the mel of the hop's last token is final only then.
    """

    first_hop: int = DEFAULT_FIRST_HOP
    base_hop: int = DEFAULT_BASE_HOP
    policy: HopPolicy = HopPolicy.EXPONENTIAL
    max_hop: int | None = None
    pre_lookahead: int = DEFAULT_PRE_LOOKAHEAD
    token_rate: float = DEFAULT_TOKEN_RATE
    catch_up: bool = True
    """Size chunks after the first by the tokens that have arrived (:meth:`catch_up_hop`), and make
    the chunk after the LLM's last token the final one."""
    max_first_hop: int | None = None
    """Let the first hop grow up to this many tokens while streams wait long for their second chunk
    (:class:`~.first_hop.AdaptiveFirstHop`); None keeps it at ``first_hop``."""

    def __post_init__(self) -> None:
        if self.first_hop < 1 or self.base_hop < 1:
            raise ValueError("hops must be at least one token")
        if self.max_hop is not None and self.max_hop < max(self.first_hop, self.base_hop):
            raise ValueError("max_hop must not be smaller than first_hop or base_hop")
        if self.max_first_hop is not None and self.max_first_hop < self.first_hop:
            raise ValueError("max_first_hop must not be smaller than first_hop")
        if self.pre_lookahead < 0:
            raise ValueError("pre_lookahead must not be negative")
        if self.token_rate <= 0:
            raise ValueError("token_rate must be positive")
        object.__setattr__(self, "policy", HopPolicy(self.policy))

    def next_hop(
        self,
        chunk_index: int,
        *,
        emitted_tokens: int = 0,
        pending_tokens: int = 0,
        elapsed_s: float = 0.0,
    ) -> int:
        """Hop of chunk ``chunk_index`` (0-based).

        The keyword arguments only matter for :attr:`HopPolicy.TIME_BASED`: ``emitted_tokens``
        tokens (``chunk_index`` chunks) were converted in ``elapsed_s`` seconds of wall time and
        ``pending_tokens`` unconverted tokens are waiting now.
        """
        if chunk_index < 0:
            raise ValueError("chunk_index must not be negative")
        if chunk_index == 0:
            return self.first_hop
        if self.policy is HopPolicy.FIXED:
            hop = self.base_hop
        elif self.policy is HopPolicy.EXPONENTIAL:
            # Past the cap the exact power no longer matters; bounding it keeps the integer small.
            hop = self.base_hop * 2 ** min(chunk_index - 1, 32)
        else:
            hop = self._time_based_hop(chunk_index, emitted_tokens, pending_tokens, elapsed_s)
        return hop if self.max_hop is None else min(hop, self.max_hop)

    def _time_based_hop(self, chunks_done: int, emitted_tokens: int, pending_tokens: int, elapsed_s: float) -> int:
        if elapsed_s <= 0:
            return self.first_hop
        seconds_per_chunk = elapsed_s / chunks_done
        lead_s = emitted_tokens / self.token_rate - elapsed_s
        # How many more chunks could be synthesised before playback catches up with us.
        spare_chunks = lead_s / seconds_per_chunk
        whole_hops = pending_tokens // self.first_hop
        if spare_chunks > 4:
            hop = (whole_hops + 1) * self.first_hop
        elif spare_chunks > 2:
            hop = whole_hops * self.first_hop
        else:
            hop = self.first_hop
        return max(self.first_hop, hop)

    def catch_up_hop(self, hop: int, pending_tokens: int) -> int:
        """``hop``, or the largest later hop of the exponential schedule that arrived tokens cover.

        While a stream waits for token2wav, the LLM runs ahead of it. Every chunk re-runs the flow
        over the voice prompt and all tokens so far, so a stream that converts what has arrived in
        fewer, larger chunks costs the GPU less where it is short of time. The conversion starts
        when the scheduled hop's would have; a larger chunk takes a little longer (HiFT grows with
        it) but brings more audio. The hops stay on the schedule's ladder, ``hop`` doubling up to
        ``max_hop``: the chunk sizes HiFT's graphs are recorded for. ``pending_tokens`` counts the
        unconverted tokens, look-ahead included.
        """
        if not self.catch_up or self.policy is not HopPolicy.EXPONENTIAL:
            return hop
        usable = pending_tokens - self.pre_lookahead
        chosen = hop
        while chosen != self.max_hop:
            larger = chosen * 2 if self.max_hop is None else min(chosen * 2, self.max_hop)
            if larger > usable:
                break
            chosen = larger
        return chosen

    def chunk_end(self, token_offset: int, hop: int) -> int:
        """How many tokens a chunk of ``hop`` tokens after ``token_offset`` converts, look-ahead included:
        they must all have arrived before it is emitted."""
        return token_offset + hop + self.pre_lookahead
