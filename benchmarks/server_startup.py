"""Where a Triton server's start went, from its log: when each model finished loading, and the load phases
the backends logged meanwhile (weights, compiles, CUDA-graph recording; ``tts_gateway/models/triton_logging.py``
writes them there)."""

from __future__ import annotations

import re

# Triton's log lines: "I1125 19:41:49.354058 668 file.cc:123] message", the message often in quotes. A line
# may start elsewhere in a line of the log: a model process's progress bar (written without a newline,
# as transformers' "Loading weights" is) runs on into the next record.
_LINE = re.compile(r'[IWE]\d{4} (\d\d):(\d\d):(\d\d(?:\.\d+)?) +\d+ [^\]]+\] "?(.*?)"?$')
_LOADED = re.compile(r"successfully loaded '([^']+)'")
# What tts_gateway.models.triton_logging writes: "<model>: <logger name>: <message>".
_BACKEND = re.compile(r"^([\w.-]+): tts_gateway.models\.[\w.]+: (.*)$")


def load_timeline(log_text: str) -> list[str]:
    """The start as lines ``+S s model: what happened``, timed from the log's first line: the backends'
    load records and each model's "loaded"."""
    events: list[str] = []
    first: float | None = None
    for line in log_text.splitlines():
        match = _LINE.search(line)
        if match is None:
            continue
        hours, minutes, seconds, message = match.groups()
        at = 3600 * int(hours) + 60 * int(minutes) + float(seconds)
        if first is None:
            first = at
        elapsed = (at - first) % 86400
        loaded = _LOADED.search(message)
        backend = _BACKEND.match(message)
        if loaded is not None:
            events.append(f"+{elapsed:.0f} s {loaded.group(1)}: loaded")
        elif backend is not None:
            events.append(f"+{elapsed:.0f} s {backend.group(1)}: {backend.group(2)}")
    return events
