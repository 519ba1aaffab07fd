"""The LLM stage on PyTorch: speech-token generation from a CosyVoice2 HF directory.

It serves the same contract as the TensorRT-LLM engine (input ids, output length, end ids,
sampling parameters) where no engine is available, on CPU and in tests. Generation is
incremental over the KV cache and yields one id at a time. Sampling is restricted to the speech
tokens and the stop ids, so every id produced is a valid speech token; stop ids end the
generation and are not yielded.

Upstream's HF conversion (``pretrained_to_huggingface.py``) gives ``lm_head`` a bias (its
``llm_decoder`` bias, -inf on the text rows) that ``Qwen2ForCausalLM`` does not have; when the
checkpoint holds ``lm_head.bias`` the head is built with a bias so that it is loaded, not dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch
from safetensors import safe_open
from transformers import Qwen2Config, Qwen2ForCausalLM

from . import vocab

_DTYPES: Final = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WEIGHTS_FILE: Final = "model.safetensors"
_WEIGHTS_INDEX: Final = "model.safetensors.index.json"
_HEAD_BIAS: Final = "lm_head.bias"


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
    """A CosyVoice2 LLM (Qwen2 with the extended vocabulary) on one torch device."""

    def __init__(self, hf_dir: Path, device: str = "cpu", dtype: str = "float32") -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        config = Qwen2Config.from_pretrained(hf_dir)
        if config.vocab_size < vocab.TOKENIZER_SIZE:
            raise ValueError(f"{hf_dir}: vocab_size {config.vocab_size} lacks the speech tokens")
        model_class = _Qwen2WithHeadBias if _has_head_bias(hf_dir) else Qwen2ForCausalLM
        model = model_class.from_pretrained(hf_dir, config=config, dtype=_DTYPES[dtype])
        self._device = torch.device(device)
        self._model = model.to(self._device).eval()
        self.vocab_size: int = config.vocab_size
        self._speech_ids = torch.arange(
            vocab.SPEECH_TOKEN_OFFSET, vocab.SPEECH_TOKEN_OFFSET + vocab.SPEECH_TOKEN_SIZE, device=self._device
        )

    def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        stop_ids: Sequence[int],
    ) -> Iterator[int]:
        """Yield generated speech-token ids one at a time; a stop id (not yielded) ends the stream.

        Stop ids cannot be drawn before ``min_new_tokens`` ids were produced; at most
        ``max_new_tokens`` ids are produced.
        """
        if not input_ids:
            raise ValueError("input_ids is empty")
        if min(input_ids) < 0 or max(input_ids) >= self.vocab_size:
            raise ValueError(f"input ids must lie in [0, {self.vocab_size})")
        if not 0 <= min_new_tokens <= max_new_tokens:
            raise ValueError("need 0 <= min_new_tokens <= max_new_tokens")
        stops = sorted(set(stop_ids))
        if any(not 0 <= stop < self.vocab_size or vocab.id_to_speech_token(stop) is not None for stop in stops):
            raise ValueError(f"stop ids must be non-speech ids below {self.vocab_size}: {stops}")
        generator = torch.Generator(device=self._device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        return self._generate(input_ids, params, max_new_tokens, min_new_tokens, stops, generator)

    def _generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        max_new_tokens: int,
        min_new_tokens: int,
        stops: list[int],
        generator: torch.Generator,
    ) -> Iterator[int]:
        if max_new_tokens == 0:
            return
        with_stops = torch.cat([self._speech_ids, torch.tensor(stops, dtype=torch.long, device=self._device)])
        seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self._device)
        seen[torch.tensor(input_ids, device=self._device)] = True
        stop_set = frozenset(stops)
        logits, cache = self._forward(input_ids, None)
        for produced in range(max_new_tokens):
            candidates = self._speech_ids if produced < min_new_tokens else with_stops
            token = _sample(logits, candidates, seen, params, generator)
            if token in stop_set:
                return
            yield token
            if produced + 1 == max_new_tokens:
                return
            seen[token] = True
            logits, cache = self._forward([token], cache)

    def _forward(self, ids: list[int], cache: object | None) -> tuple[torch.Tensor, object]:
        """Logits (float32, vocab) after ``ids``, and the extended KV cache.

        Inference mode is entered per call, not around the generator, so that it never leaks
        into the consumer's code between two yields.
        """
        with torch.inference_mode():
            output = self._model(
                input_ids=torch.tensor([ids], dtype=torch.long, device=self._device),
                past_key_values=cache,
                use_cache=True,
            )
        return output.logits[0, -1].float(), output.past_key_values


class _Qwen2WithHeadBias(Qwen2ForCausalLM):
    """Qwen2 whose ``lm_head`` has a bias, as upstream's HF conversion of CosyVoice2 writes it."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)


def _sample(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    seen: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
) -> int:
    """Draw one id among ``candidates``: repetition penalty, temperature, top-k, then top-p."""
    scores = logits[candidates]
    if params.repetition_penalty != 1.0:
        penalised = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
        scores = torch.where(seen[candidates], penalised, scores)
    if params.temperature == 0.0:
        return int(candidates[torch.argmax(scores)])
    scores = scores / params.temperature
    if 0 < params.top_k < scores.numel():
        kth_best = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token once the tokens ranked above it already hold top_p of the mass.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    choice = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)
    return int(candidates[choice])


def _has_head_bias(hf_dir: Path) -> bool:
    index = hf_dir / _WEIGHTS_INDEX
    if index.is_file():
        return _HEAD_BIAS in json.loads(index.read_text())["weight_map"]
    with safe_open(str(hf_dir / _WEIGHTS_FILE), framework="pt") as weights:
        return _HEAD_BIAS in weights.keys()  # noqa: SIM118 - safe_open is not a mapping
