"""Triton adapter for the CosyVoice2 orchestrator: contract tensors in, ``waveform`` out.

The logic is :class:`tts_gateway.models.cosyvoice2.orchestrator.pipeline.CosyVoice2Pipeline`; the contract
handling (tensors, streaming, cancellation, errors) is shared with the other speech models
in :mod:`tts_gateway.models.triton_speech_model`. Deployed as ``cosyvoice2`` (one response)
and ``cosyvoice2_stream`` (decoupled: one response per chunk, then the final flag).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from numpy.typing import NDArray
from transformers import AutoTokenizer

from tts_gateway.models import contract
from tts_gateway.models.cosyvoice2.model import vocab
from tts_gateway.models.cosyvoice2.orchestrator.llm_grpc import TritonLLMStreams, own_grpc_url
from tts_gateway.models.cosyvoice2.orchestrator.llm_server_client import LLMServerClient, LLMServerSettings
from tts_gateway.models.cosyvoice2.orchestrator.pipeline import CosyVoice2Pipeline, PipelineSettings
from tts_gateway.models.cosyvoice2.orchestrator.triton_stages import LLMSource, StageModels, TritonStages
from tts_gateway.models.request_parsing import SynthesisRequest
from tts_gateway.models.stage_trace import StageTrace
from tts_gateway.models.triton_speech_model import Cancelled, SpeechContractModel

SAMPLE_RATE = 24_000


class TritonPythonModel(SpeechContractModel):
    def setup(self, params: dict[str, str]) -> None:
        if int(params[contract.PARAM_SAMPLE_RATE]) != SAMPLE_RATE:
            raise ValueError(f"CosyVoice2 produces {SAMPLE_RATE} Hz; config says {params['sample_rate']}")
        tokenizer = AutoTokenizer.from_pretrained(params["llm_dir"])
        vocab.check_tokenizer_layout(tokenizer)
        # The LLM runs in this Triton (`llm_model`, reached over its gRPC endpoint) or on
        # OpenAI-compatible servers (`llm_urls`).
        server = LLMServerSettings.from_parameters(params, max_connections=int(params["stream_workers"]))
        if (server is None) == (not params["llm_model"]):
            raise ValueError("set exactly one of llm_model (a Triton model) and llm_urls (LLM servers)")
        self._llm: LLMSource = (
            TritonLLMStreams(own_grpc_url(), params["llm_model"])
            if server is None
            else LLMServerClient(server, tokenizer)
        )
        stages = TritonStages(
            StageModels(
                audio_tokenizer=params["audio_tokenizer_model"],
                speaker_embedding=params["speaker_embedding_model"],
                token2wav=params["token2wav_model"],
            ),
            self._llm,
        )
        self._pipeline = CosyVoice2Pipeline(
            stages, tokenizer, PipelineSettings.from_parameters(params), StageTrace.from_env("orchestrator")
        )

    def finalize(self) -> None:
        super().finalize()
        self._llm.close()

    def synthesize(self, speech: SynthesisRequest, cancelled: Cancelled) -> Iterator[NDArray[np.float32]]:
        # Stream workers only wait on the stage models, which do the heavy work in their own processes.
        return self._pipeline.synthesize(speech, streaming=self.decoupled, is_cancelled=cancelled)
