"""The base of the two Triton models that read a reference recording: ``audio_tokenizer``, ``speaker_embedding``.

Imported only inside Triton (it needs ``triton_python_backend_utils``). Each request carries 16 kHz
audio (``reference_wav`` and its length) and gets one tensor back; bad input fails that request alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from numpy.typing import NDArray

from tts_gateway.models.cosyvoice2 import tensors
from tts_gateway.models.triton_model import TritonModel


class ReferenceAudioModel(TritonModel):
    """Subclasses set :attr:`output` and implement :meth:`setup` and :meth:`analyse`."""

    output: str

    def analyse(self, wav: NDArray[np.float32]) -> NDArray[Any]:
        """The output tensor for one reference recording."""
        raise NotImplementedError

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                result = self.analyse(
                    tensors.parse_reference_inputs(self.arrays(request, tensors.REFERENCE_INPUT_DTYPES))
                )
            except ValueError as exc:
                responses.append(self.error(str(exc), pb_utils.TritonError.INVALID_ARG))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(self.output, result)]))
        return responses
