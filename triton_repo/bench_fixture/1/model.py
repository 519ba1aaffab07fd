"""Triton adapter for the benchmark fixture: the contract handling is shared, the tone is tts_backends.bench_fixture."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from numpy.typing import NDArray

from tts_backends.bench_fixture import FixtureConfig, ToneSource
from tts_backends.request_parsing import SpeechRequest
from tts_backends.triton_speech_model import Cancelled, SpeechContractModel


class TritonPythonModel(SpeechContractModel):
    def setup(self, params: dict[str, str]) -> None:
        self._tone = ToneSource(FixtureConfig.from_params(params))

    def synthesize(self, speech: SpeechRequest, cancelled: Cancelled) -> Iterator[NDArray[np.float32]]:
        yield from self._tone.synthesize(speech, cancelled)
