"""A stream's first hop, sized by how long streams have lately waited for their second chunk.

A first chunk of ``first_hop`` tokens plays for ``first_hop / token_rate`` seconds, less the
cross-fade tail it withholds (0.16 s at 24 kHz): 0.84 s for 25 tokens. A listener hears a gap
when the stream's next chunk takes longer than that to follow. With few streams it follows well
within it (0.37 s p50, 0.47 s p90 at 16 streams on an H100); when token2wav is busy with many
streams it does not (0.9 s p50, 1.3-1.6 s p90 at 64 closed-loop streams, where 71-124 of 128
streams stalled). A first chunk of 50 tokens (1.84 s) covers that, for a later first audio: 25
more decode steps. Always 50 would cost few streams first audio they need not lose.

So the orchestrator sizes each stream's first chunk from what its own streams lately met. It
keeps the last ``window`` gaps between a stream's first and second chunk, each with the number
of streams it had in flight then (:meth:`AdaptiveFirstHop.record`). The wait grows with the
streams token2wav serves, though less than in proportion (a group of 32 calls converts in about
four times a single call's time, and part of the gap is the LLM's): on the H100 the upper
quartile of the gaps was 0.13-0.34 s with 1 stream per orchestrator process, 0.43-0.56 s with
4, 1.1-1.2 s with 8 and 1.1-1.9 s with 16, close to the square root of the streams. So a gap
seen with ``n`` streams predicts ``gap x (now / n) ** load_exponent`` (0.5) with ``now``
streams in flight. That follows a load that rises (a burst after quiet) or falls (a quiet
server after a burst), where old gaps alone would keep a burst's first streams on the small hop
and a quiet server on the large one; scaled in proportion instead, the gaps of 4 streams sent
16 streams to the large hop for no gain (first audio 419 ms p50 against 289-335). A stream
takes the smallest hop on the ladder ``first_hop, 2 x first_hop, ...`` up to ``max_first_hop``
whose audio covers the upper quartile of those predictions (:meth:`AdaptiveFirstHop.choose`);
the orchestrator asks again when the first chunk's tokens have arrived, so the streams of a
burst see each other. token2wav serves every orchestrator process of a server alike, and
Triton spreads streams evenly over them, so each process measures the load from its own
streams, without any state shared between processes.

A known weakness: token2wav takes later chunks in the order their streams run out of audio, so the
gap also depends on the hop itself (on the H100, p75 0.56-0.73 s after 25 tokens and 0.99-1.51 s
after 50, rising only mildly with the load). Gaps measured on one hop tend to keep it there: the
staggered tail of a 64-stream pass can leave short gaps, and the next burst of 64 then begins on 25
tokens. A measure of load that the hop does not itself change would avoid that.

Plain Python, free of torch (as :mod:`.streaming`).
"""

from __future__ import annotations

import math
import threading
from collections import deque

# The cross-fade tail a non-final chunk withholds (hift_stream.py: 3840 samples at 24 kHz).
DEFAULT_WITHHELD_S = 0.16


class AdaptiveFirstHop:
    """First hops chosen from recent gaps to the second chunk; thread-safe (one per orchestrator).

    A stream calls :meth:`begin` when it starts (counted in flight until :meth:`end`), :meth:`record`
    once its second chunk is ready and :meth:`choose` whenever it may still change its first hop.
    """

    def __init__(
        self,
        first_hop: int,
        max_first_hop: int,
        *,
        token_rate: float = 25.0,
        withheld_s: float = DEFAULT_WITHHELD_S,
        window: int = 16,
        load_exponent: float = 0.5,
    ) -> None:
        if first_hop < 1 or max_first_hop < first_hop:
            raise ValueError("need 1 <= first_hop <= max_first_hop")
        if token_rate <= 0 or withheld_s < 0 or window < 1 or load_exponent < 0:
            raise ValueError("token_rate and window must be positive, withheld_s and load_exponent not negative")
        self.ladder = [first_hop]
        while self.ladder[-1] * 2 <= max_first_hop:
            self.ladder.append(self.ladder[-1] * 2)
        if self.ladder[-1] != max_first_hop:
            self.ladder.append(max_first_hop)
        self._token_rate = token_rate
        self._withheld_s = withheld_s
        self._load_exponent = load_exponent
        # (gap, streams in flight when it was recorded)
        self._gaps: deque[tuple[float, int]] = deque(maxlen=window)
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def audio_s(self, hop: int) -> float:
        """Seconds a first chunk of ``hop`` tokens plays."""
        return hop / self._token_rate - self._withheld_s

    def begin(self) -> int:
        """Count a starting stream in flight; returns its first hop."""
        with self._lock:
            self._in_flight += 1
            return self._choose_locked()

    def end(self) -> None:
        """A stream counted by :meth:`begin` has ended."""
        with self._lock:
            if self._in_flight == 0:
                raise RuntimeError("end() without a stream in flight")
            self._in_flight -= 1

    def record(self, gap_s: float) -> None:
        """A stream's second chunk was ready ``gap_s`` seconds after its first."""
        with self._lock:
            self._gaps.append((gap_s, max(1, self._in_flight)))

    def choose(self) -> int:
        """The first hop for a stream with the streams in flight now."""
        with self._lock:
            return self._choose_locked()

    def _choose_locked(self) -> int:
        now = max(1, self._in_flight)
        predicted = sorted(gap * (now / streams) ** self._load_exponent for gap, streams in self._gaps)
        need = predicted[math.ceil(0.75 * len(predicted)) - 1] if predicted else 0.0
        return next((hop for hop in self.ladder if self.audio_s(hop) >= need), self.ladder[-1])
