"""A stream's first hop, sized by how long streams have lately waited for their second chunk.

A first chunk of ``first_hop`` tokens plays for ``first_hop / token_rate`` seconds, less the
cross-fade tail it withholds (0.16 s at 24 kHz): 0.84 s for 25 tokens. A listener hears a gap
when the stream's next chunk takes longer than that to follow. With few streams it follows well
within it (0.37 s p50, 0.47 s p90 at 16 streams on an H100); when token2wav is busy with many
streams it does not (0.9 s p50, 1.3-1.6 s p90 at 64 closed-loop streams, where 71-124 of 128
streams stalled). A first chunk of 50 tokens (1.84 s) covers that, for a later first audio: 25
more decode steps. Always 50 would cost few streams first audio they need not lose.

So the orchestrator keeps the gaps its streams recently had between their first and second
chunk (:meth:`AdaptiveFirstHop.record`), and gives each new stream the smallest first hop on the
ladder ``first_hop, 2 x first_hop, ...`` up to ``max_first_hop`` whose audio covers the longest
of them (:meth:`AdaptiveFirstHop.choose`). Gaps older than ``horizon_s`` are forgotten, so the
first hop falls back once the load has gone. token2wav serves every orchestrator process of a
server alike, so each process measures the same load from its own streams, without any state
shared between them. It reacts to a load it has seen: the streams of a sudden jump from few to
many start with the small hop, and the first of them may stall.

Plain Python, free of torch (as :mod:`.streaming`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

# The cross-fade tail a non-final chunk withholds (hift_stream.py: 3840 samples at 24 kHz).
DEFAULT_WITHHELD_S = 0.16


class AdaptiveFirstHop:
    """First hops chosen from recent gaps to the second chunk; thread-safe (one per orchestrator)."""

    def __init__(
        self,
        first_hop: int,
        max_first_hop: int,
        *,
        token_rate: float = 25.0,
        withheld_s: float = DEFAULT_WITHHELD_S,
        window: int = 16,
        horizon_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if first_hop < 1 or max_first_hop < first_hop:
            raise ValueError("need 1 <= first_hop <= max_first_hop")
        if token_rate <= 0 or withheld_s < 0 or window < 1 or horizon_s <= 0:
            raise ValueError("token_rate, window and horizon_s must be positive, withheld_s not negative")
        self.ladder = [first_hop]
        while self.ladder[-1] * 2 <= max_first_hop:
            self.ladder.append(self.ladder[-1] * 2)
        if self.ladder[-1] != max_first_hop:
            self.ladder.append(max_first_hop)
        self._token_rate = token_rate
        self._withheld_s = withheld_s
        self._horizon_s = horizon_s
        self._clock = clock
        self._gaps: deque[tuple[float, float]] = deque(maxlen=window)
        self._lock = threading.Lock()

    def audio_s(self, hop: int) -> float:
        """Seconds a first chunk of ``hop`` tokens plays."""
        return hop / self._token_rate - self._withheld_s

    def record(self, gap_s: float) -> None:
        """A stream's second chunk was ready ``gap_s`` seconds after its first."""
        with self._lock:
            self._gaps.append((self._clock(), gap_s))

    def choose(self) -> int:
        """The first hop for a stream starting now."""
        with self._lock:
            oldest = self._clock() - self._horizon_s
            while self._gaps and self._gaps[0][0] < oldest:
                self._gaps.popleft()
            need = max((gap for _, gap in self._gaps), default=0.0)
        return next((hop for hop in self.ladder if self.audio_s(hop) >= need), self.ladder[-1])
