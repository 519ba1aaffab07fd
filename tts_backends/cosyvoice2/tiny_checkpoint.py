"""A tiny random-weight CosyVoice2 checkpoint in the real on-disk layout, for tests and demos.

``write_tiny_checkpoint(root)`` writes what ``scripts/cosyvoice_models.py download`` fetches,
with the same names, formats and state-dict keys, only with small dimensions:

- ``root/CosyVoice2-0.5B/``: ``cosyvoice2.yaml``, ``flow.pt``, ``hift.pt``,
  ``speech_tokenizer_v2.onnx``, ``campplus.onnx`` (ModelScope ``iic/CosyVoice2-0.5B``);
- ``root/cosyvoice2_llm/``: the Hugging Face Qwen2 directory with the extended vocabulary
  (``yuekai/cosyvoice2_llm``).

Every loader of the real checkpoint therefore runs unchanged on it, in about a second on CPU.
The audio is noise-like: the weights are random.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch

from tts_backends.cosyvoice2 import config, tiny_frontend
from tts_backends.cosyvoice2.flow import CausalFlow
from tts_backends.cosyvoice2.hift import HiFTGenerator

COSYVOICE_DIRNAME: Final = "CosyVoice2-0.5B"
CONFIG_FILENAME: Final = "cosyvoice2.yaml"
FLOW_FILENAME: Final = "flow.pt"
HIFT_FILENAME: Final = "hift.pt"


@dataclass(frozen=True)
class TinyCheckpoint:
    model_dir: Path
    """The ``CosyVoice2-0.5B`` directory."""
    llm_dir: Path
    """The ``cosyvoice2_llm`` directory."""


def write_tiny_checkpoint(root: Path, *, seed: int = 0) -> TinyCheckpoint:
    """Write (or overwrite) the tiny checkpoint under ``root``; the same seed gives the same weights."""
    model_dir = root / COSYVOICE_DIRNAME
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = config.tiny_config()
    config.write_config(cfg, model_dir / CONFIG_FILENAME)

    torch.manual_seed(seed)
    _save_state(CausalFlow(cfg.flow), model_dir / FLOW_FILENAME)
    _save_state(HiFTGenerator(cfg.hift), model_dir / HIFT_FILENAME)
    tiny_frontend.write_tiny_tokenizer_onnx(model_dir / tiny_frontend.TOKENIZER_FILENAME, seed=seed)
    tiny_frontend.write_tiny_campplus_onnx(model_dir / tiny_frontend.CAMPPLUS_FILENAME, seed=seed)
    llm_dir = tiny_frontend.write_tiny_llm(root / tiny_frontend.LLM_DIRNAME, seed=seed)
    return TinyCheckpoint(model_dir=model_dir, llm_dir=llm_dir)


def _save_state(module: torch.nn.Module, path: Path) -> None:
    """Save a state dict as upstream's checkpoints hold it: a flat dict of CPU tensors."""
    state = {name: tensor.detach().cpu().clone() for name, tensor in module.state_dict().items()}
    torch.save(state, path)
