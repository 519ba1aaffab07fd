"""Triton adapter for the benchmark fixture: the contract handling is shared, the tone is tts_gateway.bench."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from numpy.typing import NDArray

from tts_gateway.bench.fixture import FixtureConfig, ToneSource
from tts_gateway.models.request_parsing import SynthesisRequest
from tts_gateway.models.triton_speech_model import Cancelled, SpeechContractModel


class TritonPythonModel(SpeechContractModel):
    def setup(self, params: dict[str, str]) -> None:
        self._tone = ToneSource(FixtureConfig.from_params(params))

    def synthesize(self, speech: SynthesisRequest, cancelled: Cancelled) -> Iterator[NDArray[np.float32]]:
        yield from self._tone.synthesize(speech, cancelled)
