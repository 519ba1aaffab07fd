"""The tiny artifacts have the real on-disk formats, names, dtypes and vocabulary layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from tts_gateway.models.cosyvoice2.checkpoints import tiny_frontend
from tts_gateway.models.cosyvoice2.model import vocab

pytestmark = pytest.mark.cosyvoice


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny_frontend")
    tiny_frontend.write_tiny_tokenizer_onnx(root / tiny_frontend.TOKENIZER_FILENAME)
    tiny_frontend.write_tiny_campplus_onnx(root / tiny_frontend.CAMPPLUS_FILENAME)
    tiny_frontend.write_tiny_llm(root / tiny_frontend.LLM_DIRNAME)
    return root


def signature(values: list[onnx.ValueInfoProto]) -> list[tuple[str, int, list[int | str]]]:
    return [
        (
            value.name,
            value.type.tensor_type.elem_type,
            [dim.dim_param or dim.dim_value for dim in value.type.tensor_type.shape.dim],
        )
        for value in values
    ]


def test_speech_tokenizer_onnx_has_the_real_interface(artifacts: Path) -> None:
    model = onnx.load(str(artifacts / tiny_frontend.TOKENIZER_FILENAME))
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version >= 17
    assert signature(list(model.graph.input)) == [
        ("feats", onnx.TensorProto.FLOAT, ["batch", 128, "frames"]),
        ("feats_length", onnx.TensorProto.INT32, ["batch"]),
    ]
    assert signature(list(model.graph.output)) == [("indices", onnx.TensorProto.INT32, ["batch", "tokens"])]


@pytest.mark.parametrize(("frames", "tokens"), [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (100, 25), (101, 26)])
def test_speech_tokenizer_yields_a_token_per_four_frames(artifacts: Path, frames: int, tokens: int) -> None:
    session = ort.InferenceSession(
        str(artifacts / tiny_frontend.TOKENIZER_FILENAME), providers=["CPUExecutionProvider"]
    )
    feats = np.random.default_rng(frames).standard_normal((1, 128, frames)).astype(np.float32)
    (indices,) = session.run(None, {"feats": feats, "feats_length": np.array([frames], dtype=np.int32)})
    assert indices.shape == (1, tokens)
    assert indices.dtype == np.int32
    assert indices.min() >= 0 and indices.max() < vocab.SPEECH_TOKEN_SIZE


def test_campplus_onnx_has_the_real_interface(artifacts: Path) -> None:
    model = onnx.load(str(artifacts / tiny_frontend.CAMPPLUS_FILENAME))
    onnx.checker.check_model(model, full_check=True)
    assert signature(list(model.graph.input)) == [("input", onnx.TensorProto.FLOAT, ["batch", "frames", 80])]
    assert signature(list(model.graph.output)) == [("output", onnx.TensorProto.FLOAT, ["batch", 192])]
    session = ort.InferenceSession(str(artifacts / tiny_frontend.CAMPPLUS_FILENAME), providers=["CPUExecutionProvider"])
    (embedding,) = session.run(None, {"input": np.ones((1, 37, 80), dtype=np.float32)})
    assert embedding.shape == (1, 192)


def test_onnx_files_are_deterministic_per_seed(tmp_path: Path) -> None:
    first = tiny_frontend.write_tiny_tokenizer_onnx(tmp_path / "a.onnx", seed=3).read_bytes()
    second = tiny_frontend.write_tiny_tokenizer_onnx(tmp_path / "b.onnx", seed=3).read_bytes()
    other = tiny_frontend.write_tiny_tokenizer_onnx(tmp_path / "c.onnx", seed=4).read_bytes()
    assert first == second != other


def test_llm_dir_is_a_qwen2_checkpoint_with_the_extended_vocabulary(artifacts: Path) -> None:
    llm_dir = artifacts / tiny_frontend.LLM_DIRNAME
    config = AutoConfig.from_pretrained(llm_dir)
    assert config.model_type == "qwen2"
    assert config.vocab_size == vocab.MODEL_VOCAB_SIZE == 158336
    assert config.tie_word_embeddings is False
    assert config.eos_token_id == vocab.EOS1_ID
    assert json.loads((llm_dir / "generation_config.json").read_text())["eos_token_id"] == list(vocab.STOP_IDS)
    with safe_open(str(llm_dir / "model.safetensors"), framework="pt") as weights:
        names = set(weights.keys())
        bias = weights.get_tensor("lm_head.bias")
        head = weights.get_tensor("lm_head.weight")
    assert {"model.embed_tokens.weight", "lm_head.weight", "lm_head.bias", "model.norm.weight"} <= names
    assert bias.dtype == head.dtype == torch.bfloat16
    assert head.shape == (vocab.MODEL_VOCAB_SIZE, config.hidden_size)
    speech_rows = slice(vocab.SPEECH_TOKEN_OFFSET, vocab.EOS3_ID + 1)
    assert torch.isfinite(bias[speech_rows]).all()
    assert torch.isneginf(bias[: vocab.SPEECH_TOKEN_OFFSET]).all()
    assert torch.isneginf(bias[vocab.EOS3_ID + 1 :]).all()


def test_llm_tokenizer_puts_every_token_at_its_real_id(artifacts: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(artifacts / tiny_frontend.LLM_DIRNAME)
    assert len(tokenizer) == vocab.TOKENIZER_SIZE == 158229
    specials = tokenizer.convert_tokens_to_ids(list(vocab.TEXT_SPECIAL_TOKENS))
    assert specials == list(range(151643, 151663))
    assert tokenizer.convert_tokens_to_ids(["<|s_0|>", "<|s_6560|>"]) == [151663, 158223]
    assert tokenizer.convert_tokens_to_ids(list(vocab.SPEECH_SUFFIX_TOKENS)) == list(range(158224, 158229))
    text_ids = tokenizer.encode("Hello world, 123.")
    assert text_ids and max(text_ids) < 151643
    assert tokenizer.decode(text_ids) == "Hello world, 123."


def test_artifacts_stay_small(artifacts: Path) -> None:
    total = sum(path.stat().st_size for path in artifacts.rglob("*") if path.is_file())
    assert total < 40 * 2**20
