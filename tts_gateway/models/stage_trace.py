"""Per-request stage timestamps that the CosyVoice2 models record: where a first chunk's time goes.

The models themselves record (the orchestrator, the LLM and token2wav), so it lives with them;
the benchmarks (``benchmarks/gpu_stages.py``, ``benchmarks/gpu_floors.py``) only read the records.

Off unless ``TTS_STAGE_TRACE_DIR`` names a directory in the server's environment; then every
process that records appends JSON lines to ``<dir>/<stage>-<pid>.jsonl``: one object per event
with the stage, a key (the Triton request id or a token2wav session id) and ``time.monotonic()``
timestamps, which are comparable across the processes of one machine. The benchmark joins them.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import IO, Final, TypeAlias

ENV_VAR: Final = "TTS_STAGE_TRACE_DIR"
# A recorded field: a timestamp, count or name, or a series of timestamps (or of spans between two).
TraceValue: TypeAlias = float | int | str | list[float] | list[list[float]]


def trace_servers_into(directory: Path) -> None:
    """Have the servers this process starts from now on record into ``directory``, emptied first so that
    its records are theirs alone."""
    shutil.rmtree(directory, ignore_errors=True)
    os.environ[ENV_VAR] = str(directory)


class StageTrace:
    """Appends one JSON line per :meth:`record`; does nothing when disabled."""

    def __init__(self, stage: str, directory: Path | None) -> None:
        self.stage = stage
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self._file = (directory / f"{stage}-{os.getpid()}.jsonl").open("a", encoding="utf-8", buffering=1)

    @classmethod
    def from_env(cls, stage: str) -> StageTrace:
        directory = os.environ.get(ENV_VAR)
        return cls(stage, Path(directory) if directory else None)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def record(self, key: str, **fields: TraceValue) -> None:
        if self._file is None:
            return
        line = json.dumps({"stage": self.stage, "key": key, **fields})
        with self._lock:
            self._file.write(line + "\n")


def read_traces(directory: Path) -> list[dict[str, object]]:
    """Every event recorded under ``directory``."""
    events: list[dict[str, object]] = []
    for path in sorted(directory.glob("*.jsonl")):
        events.extend(json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line)
    return events
