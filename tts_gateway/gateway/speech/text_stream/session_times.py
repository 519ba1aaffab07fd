"""When a text-streaming session reached each of its first steps in the gateway, for the stage traces.

The models record where a stream's first chunk spends its time inside the server
(``tts_gateway/models/stage_trace.py``). A session over the WebSocket also spends time in the gateway
before the model sees it (its first words normalised, an admission slot, the opening request through
Triton's sequence batcher) and after (its audio's way back), which those records cannot show. With
``TTS_STAGE_TRACE_DIR`` set, each gateway process records these instants per session under the
Triton request id that opened it, which the orchestrator's record names too, so a benchmark can lay
the two side by side. All are ``time.monotonic()``, comparable across the processes of one machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from tts_gateway.models.stage_trace import StageTrace


@dataclass
class SessionTimes:
    """The first time a session reached each step (0 for a step not reached)."""

    text_in: float = 0.0
    """The context's first text reached the session (from the socket, cut into words)."""
    opening: float = 0.0
    """Its first piece normalised: the session waits for its slots, then its opening request goes."""
    opened: float = 0.0
    """The model holds the session."""
    first_taken: float = 0.0
    """The model took the first piece of text."""
    first_audio: float = 0.0
    """The first audio arrived from the model."""
    first_out: float = 0.0
    """The first audio went on towards the socket."""

    def record(self, trace: StageTrace, session_id: str, opening_request: str) -> None:
        trace.record(session_id, request=opening_request, **vars(self))
