"""A tiny random-weight CosyVoice2 checkpoint in the real on-disk layout, for tests and demos.

``write_tiny_checkpoint(root)`` writes what ``tts-models download`` fetches,
with the same names, formats and state-dict keys, only with small dimensions (see
:mod:`.random_checkpoint`, which also writes the full-size one). Every loader of the real
checkpoint therefore runs unchanged on it, in about a second on CPU. The audio is noise-like:
the weights are random.
"""

from __future__ import annotations

from pathlib import Path

from tts_gateway.models.cosyvoice2.checkpoints import config_writer, tiny_frontend
from tts_gateway.models.cosyvoice2.checkpoints.random_checkpoint import (
    CheckpointSize,
    RandomCheckpoint,
    write_checkpoint,
)

TinyCheckpoint = RandomCheckpoint


def tiny_size() -> CheckpointSize:
    """Small dimensions, the real interfaces; the LLM stops where its random head says."""
    return CheckpointSize("tiny", config_writer.tiny_config(), tiny_frontend.tiny_llm_config())


def write_tiny_checkpoint(root: Path, *, seed: int = 0) -> TinyCheckpoint:
    """Write (or overwrite) the tiny checkpoint under ``root``; the same seed gives the same weights."""
    return write_checkpoint(root, tiny_size(), seed=seed)
