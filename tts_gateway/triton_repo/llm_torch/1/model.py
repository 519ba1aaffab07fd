"""Triton adapter for the CosyVoice2 speech LLM on PyTorch: the LLM built from the config's parameters.

Serving it (continuous batching, streamed ids, text streams, cancellation) is
:class:`tts_gateway.models.cosyvoice2.stage_models.llm_model.LLMModel`.
"""

from __future__ import annotations

from pathlib import Path

from tts_gateway.models.cosyvoice2.engines.gpu_turns import YieldToFirstChunks
from tts_gateway.models.cosyvoice2.engines.llm import TorchSpeechLLM
from tts_gateway.models.cosyvoice2.stage_models.llm_model import LLMModel


class TritonPythonModel(LLMModel):
    def load(self, params: dict[str, str], gate: YieldToFirstChunks | None) -> TorchSpeechLLM:
        graphs = params["cuda_graphs"].lower()
        return TorchSpeechLLM(
            Path(params["llm_dir"]),
            device=params["device"],
            dtype=params["dtype"],
            max_slots=int(params["max_slots"]),
            max_seq_len=int(params["max_seq_len"]),
            cuda_graphs=None if graphs == "auto" else graphs == "true",
            compile_backend=params["compile_backend"],
            gate=gate,
        )
