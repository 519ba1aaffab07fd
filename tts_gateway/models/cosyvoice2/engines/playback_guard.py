"""How far ahead token2wav's queue looks to keep playing streams from running out of audio.

The queue converts new streams' first chunks before later chunks, so that first audio comes
soon. Under a load the GPU barely keeps up with, that lets a playing stream run dry: its next
chunk waits behind every group of first chunks, then for its own group, whose calls are all
answered when the group ends. The guard's horizon is how long a later chunk can still afford
to wait: one whose stream runs out of audio within it goes before the first chunks, and a later
group stops lending the GPU to first chunks between the halves of its solve.

A fixed horizon must suit every load. On the H100, 800 ms kept all of 64 streams in time, but at
16 streams a group takes 0.1-0.25 s, and a horizon that long put later chunks first nearly always:
16 streams' first audio doubled. The adaptive horizon is the time the queue has lately needed for
one group of first chunks and then one group of later chunks, the longest of each kind among the
last few groups: a later chunk lets a group of first chunks go first only while both still end
before its stream runs dry. It is short under a light load, where new streams keep their priority,
and grows with the groups under a heavy one. The window counts groups, not seconds: a burst after a
quiet spell meets the horizon its predecessors left, not none, and a heavy load's horizon stays
until a few lighter groups of each kind have replaced it.

The horizon leaves out two waits: offline calls that waited longer than a later chunk go before
it, and their groups are not counted; and a later chunk waiting while another later group lends
the GPU also waits for the rest of that group. Counting them makes the horizon longer, and with
both counted a 64-stream pass on the H100 had its first hop fall back to 25 tokens and new streams
wait seconds: shorter gaps to the second chunk tip the first hop that way (``first_hop.py``). So
they stay out (docs/TUNING.md, token2wav).
"""

from __future__ import annotations

from collections import deque
from typing import Final

# Groups of each kind whose durations the adaptive horizon follows.
_WINDOW: Final = 8


class PlaybackGuard:
    """A fixed horizon (``fixed_s``; 0 is off) or, with ``adaptive``, one learnt from :meth:`record`.

    Not thread-safe: the queue's worker thread alone records and asks.
    """

    def __init__(self, fixed_s: float = 0.0, *, adaptive: bool = False, window: int = _WINDOW) -> None:
        if fixed_s < 0:
            raise ValueError(f"a playback guard must not be negative, got {fixed_s} s")
        if adaptive and fixed_s:
            raise ValueError("a playback guard is either fixed or adaptive")
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self._fixed_s = fixed_s
        self._adaptive = adaptive
        self._firsts: deque[float] = deque(maxlen=window)
        self._later: deque[float] = deque(maxlen=window)

    @classmethod
    def parse(cls, value: str) -> PlaybackGuard:
        """``"auto"`` for the adaptive horizon, else milliseconds (``"0"``: off)."""
        text = value.strip().lower()
        if text == "auto":
            return cls(adaptive=True)
        try:
            milliseconds = int(text)
        except ValueError:
            raise ValueError(f"playback_guard_ms must be 'auto' or whole milliseconds, got {value!r}") from None
        return cls(milliseconds / 1000.0)

    def horizon_s(self) -> float:
        """Seconds ahead a stream is guarded from running dry; 0 while off or nothing has been measured."""
        if not self._adaptive:
            return self._fixed_s
        return max(self._firsts, default=0.0) + max(self._later, default=0.0)

    def record(self, seconds: float, *, later_chunks: bool) -> None:
        """A group of streams' later chunks (else of first chunks) took ``seconds`` to convert, time
        lent to other groups excluded."""
        (self._later if later_chunks else self._firsts).append(seconds)
