"""Triton adapter for the S3Tokenizer v2 ONNX model: 16 kHz reference -> speech tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from tts_gateway.models import contract
from tts_gateway.models.cosyvoice2 import tensors
from tts_gateway.models.cosyvoice2.model.frontend import AudioTokenizer
from tts_gateway.models.cosyvoice2.stage_models.reference_model import ReferenceAudioModel


class TritonPythonModel(ReferenceAudioModel):
    output = tensors.AUDIO_TOKENS_OUTPUT

    def setup(self, params: dict[str, str]) -> None:
        providers = contract.parse_list(params["providers"])
        self._tokenizer = AudioTokenizer(Path(params["model_dir"]) / params["onnx_file"], list(providers))

    def analyse(self, wav: NDArray[np.float32]) -> NDArray[Any]:
        return self._tokenizer.tokenize(wav).astype(np.int32)
