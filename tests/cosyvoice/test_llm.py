"""Speech-token generation with real transformers on the tiny CosyVoice2 LLM."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Qwen2ForCausalLM

from tts_gateway.models.cosyvoice2.checkpoints import tiny_frontend
from tts_gateway.models.cosyvoice2.engines.llm import SamplingParams, TorchSpeechLLM
from tts_gateway.models.cosyvoice2.model import vocab

pytestmark = [pytest.mark.cosyvoice, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = [vocab.SOS_ID, 100, 200, 300, vocab.TASK_ID_ID, *vocab.speech_tokens_to_ids([5, 6, 7, 8])]
GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0)
WIDE = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, seed=11)


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_frontend.write_tiny_llm(tmp_path_factory.mktemp("llm") / "cosyvoice2_llm")


@pytest.fixture(scope="module")
def llm(llm_dir: Path) -> TorchSpeechLLM:
    return TorchSpeechLLM(llm_dir)


@pytest.fixture(scope="module")
def eager_to_stop(llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TorchSpeechLLM:
    """The tiny LLM with a head bias that makes <|eos1|> by far the likeliest next id."""
    directory = tmp_path_factory.mktemp("llm_eos") / "cosyvoice2_llm"
    shutil.copytree(llm_dir, directory)
    weights = load_file(directory / "model.safetensors")
    weights["lm_head.bias"][vocab.EOS1_ID] = 40.0
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return TorchSpeechLLM(directory)


def generate(model: TorchSpeechLLM, params: SamplingParams, **limits: int) -> list[int]:
    return list(model.generate(PROMPT, params, stop_ids=vocab.STOP_IDS, **limits))


def test_same_seed_same_tokens(llm: TorchSpeechLLM) -> None:
    params = SamplingParams(seed=1234)
    first = generate(llm, params, max_new_tokens=30)
    assert first == generate(llm, params, max_new_tokens=30)
    assert first != generate(llm, SamplingParams(seed=1235), max_new_tokens=30)


def test_only_speech_tokens_come_out(llm: TorchSpeechLLM) -> None:
    ids = generate(llm, WIDE, max_new_tokens=60)
    assert len(ids) == 60
    assert all(vocab.id_to_speech_token(token_id) is not None for token_id in ids)
    assert len(set(ids)) > 30


def test_max_new_tokens_is_exact_without_stops(llm: TorchSpeechLLM) -> None:
    for limit in (0, 1, 17):
        assert len(list(llm.generate(PROMPT, WIDE, max_new_tokens=limit, stop_ids=()))) == limit


def test_stop_id_ends_generation_and_is_not_yielded(eager_to_stop: TorchSpeechLLM) -> None:
    assert generate(eager_to_stop, WIDE, max_new_tokens=10) == []


def test_min_new_tokens_holds_stops_back(eager_to_stop: TorchSpeechLLM) -> None:
    ids = generate(eager_to_stop, WIDE, max_new_tokens=10, min_new_tokens=4)
    assert len(ids) == 4
    assert all(vocab.id_to_speech_token(token_id) is not None for token_id in ids)


def test_only_the_given_stop_ids_stop(eager_to_stop: TorchSpeechLLM) -> None:
    # eos1 is neither a stop id nor a speech token here, so it is never drawn.
    ids = list(eager_to_stop.generate(PROMPT, WIDE, max_new_tokens=5, stop_ids=[vocab.EOS2_ID]))
    assert len(ids) == 5
    assert vocab.EOS1_ID not in ids


def test_incremental_decoding_matches_full_recomputation(llm: TorchSpeechLLM, llm_dir: Path) -> None:
    reference = Qwen2ForCausalLM.from_pretrained(llm_dir, dtype=torch.float32).eval()
    with safe_open(str(llm_dir / "model.safetensors"), framework="pt") as weights:
        bias = weights.get_tensor("lm_head.bias").float()
    allowed = torch.arange(vocab.SPEECH_TOKEN_OFFSET, vocab.EOS3_ID + 1)
    sequence = list(PROMPT)
    expected = []
    with torch.no_grad():
        for _ in range(12):
            logits = reference(input_ids=torch.tensor([sequence])).logits[0, -1] + bias
            token = int(allowed[torch.argmax(logits[allowed])])
            if token in vocab.STOP_IDS:
                break
            expected.append(token)
            sequence.append(token)
    assert len(expected) == 12
    assert generate(llm, GREEDY, max_new_tokens=12) == expected


def test_top_k_one_and_tiny_top_p_are_greedy(llm: TorchSpeechLLM) -> None:
    greedy = generate(llm, GREEDY, max_new_tokens=10)
    top_k = SamplingParams(temperature=1.0, top_k=1, top_p=1.0, repetition_penalty=1.0, seed=5)
    top_p = SamplingParams(temperature=1.0, top_k=0, top_p=1e-6, repetition_penalty=1.0, seed=6)
    assert generate(llm, top_k, max_new_tokens=10) == greedy
    assert generate(llm, top_p, max_new_tokens=10) == greedy


def test_repetition_penalty_discourages_seen_tokens(llm: TorchSpeechLLM) -> None:
    plain = generate(llm, GREEDY, max_new_tokens=30)
    assert len(set(plain)) < len(plain)
    penalised = generate(llm, SamplingParams(temperature=0.0, repetition_penalty=1e6), max_new_tokens=30)
    assert len(set(penalised)) == len(penalised)
    assert not set(penalised) & set(PROMPT)


def test_inference_mode_does_not_leak_between_yields(llm: TorchSpeechLLM) -> None:
    stream = llm.generate(PROMPT, WIDE, max_new_tokens=3, stop_ids=vocab.STOP_IDS)
    next(stream)
    assert not torch.is_inference_mode_enabled()
    assert torch.is_grad_enabled()


def test_bfloat16_weights_generate_speech(llm_dir: Path) -> None:
    model = TorchSpeechLLM(llm_dir, device="cpu", dtype="bfloat16")
    ids = generate(model, SamplingParams(seed=3), max_new_tokens=8)
    assert len(ids) == 8
    assert all(vocab.id_to_speech_token(token_id) is not None for token_id in ids)


@pytest.mark.parametrize(
    ("input_ids", "limits", "stop_ids"),
    [
        ([], {"max_new_tokens": 5}, vocab.STOP_IDS),
        ([vocab.MODEL_VOCAB_SIZE], {"max_new_tokens": 5}, vocab.STOP_IDS),
        (PROMPT, {"max_new_tokens": 2, "min_new_tokens": 3}, vocab.STOP_IDS),
        (PROMPT, {"max_new_tokens": 2}, [vocab.speech_token_to_id(0)]),
    ],
)
def test_bad_requests_fail_before_generating(
    llm: TorchSpeechLLM, input_ids: list[int], limits: dict[str, int], stop_ids: tuple[int, ...]
) -> None:
    with pytest.raises(ValueError):
        llm.generate(input_ids, WIDE, stop_ids=stop_ids, **limits)


@pytest.mark.parametrize(
    "fields",
    [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"repetition_penalty": 0.0}],
)
def test_sampling_params_are_validated(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**fields)  # type: ignore[arg-type]


def test_unknown_dtype_is_refused(llm_dir: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        TorchSpeechLLM(llm_dir, dtype="int8")
