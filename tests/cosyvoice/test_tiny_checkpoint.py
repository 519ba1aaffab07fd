"""The tiny checkpoint has the real layout and every real loader accepts it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tts_gateway.models.cosyvoice2.checkpoints.config_writer import tiny_config
from tts_gateway.models.cosyvoice2.checkpoints.tiny_checkpoint import TinyCheckpoint, write_tiny_checkpoint
from tts_gateway.models.cosyvoice2.engines.llm import SamplingParams, TorchSpeechLLM
from tts_gateway.models.cosyvoice2.model import vocab
from tts_gateway.models.cosyvoice2.model.config import load_config
from tts_gateway.models.cosyvoice2.model.flow import CausalFlow
from tts_gateway.models.cosyvoice2.model.frontend import AudioTokenizer, SpeakerEmbedder, build_voice_prompt
from tts_gateway.models.cosyvoice2.model.hift import HiFTGenerator

pytestmark = pytest.mark.cosyvoice


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_layout_matches_the_published_repositories(tiny: TinyCheckpoint) -> None:
    assert tiny.model_dir.name == "CosyVoice2-0.5B"
    assert tiny.llm_dir.name == "cosyvoice2_llm"
    assert tiny.model_dir.parent == tiny.llm_dir.parent
    for name in ("cosyvoice2.yaml", "flow.pt", "hift.pt", "speech_tokenizer_v2.onnx", "campplus.onnx"):
        assert (tiny.model_dir / name).is_file(), name
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny.llm_dir / name).is_file(), name


def test_every_loader_accepts_it(tiny: TinyCheckpoint) -> None:
    cfg = load_config(tiny.model_dir / "cosyvoice2.yaml")
    assert cfg == tiny_config()
    cpu = torch.device("cpu")
    flow = CausalFlow.from_checkpoint(cfg.flow, tiny.model_dir / "flow.pt", cpu, torch.float32)
    hift = HiFTGenerator.from_checkpoint(cfg.hift, tiny.model_dir / "hift.pt", cpu, torch.float32)
    assert flow is not None and hift is not None
    # The files hold the training-time modules' keys (weight-norm parametrisations included).
    for name, module in (("flow.pt", CausalFlow(cfg.flow)), ("hift.pt", HiFTGenerator(cfg.hift))):
        saved = torch.load(tiny.model_dir / name, map_location="cpu", weights_only=True)
        assert set(saved) == set(module.state_dict()), name

    wav = (0.3 * np.sin(np.linspace(0, 2000, 32_000))).astype(np.float32)
    prompt = build_voice_prompt(
        wav,
        AudioTokenizer(tiny.model_dir / "speech_tokenizer_v2.onnx"),
        SpeakerEmbedder(tiny.model_dir / "campplus.onnx"),
    )
    assert prompt.speech_tokens.size > 0

    tokenizer = AutoTokenizer.from_pretrained(tiny.llm_dir)
    vocab.check_tokenizer_layout(tokenizer)
    llm = TorchSpeechLLM(tiny.llm_dir)
    ids = vocab.build_prompt_ids(tokenizer, "hi", "hello", prompt.speech_tokens)
    out = list(llm.generate(ids, SamplingParams(seed=1), max_new_tokens=8, min_new_tokens=8, stop_ids=vocab.STOP_IDS))
    assert len(out) == 8
    assert all(vocab.id_to_speech_token(i) is not None for i in out)


def test_same_seed_same_weights(tmp_path: Path, tiny: TinyCheckpoint) -> None:
    again = write_tiny_checkpoint(tmp_path, seed=0)
    other = write_tiny_checkpoint(tmp_path / "other", seed=1)
    first = torch.load(tiny.model_dir / "hift.pt", weights_only=True)
    second = torch.load(again.model_dir / "hift.pt", weights_only=True)
    third = torch.load(other.model_dir / "hift.pt", weights_only=True)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], third[k]) for k in first)
