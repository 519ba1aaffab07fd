"""Triton adapter for Piper: the contract handling is shared, the voice is tts_gateway.models.piper."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from tts_gateway.allocator import release_free_memory
from tts_gateway.models import contract
from tts_gateway.models.piper import PiperEngine
from tts_gateway.models.piper.onnx_memory import tune_heap
from tts_gateway.models.request_parsing import SynthesisRequest
from tts_gateway.models.triton_speech_model import Cancelled, SpeechContractModel


class TritonPythonModel(SpeechContractModel):
    def setup(self, params: dict[str, str]) -> None:
        # This stub process is Piper's alone: its memory comes back when each request ends.
        tune_heap()
        self._engine = PiperEngine(
            Path(params["voice_model"]) if params.get("voice_model") else None,
            Path(params["voice_config"]) if params.get("voice_config") else None,
        )
        declared = int(params[contract.PARAM_SAMPLE_RATE])
        if self._engine.sample_rate != declared:
            raise ValueError(f"the voice runs at {self._engine.sample_rate} Hz, config says {declared}")
        # Loading copies the voice's graph a few times (~80 MiB freed in the heap by now).
        release_free_memory()

    def synthesize(self, speech: SynthesisRequest, cancelled: Cancelled) -> Iterator[NDArray[np.float32]]:
        # Piper synthesises a sentence when asked for its chunk: a cancelled request stops there.
        try:
            yield from self._engine.synthesize(speech.target_text, speed=speech.speed)
        finally:
            release_free_memory()
