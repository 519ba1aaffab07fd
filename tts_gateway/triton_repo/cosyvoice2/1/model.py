"""Triton adapter for the CosyVoice2 orchestrator: the pipeline and its LLM source built from the config's parameters.

Serving them (offline, streamed, and text streamed in as sessions) is
:class:`tts_gateway.models.cosyvoice2.orchestrator.cosyvoice2_model.CosyVoice2Model`.
"""

from __future__ import annotations

from transformers import AutoTokenizer

from tts_gateway.models import contract
from tts_gateway.models.cosyvoice2.model import vocab
from tts_gateway.models.cosyvoice2.orchestrator.cosyvoice2_model import CosyVoice2Model
from tts_gateway.models.cosyvoice2.orchestrator.llm_grpc import TritonLLMStreams, own_grpc_url
from tts_gateway.models.cosyvoice2.orchestrator.llm_server_client import LLMServerClient, LLMServerSettings
from tts_gateway.models.cosyvoice2.orchestrator.pipeline import CosyVoice2Pipeline, PipelineSettings
from tts_gateway.models.cosyvoice2.orchestrator.triton_stages import LLMSource, StageModels, TritonStages
from tts_gateway.models.stage_trace import StageTrace

SAMPLE_RATE = 24_000


class TritonPythonModel(CosyVoice2Model):
    def load(self, params: dict[str, str]) -> tuple[CosyVoice2Pipeline, LLMSource]:
        if int(params[contract.PARAM_SAMPLE_RATE]) != SAMPLE_RATE:
            raise ValueError(f"CosyVoice2 produces {SAMPLE_RATE} Hz; config says {params['sample_rate']}")
        tokenizer = AutoTokenizer.from_pretrained(params["llm_dir"])
        vocab.check_tokenizer_layout(tokenizer)
        # The LLM runs in this Triton (`llm_model`, reached over its gRPC endpoint) or on
        # OpenAI-compatible servers (`llm_urls`).
        server = LLMServerSettings.from_parameters(params, max_connections=int(params["stream_workers"]))
        if (server is None) == (not params["llm_model"]):
            raise ValueError("set exactly one of llm_model (a Triton model) and llm_urls (LLM servers)")
        llm: LLMSource = (
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
            llm,
            text_streams=llm.send_text if isinstance(llm, TritonLLMStreams) else None,
        )
        pipeline = CosyVoice2Pipeline(
            stages, tokenizer, PipelineSettings.from_parameters(params), StageTrace.from_env("orchestrator")
        )
        return pipeline, llm
