"""Random-weight CosyVoice2 checkpoints in the real on-disk layout: tiny (tests) and full size (benchmarks).

:func:`write_checkpoint` writes what ``tts-models download`` fetches, with the same
names, formats and state-dict keys, at the shapes of a :class:`CheckpointSize`:

- ``root/CosyVoice2-0.5B/``: ``cosyvoice2.yaml``, ``flow.pt``, ``hift.pt``,
  ``speech_tokenizer_v2.onnx``, ``campplus.onnx`` (ModelScope ``iic/CosyVoice2-0.5B``);
- ``root/cosyvoice2_llm/``: the Hugging Face Qwen2 directory with the extended vocabulary
  (``yuekai/cosyvoice2_llm``).

Every loader of the real checkpoint therefore runs unchanged on it. :func:`full_size` has the
released model's shapes, so a benchmark over it costs what the real model costs: flow and HiFT at
the hyper-parameters of the official ``cosyvoice2.yaml`` (``official_cosyvoice2.yaml`` here;
``flow.pt`` 450 MB and ``hift.pt`` 83 MB in float32), the LLM at Qwen2-0.5B's (hidden 896, 24
layers, 14 attention heads, 2 KV heads, MLP 4864, 158336 vocabulary rows; 1.3 GB in bf16). Three
parts stay tiny at every size: the speech tokenizer and CAM++ ONNX models, which run once per
reference voice (its prompt is cached), and the text tokenizer, a byte-level BPE trained on a few
sentences (about 3.5 tokens per English word and 2.7 per Chinese character, where Qwen2's has about
1.3 and 0.7: prompts are a few dozen tokens longer than with the real one).

Random weights give no natural end of speech. The full size's LLM head makes the stop ids
(``<|eos1|>``, ``<|eos2|>``) win as soon as ``min_new_tokens`` allows, so a request yields exactly
``min_token_text_ratio`` (2.0 in every profile) speech tokens per text token; with the stand-in
tokenizer that is roughly 3 English words or 5 Chinese characters per second of audio (25 tokens
per second), a natural pace. The audio itself is noise-like.

A text stream (``cosyvoice2_bistream``) has no such minimum: as upstream's ``inference_bistream``,
its final stage may stop at once, and within a round it draws the fill token (``<|eos3|>``) when
the model says so. The fill row therefore gets its own constant logit (``FULL_FILL_LOGIT``), near
the top of the speech logits rather than above them: at the profiles' sampling (temperature 0.8,
top-k 50, top-p 0.95, repetition penalty 1.1) a round ends by itself after a few to a few dozen
speech tokens and the forced fill caps every round after the first at 15 (the real model's pace,
15 per 5 text tokens), so a stream yields about 2 speech tokens per text token (up to 3 when its
first round runs long), as a request does. Its final stage stops at once: the last text tokens
(fewer than a round's 5) get no speech.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch
from transformers import Qwen2Config

from tts_gateway import file_lock
from tts_gateway.models.cosyvoice2.checkpoints import config_writer, tiny_frontend
from tts_gateway.models.cosyvoice2.model import config
from tts_gateway.models.cosyvoice2.model.flow import CausalFlow
from tts_gateway.models.cosyvoice2.model.hift import HiFTGenerator

COSYVOICE_DIRNAME: Final = "CosyVoice2-0.5B"
CONFIG_FILENAME: Final = "cosyvoice2.yaml"
FLOW_FILENAME: Final = "flow.pt"
HIFT_FILENAME: Final = "hift.pt"
MARKER_FILENAME: Final = "random_checkpoint.json"
OFFICIAL_CONFIG_FILE: Final = Path(__file__).with_name("official_cosyvoice2.yaml")
# Far above any speech row's logit (about N(0, 0.8) at random weights), even after temperature.
FULL_STOP_LOGIT: Final = 20.0
# Near the largest of the full-size LLM's speech logits (about 2.8; top-50 from about 1.9): drawn at
# about 6 % of the steps at temperature 0.8, 4 % once the repetition penalty holds it back.
FULL_FILL_LOGIT: Final = 3.0


@dataclass(frozen=True)
class RandomCheckpoint:
    model_dir: Path
    """The ``CosyVoice2-0.5B`` directory."""
    llm_dir: Path
    """The ``cosyvoice2_llm`` directory."""


@dataclass(frozen=True)
class CheckpointSize:
    """The shapes of a random checkpoint, and how its LLM stops (see :func:`tiny_frontend.llm_state`)."""

    name: str
    model: config.CosyVoice2Config
    llm: Qwen2Config
    stop_logit: float | None = None
    fill_logit: float | None = None


def official_config() -> config.CosyVoice2Config:
    """Flow and HiFT hyper-parameters of the released CosyVoice2-0.5B."""
    return config.load_config(OFFICIAL_CONFIG_FILE)


def full_llm_config() -> Qwen2Config:
    """The CosyVoice2 LLM at Qwen2-0.5B's shape."""
    return tiny_frontend.qwen2_config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
    )


def full_size() -> CheckpointSize:
    return CheckpointSize(
        "full", official_config(), full_llm_config(), stop_logit=FULL_STOP_LOGIT, fill_logit=FULL_FILL_LOGIT
    )


def module_states(cfg: config.CosyVoice2Config, *, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Random ``flow.pt`` and ``hift.pt`` contents, by file name: flat state dicts as upstream saves them.

    Built on torch's default device (under ``torch.device("meta")`` they only have shapes).
    """
    torch.manual_seed(seed)
    modules: dict[str, torch.nn.Module] = {FLOW_FILENAME: CausalFlow(cfg.flow), HIFT_FILENAME: HiFTGenerator(cfg.hift)}
    return {
        name: {key: value.detach() for key, value in module.state_dict().items()} for name, module in modules.items()
    }


def write_checkpoint(root: Path, size: CheckpointSize, *, seed: int = 0) -> RandomCheckpoint:
    """Write (or overwrite) a checkpoint under ``root``; the same seed gives the same weights."""
    model_dir = root / COSYVOICE_DIRNAME
    model_dir.mkdir(parents=True, exist_ok=True)
    config_writer.write_config(size.model, model_dir / CONFIG_FILENAME)
    for filename, state in module_states(size.model, seed=seed).items():
        torch.save(state, model_dir / filename)
    tiny_frontend.write_tiny_tokenizer_onnx(model_dir / tiny_frontend.TOKENIZER_FILENAME, seed=seed)
    tiny_frontend.write_tiny_campplus_onnx(model_dir / tiny_frontend.CAMPPLUS_FILENAME, seed=seed)
    llm_dir = tiny_frontend.write_llm(
        root / tiny_frontend.LLM_DIRNAME, size.llm, seed=seed, stop_logit=size.stop_logit, fill_logit=size.fill_logit
    )
    return RandomCheckpoint(model_dir=model_dir, llm_dir=llm_dir)


def ensure_checkpoint(root: Path, size: CheckpointSize, *, seed: int = 0) -> tuple[RandomCheckpoint, bool]:
    """The checkpoint of ``size`` and ``seed`` under ``root``, and whether it had to be written.

    A complete one (its marker file names the same size, seed and head constants) is reused. Otherwise it is
    written into a sibling directory that replaces ``root`` only once complete, so an
    interrupted write never leaves a half-written checkpoint that looks usable. Callers in several processes
    (benchmarks started together over one work directory) take turns on a lock beside ``root``: the first
    writes, the others wait and reuse it, where they would otherwise remove each other's half-written files.
    """
    # The head's constants are part of it: a checkpoint written with other ones is replaced.
    marker = {"size": size.name, "seed": seed, "stop_logit": size.stop_logit, "fill_logit": size.fill_logit}
    existing = RandomCheckpoint(model_dir=root / COSYVOICE_DIRNAME, llm_dir=root / tiny_frontend.LLM_DIRNAME)
    if _read_marker(root) == marker:
        return existing, False
    root.parent.mkdir(parents=True, exist_ok=True)
    with file_lock.exclusive(root.with_name(root.name + ".lock")):
        if _read_marker(root) == marker:
            return existing, False
        staging = root.with_name(root.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            write_checkpoint(staging, size, seed=seed)
            (staging / MARKER_FILENAME).write_text(json.dumps(marker) + "\n", encoding="utf-8")
            shutil.rmtree(root, ignore_errors=True)
            staging.rename(root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return existing, True


def _read_marker(root: Path) -> object:
    try:
        return json.loads((root / MARKER_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
