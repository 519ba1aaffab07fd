"""The LLM stage on PyTorch: speech-token generation from a CosyVoice2 HF directory.

It serves the same contract as the TensorRT-LLM engine (input ids, output length, end ids,
sampling parameters) where no engine is available: on the GPU with continuous batching and CUDA
graphs (:mod:`~tts_gateway.models.cosyvoice2.engines.llm_engine`), on the CPU with the same code run eagerly.
Sampling is restricted to the speech tokens and the stop ids, so every id produced is a valid
speech token; stop ids end the generation and are not yielded.

Upstream's HF conversion (``pretrained_to_huggingface.py``) gives ``lm_head`` a bias (its
``llm_decoder`` bias, -inf on the text rows) that ``Qwen2ForCausalLM`` does not have; when the
checkpoint holds ``lm_head.bias`` the head is built with a bias so that it is loaded, not dropped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch
from safetensors import safe_open
from transformers import Qwen2Config, Qwen2ForCausalLM

from tts_gateway.models.cosyvoice2.engines.llm_decoder import DEFAULT_SPANS, SlotDecoder
from tts_gateway.models.cosyvoice2.engines.llm_engine import (
    COLUMN_IDS,
    DEFAULT_BUCKETS,
    BatchingEngine,
    Generation,
    GenerationHandle,
    StepGate,
    TextStreamHandle,
    TokenSink,
    generate,
)
from tts_gateway.models.cosyvoice2.model import vocab

_log = logging.getLogger(__name__)
_DTYPES: Final = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WEIGHTS_FILE: Final = "model.safetensors"
_WEIGHTS_INDEX: Final = "model.safetensors.index.json"
_HEAD_BIAS: Final = "lm_head.bias"
_STOP_CANDIDATES: Final = frozenset(range(vocab.EOS1_ID, vocab.TOKENIZER_SIZE))


@dataclass(frozen=True)
class SamplingParams:
    """Sampling of one request; upstream triton_trtllm's values are the defaults.

    ``temperature`` 0 means greedy decoding, ``top_k`` 0 disables top-k, ``top_p`` 1 disables
    nucleus sampling, ``repetition_penalty`` 1 disables the penalty. ``seed`` None draws a fresh one.
    """

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 50
    repetition_penalty: float = 1.1
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


class TorchSpeechLLM:
    """A CosyVoice2 LLM (Qwen2 with the extended vocabulary) on one torch device, batching its requests.

    Requests run through a :class:`~tts_gateway.models.cosyvoice2.engines.llm_engine.BatchingEngine`: ``max_slots``
    requests decode together over a static KV cache of ``max_seq_len`` positions each (a step reads
    the smallest of ``spans`` positions that holds its rows), with CUDA
    graphs on a CUDA device unless ``cuda_graphs`` says otherwise; a ``compile_backend`` ("inductor" on
    GPUs) compiles the decoder's regions and the sampler at load, before the graphs are recorded.
    :meth:`submit` streams tokens to a sink (the Triton model); :meth:`generate` is the same as a
    blocking iterator.
    """

    def __init__(
        self,
        hf_dir: Path,
        device: str = "cpu",
        dtype: str = "float32",
        *,
        max_slots: int = 8,
        max_seq_len: int = 2048,
        cuda_graphs: bool | None = None,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        gate: StepGate | None = None,
        compile_backend: str = "",
        spans: Sequence[int] = DEFAULT_SPANS,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if max_slots < 1 or max_seq_len < 2:
            raise ValueError("max_slots must be at least 1 and max_seq_len at least 2")
        config = Qwen2Config.from_pretrained(hf_dir)
        if config.vocab_size < vocab.TOKENIZER_SIZE:
            raise ValueError(f"{hf_dir}: vocab_size {config.vocab_size} lacks the speech tokens")
        model_class = _Qwen2WithHeadBias if _has_head_bias(hf_dir) else Qwen2ForCausalLM
        started = time.monotonic()
        model = model_class.from_pretrained(hf_dir, config=config, dtype=_DTYPES[dtype])
        self._device = torch.device(device)
        model = model.to(self._device).eval()
        _log.info("LLM weights loaded onto %s in %.1f s", self._device, time.monotonic() - started)
        self.vocab_size: int = config.vocab_size
        decoder = SlotDecoder(
            model,
            slots=max_slots,
            max_len=max_seq_len,
            columns=torch.tensor(COLUMN_IDS, dtype=torch.long),
            spans=spans,
        )
        graphs = self._device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.engine = BatchingEngine(
            decoder, cuda_graphs=graphs, buckets=buckets, gate=gate, compile_backend=compile_backend
        )

    def close(self) -> None:
        """Stop the engine; requests still in flight end with an error."""
        self.engine.stop()

    def request(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        stop_ids: Sequence[int],
    ) -> Generation:
        """A validated :class:`Generation`; raises ValueError for ids, lengths or stops it cannot serve.

        Stop ids cannot be drawn before ``min_new_tokens`` ids were produced; at most
        ``max_new_tokens`` ids are produced.
        """
        if not input_ids:
            raise ValueError("input_ids is empty")
        if min(input_ids) < 0 or max(input_ids) >= self.vocab_size:
            raise ValueError(f"input ids must lie in [0, {self.vocab_size})")
        if not 0 <= min_new_tokens <= max_new_tokens:
            raise ValueError("need 0 <= min_new_tokens <= max_new_tokens")
        stops = frozenset(stop_ids)
        if not stops <= _STOP_CANDIDATES:
            raise ValueError(f"stop ids must be among the non-speech ids {sorted(_STOP_CANDIDATES)}: {sorted(stops)}")
        return Generation(
            input_ids=tuple(int(i) for i in input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            stop_ids=stops,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            repetition_penalty=params.repetition_penalty,
            seed=params.seed,
        )

    def open_stream(
        self,
        prompt_text_ids: Sequence[int],
        prompt_speech_ids: Sequence[int],
        params: SamplingParams,
        *,
        max_new_tokens: int,
        stop_ids: Sequence[int],
        sink: TokenSink,
    ) -> TextStreamHandle:
        """Start a generation whose text arrives through the handle (``add_text``, ``end_text``).

        ``prompt_text_ids`` is the voice's transcript, ``prompt_speech_ids`` its speech tokens as LLM ids
        (see :mod:`~tts_gateway.models.cosyvoice2.engines.llm_bistream`); at most ``max_new_tokens``
        speech ids are produced in all.
        """
        request = self.request(
            [*prompt_text_ids, *prompt_speech_ids] or [vocab.SOS_ID],
            params,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_ids,
        )
        if any(vocab.id_to_speech_token(i) is None for i in prompt_speech_ids):
            raise ValueError("prompt_speech_ids must be speech-token ids")
        stream = dataclasses.replace(request, input_ids=tuple(int(i) for i in prompt_speech_ids))
        return self.engine.open_stream(stream, [int(i) for i in prompt_text_ids], sink)

    def submit(self, request: Generation, sink: TokenSink) -> GenerationHandle:
        """Start ``request``; its tokens go to ``sink`` from the engine's thread."""
        return self.engine.submit(request, sink)

    def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        stop_ids: Sequence[int],
    ) -> Iterator[int]:
        """Yield generated speech-token ids one at a time; a stop id (not yielded) ends the stream."""
        request = self.request(
            input_ids, params, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, stop_ids=stop_ids
        )
        if max_new_tokens == 0:
            return iter(())
        return generate(self.engine, request)


class _Qwen2WithHeadBias(Qwen2ForCausalLM):
    """Qwen2 whose ``lm_head`` has a bias, as upstream's HF conversion of CosyVoice2 writes it."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)


def _has_head_bias(hf_dir: Path) -> bool:
    index = hf_dir / _WEIGHTS_INDEX
    if index.is_file():
        return _HEAD_BIAS in json.loads(index.read_text())["weight_map"]
    with safe_open(str(hf_dir / _WEIGHTS_FILE), framework="pt") as weights:
        return _HEAD_BIAS in weights.keys()  # noqa: SIM118 - safe_open is not a mapping
