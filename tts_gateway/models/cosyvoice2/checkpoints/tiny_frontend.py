"""Tiny random-weight stand-ins for the frontend models and the LLM, in the real on-disk formats.

- ``speech_tokenizer_v2.onnx``: inputs ``feats`` float32 [B, 128, T] and ``feats_length`` int32
  [B], output ``indices`` int32 [B, T'] with T' the length after two stride-2 convolutions (four
  mel frames, 40 ms, per token), codes in [0, 6561) from an 8-digit base-3 quantiser (the same
  code space as the real FSQ tokenizer).
- ``campplus.onnx``: input ``input`` float32 [B, T, 80], one output float32 [B, 192].
- ``cosyvoice2_llm/``: a Hugging Face Qwen2 directory laid out like ``yuekai/cosyvoice2_llm``:
  ``config.json``, ``generation_config.json``, ``model.safetensors`` (bf16, with the
  ``lm_head.bias`` upstream's conversion writes: -inf outside the speech rows), and a byte-level
  BPE tokenizer padded with placeholders so that every special and speech token sits at its real
  id (see :mod:`.vocab`). :func:`write_llm` writes the same directory at any Qwen2 shape; the
  full-size random checkpoint (:mod:`.random_checkpoint`) uses it with Qwen2-0.5B's.

The ONNX graphs are built with ``onnx.helper`` (opset 17) so no exporter is involved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import numpy as np
import onnx
import torch
from numpy.typing import NDArray
from onnx import TensorProto, helper, numpy_helper
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

from tts_gateway.models.cosyvoice2.model import vocab

TOKENIZER_FILENAME: Final = "speech_tokenizer_v2.onnx"
CAMPPLUS_FILENAME: Final = "campplus.onnx"
LLM_DIRNAME: Final = "cosyvoice2_llm"

ONNX_OPSET: Final = 17
ONNX_IR_VERSION: Final = 8

TOKENIZER_MELS: Final = 128
TOKENIZER_CHANNELS: Final = 16
FSQ_DIGITS: Final = 8  # 3 ** 8 == 6561 codes
SPEAKER_FEATS: Final = 80
SPEAKER_HIDDEN: Final = 32
SPEAKER_DIM: Final = 192

LLM_HIDDEN: Final = 32
LLM_INTERMEDIATE: Final = 64
LLM_LAYERS: Final = 2
LLM_HEADS: Final = 2
LLM_KV_HEADS: Final = 1
# Speech rows of upstream's llm_decoder / speech_embedding: 6561 tokens and eos1..eos3.
_SPEECH_ROWS: Final = slice(vocab.SPEECH_TOKEN_OFFSET, vocab.EOS3_ID + 1)
# The stop rows, and the fill row (<|eos3|>): in a text stream it ends a round and stops nothing.
_STOP_ROWS: Final = slice(vocab.EOS1_ID, vocab.EOS2_ID + 1)
_FILL_ROWS: Final = slice(vocab.EOS3_ID, vocab.EOS3_ID + 1)

_BPE_CORPUS: Final = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny tokenizer used by the tests of the speech gateway.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
    "Numbers like 1, 22 and 333 are split digit by digit.",
    "你好世界。今天天气很好。",
)
_BPE_VOCAB_SIZE: Final = 1000
# The upstream conversion's chat template: user text between <|sos|> and <|task_id|>.
_CHAT_TEMPLATE: Final = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '<|sos|>' + message['content'] + '<|task_id|>' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- message['content']}}"
    "{%- endif %}"
    "{%- endfor %}"
)


def write_tiny_tokenizer_onnx(path: Path, *, seed: int = 0) -> Path:
    """Write a tiny S3Tokenizer-v2-shaped ONNX model to ``path``."""
    rng = np.random.default_rng(seed)
    channels = TOKENIZER_CHANNELS
    initializers = [
        _tensor("conv1.weight", rng.normal(0.0, 0.3, (channels, TOKENIZER_MELS, 3))),
        _tensor("conv1.bias", rng.normal(0.0, 0.1, channels)),
        _tensor("conv2.weight", rng.normal(0.0, 0.3, (channels, channels, 3))),
        _tensor("conv2.bias", rng.normal(0.0, 0.1, channels)),
        _tensor("project.weight", rng.normal(0.0, 1.0, (channels, FSQ_DIGITS))),
        _tensor("one", np.array(1.0)),
        _tensor("digit_weights", 3.0 ** np.arange(FSQ_DIGITS)),
        numpy_helper.from_array(np.array(1, dtype=np.int32), "one_i32"),
        numpy_helper.from_array(np.array(2, dtype=np.int32), "two_i32"),
        numpy_helper.from_array(np.array([0], dtype=np.int64), "zero_i64"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "time_axis"),
    ]
    nodes = [
        _strided_conv(["feats", "conv1.weight", "conv1.bias"], "conv1"),
        helper.make_node("Relu", ["conv1"], ["act1"]),
        _strided_conv(["act1", "conv2.weight", "conv2.bias"], "conv2"),
        helper.make_node("Transpose", ["conv2"], ["hidden"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["hidden", "project.weight"], ["projected"]),
        helper.make_node("Tanh", ["projected"], ["bounded"]),
        helper.make_node("Round", ["bounded"], ["rounded"]),
        helper.make_node("Add", ["rounded", "one"], ["digits"]),
        helper.make_node("MatMul", ["digits", "digit_weights"], ["codes_float"]),
        helper.make_node("Cast", ["codes_float"], ["codes"], to=TensorProto.INT32),
        # Valid output length: each stride-2 convolution maps n frames to (n - 1) // 2 + 1.
        *_halve_length("feats_length", "len1", "a"),
        *_halve_length("len1", "len2", "b"),
        helper.make_node("ReduceMax", ["len2"], ["max_len"], keepdims=1),
        helper.make_node("Cast", ["max_len"], ["max_len_i64"], to=TensorProto.INT64),
        helper.make_node("Slice", ["codes", "zero_i64", "max_len_i64", "time_axis"], ["indices"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_speech_tokenizer_v2",
        inputs=[
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["batch", TOKENIZER_MELS, "frames"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, ["batch"]),
        ],
        outputs=[helper.make_tensor_value_info("indices", TensorProto.INT32, ["batch", "tokens"])],
        initializer=initializers,
    )
    return _save_onnx(graph, path)


def write_tiny_campplus_onnx(path: Path, *, seed: int = 0) -> Path:
    """Write a tiny CAM++-shaped speaker-embedding ONNX model to ``path``."""
    rng = np.random.default_rng(seed)
    initializers = [
        _tensor("frame.weight", rng.normal(0.0, 0.3, (SPEAKER_FEATS, SPEAKER_HIDDEN))),
        _tensor("frame.bias", rng.normal(0.0, 0.1, SPEAKER_HIDDEN)),
        _tensor("embed.weight", rng.normal(0.0, 0.3, (SPEAKER_HIDDEN, SPEAKER_DIM))),
        _tensor("embed.bias", rng.normal(0.0, 0.1, SPEAKER_DIM)),
    ]
    nodes = [
        helper.make_node("MatMul", ["input", "frame.weight"], ["frame_linear"]),
        helper.make_node("Add", ["frame_linear", "frame.bias"], ["frame_biased"]),
        helper.make_node("Relu", ["frame_biased"], ["frame_act"]),
        helper.make_node("ReduceMean", ["frame_act"], ["pooled"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["pooled", "embed.weight"], ["embed_linear"]),
        helper.make_node("Add", ["embed_linear", "embed.bias"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_campplus",
        inputs=[helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "frames", SPEAKER_FEATS])],
        outputs=[helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", SPEAKER_DIM])],
        initializer=initializers,
    )
    return _save_onnx(graph, path)


def write_tiny_llm(directory: Path, *, seed: int = 0) -> Path:
    """Write a tiny ``cosyvoice2_llm``-shaped HF directory (weights and tokenizer) to ``directory``."""
    return write_llm(directory, tiny_llm_config(), seed=seed)


def write_llm(
    directory: Path,
    config: Qwen2Config,
    *,
    seed: int = 0,
    stop_logit: float | None = None,
    fill_logit: float | None = None,
) -> Path:
    """Write a random-weight ``cosyvoice2_llm`` HF directory of any Qwen2 shape (see :func:`llm_state`)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            name: tensor.to(torch.bfloat16).contiguous()
            for name, tensor in llm_state(config, seed=seed, stop_logit=stop_logit, fill_logit=fill_logit).items()
        },
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config.save_pretrained(directory)
    GenerationConfig(
        do_sample=True, eos_token_id=list(vocab.STOP_IDS), temperature=1.0, top_p=0.8, top_k=25
    ).save_pretrained(directory)
    write_tiny_text_tokenizer(directory)
    return directory


def llm_state(
    config: Qwen2Config, *, seed: int = 0, stop_logit: float | None = None, fill_logit: float | None = None
) -> dict[str, torch.Tensor]:
    """Random float32 weights of a CosyVoice2 LLM: Hugging Face's Qwen2 initialisation, then upstream's head.

    The head keeps only the speech rows, with a random bias, and -inf bias elsewhere. With
    ``stop_logit`` the stop rows (``<|eos1|>``, ``<|eos2|>``) instead get zero weights and that
    bias: a large value makes every generation stop as soon as the caller's ``min_new_tokens``
    allows, which gives a random-weight model a reproducible output length. ``fill_logit`` does the
    same for the fill row (``<|eos3|>``), which a text stream draws to end a round and which no
    minimum holds back: a value near the top speech logits makes rounds end after a few speech
    tokens on average. Built on torch's default device (under ``torch.device("meta")`` it only has
    shapes).
    """
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    head = state["lm_head.weight"]
    state["lm_head.weight"] = _speech_rows_only(head)
    bias = torch.full((config.vocab_size,), float("-inf"), device=head.device)
    rows = _SPEECH_ROWS.stop - _SPEECH_ROWS.start
    bias[_SPEECH_ROWS] = (torch.randn(rows, generator=generator, device="cpu") * 0.5).to(head.device)
    for rows, logit in ((_STOP_ROWS, stop_logit), (_FILL_ROWS, fill_logit)):
        if logit is not None:
            state["lm_head.weight"][rows] = 0.0
            bias[rows] = logit
    state["lm_head.bias"] = bias
    return state


def tiny_llm_config() -> Qwen2Config:
    """Qwen2 config of the tiny LLM: real vocabulary size and conventions, tiny dimensions."""
    return qwen2_config(
        hidden_size=LLM_HIDDEN,
        intermediate_size=LLM_INTERMEDIATE,
        num_hidden_layers=LLM_LAYERS,
        num_attention_heads=LLM_HEADS,
        num_key_value_heads=LLM_KV_HEADS,
        max_position_embeddings=4096,
    )


def qwen2_config(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    max_position_embeddings: int,
) -> Qwen2Config:
    """A Qwen2 config with the CosyVoice2 LLM's vocabulary and conventions (untied, bf16) and the given shape."""
    return Qwen2Config(
        vocab_size=vocab.MODEL_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False,
        bos_token_id=vocab.FIRST_TEXT_SPECIAL_ID,
        eos_token_id=vocab.EOS1_ID,
        architectures=["Qwen2ForCausalLM"],
        dtype="bfloat16",
    )


def write_tiny_text_tokenizer(directory: Path) -> None:
    """Save a Qwen2 tokenizer with the CosyVoice2 layout, built the way upstream builds the real one.

    A byte-level BPE trained on a few sentences is padded with placeholder tokens up to
    Qwen2's 151643 regular tokens; then the specials and speech tokens are added in upstream's
    order, which puts each at its real id.
    """
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    trained.train_from_iterator(_BPE_CORPUS, trainer)
    bpe = json.loads(trained.to_str())["model"]
    token_ids: dict[str, int] = dict(bpe["vocab"])
    for token_id in range(len(token_ids), vocab.FIRST_TEXT_SPECIAL_ID):
        token_ids[f"<|placeholder_{token_id}|>"] = token_id
    merges: list[tuple[str, str]] = [(left, right) for left, right in bpe["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=token_ids, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": list(vocab.TEXT_SPECIAL_TOKENS[1:3])})
    tokenizer.add_special_tokens(
        {
            "eos_token": vocab.TEXT_SPECIAL_TOKENS[0],
            "pad_token": vocab.TEXT_SPECIAL_TOKENS[0],
            "additional_special_tokens": list(vocab.TEXT_SPECIAL_TOKENS[1:]),
        }
    )
    speech = [vocab.speech_token_string(token) for token in range(vocab.SPEECH_TOKEN_SIZE)]
    tokenizer.add_tokens([*speech, *vocab.SPEECH_SUFFIX_TOKENS])
    tokenizer.chat_template = _CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    vocab.check_tokenizer_layout(tokenizer)


def _speech_rows_only(weight: torch.Tensor) -> torch.Tensor:
    """Zero every row but the speech ones, as upstream's conversion leaves the text rows."""
    result = torch.zeros_like(weight)
    result[_SPEECH_ROWS] = weight[_SPEECH_ROWS]
    return result


def _strided_conv(inputs: list[str], output: str) -> onnx.NodeProto:
    return helper.make_node("Conv", inputs, [output], kernel_shape=[3], strides=[2], pads=[1, 1])


def _halve_length(source: str, target: str, tag: str) -> list[onnx.NodeProto]:
    return [
        helper.make_node("Sub", [source, "one_i32"], [f"{tag}_minus"]),
        helper.make_node("Div", [f"{tag}_minus", "two_i32"], [f"{tag}_half"]),
        helper.make_node("Add", [f"{tag}_half", "one_i32"], [target]),
    ]


def _tensor(name: str, values: NDArray[np.floating[Any]]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=np.float32), name)


def _save_onnx(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
        producer_name="tts-gateway tiny_frontend",
    )
    model.ir_version = ONNX_IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path
