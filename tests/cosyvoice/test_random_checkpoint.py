"""The full-size random checkpoint has the released model's shapes, its LLM stops where the caller allows,
and a text stream on it speaks its text.

The full-size weights are checked on the meta device (shapes only, no memory); behaviour is
checked on tiny shapes with the full size's head constants.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tests.cosyvoice.test_llm_engine import Recorder
from tts_gateway.models.cosyvoice2.checkpoints.random_checkpoint import (
    FLOW_FILENAME,
    FULL_FILL_LOGIT,
    FULL_STOP_LOGIT,
    HIFT_FILENAME,
    MARKER_FILENAME,
    OFFICIAL_CONFIG_FILE,
    CheckpointSize,
    ensure_checkpoint,
    full_size,
    module_states,
)
from tts_gateway.models.cosyvoice2.checkpoints.tiny_checkpoint import tiny_size
from tts_gateway.models.cosyvoice2.checkpoints.tiny_frontend import llm_state, tiny_llm_config, write_llm
from tts_gateway.models.cosyvoice2.engines.llm import SamplingParams, TorchSpeechLLM
from tts_gateway.models.cosyvoice2.engines.llm_bistream import SPEECH_PER_ROUND, TEXT_PER_ROUND
from tts_gateway.models.cosyvoice2.model import vocab
from tts_gateway.models.cosyvoice2.model.config import load_config
from tts_gateway.models.cosyvoice2.model.flow import CausalFlow
from tts_gateway.models.cosyvoice2.model.hift import HiFTGenerator

pytestmark = pytest.mark.cosyvoice

# Qwen2-0.5B: 494,032,768 parameters with its 151,936-row embedding tied to the head.
QWEN2_05B_PARAMETERS = 494_032_768
QWEN2_05B_VOCAB_ROWS = 151_936


def shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


def test_flow_and_hift_are_written_at_the_official_hyper_parameters() -> None:
    official = load_config(OFFICIAL_CONFIG_FILE)
    size = full_size()
    assert size.model == official
    with torch.device("meta"):
        states = module_states(size.model)
        expected = {
            FLOW_FILENAME: CausalFlow(official.flow).state_dict(),
            HIFT_FILENAME: HiFTGenerator(official.hift).state_dict(),
        }
    assert {name: shapes(state) for name, state in states.items()} == {
        name: shapes(state) for name, state in expected.items()
    }

    flow, hift = shapes(states[FLOW_FILENAME]), shapes(states[HIFT_FILENAME])
    assert flow["input_embedding.weight"] == (6561, 512)
    assert flow["encoder.encoders.5.self_attn.pos_bias_u"] == (8, 64)
    assert "encoder.encoders.6.self_attn.pos_bias_u" not in flow
    assert flow["decoder.estimator.mid_blocks.11.0.block1.block.0.weight"] == (256, 256, 3)
    assert "decoder.estimator.mid_blocks.12.0.block1.block.0.weight" not in flow
    assert hift["conv_pre.parametrizations.weight.original1"] == (512, 80, 7)
    # 450 MB and 83 MB in float32.
    assert sum(t.numel() for t in states[FLOW_FILENAME].values()) == 112_549_360
    assert sum(t.numel() for t in states[HIFT_FILENAME].values()) == 20_821_295


def test_llm_has_qwen2_05b_shape_with_the_extended_vocabulary_and_an_untied_biased_head() -> None:
    config = full_size().llm
    dims = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads)
    assert dims == (896, 24, 14, 2)
    assert config.intermediate_size == 4864
    assert config.vocab_size == vocab.MODEL_VOCAB_SIZE
    assert config.tie_word_embeddings is False
    with torch.device("meta"):
        state = shapes(llm_state(config, stop_logit=FULL_STOP_LOGIT, fill_logit=FULL_FILL_LOGIT))
    assert state["model.embed_tokens.weight"] == state["lm_head.weight"] == (vocab.MODEL_VOCAB_SIZE, 896)
    assert state["lm_head.bias"] == (vocab.MODEL_VOCAB_SIZE,)
    assert state["model.layers.23.self_attn.q_proj.weight"] == (896, 896)
    assert state["model.layers.23.self_attn.k_proj.weight"] == (128, 896)
    assert state["model.layers.23.mlp.gate_proj.weight"] == (4864, 896)
    assert "model.layers.24.self_attn.q_proj.weight" not in state
    untied_rows = 2 * vocab.MODEL_VOCAB_SIZE * 896 + vocab.MODEL_VOCAB_SIZE
    expected = QWEN2_05B_PARAMETERS - QWEN2_05B_VOCAB_ROWS * 896 + untied_rows
    assert sum(torch.Size(shape).numel() for shape in state.values()) == expected


# The sampling every profile sets (profiles/cosyvoice2.toml).
PROFILE_SAMPLING = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1)


def tiny_llm_with_head_of(size: CheckpointSize, directory: Path) -> Path:
    return write_llm(directory, tiny_llm_config(), stop_logit=size.stop_logit, fill_logit=size.fill_logit)


@pytest.mark.parametrize(
    ("size", "stops_at_minimum"), [(full_size(), True), (tiny_size(), False)], ids=["full", "tiny"]
)
def test_the_stop_logit_ends_generation_as_soon_as_the_minimum_allows(
    tmp_path: Path, size: CheckpointSize, stops_at_minimum: bool
) -> None:
    llm_dir = tiny_llm_with_head_of(size, tmp_path / "cosyvoice2_llm")
    llm = TorchSpeechLLM(llm_dir)
    ids = vocab.build_prompt_ids(AutoTokenizer.from_pretrained(llm_dir), "Hi there.", "A longer sentence.", [5, 6, 7])
    lengths = [
        len(
            list(
                llm.generate(
                    ids, SamplingParams(seed=seed), max_new_tokens=80, min_new_tokens=minimum, stop_ids=vocab.STOP_IDS
                )
            )
        )
        for seed, minimum in ((0, 3), (1, 17), (2, 40))
    ]
    assert (lengths == [3, 17, 40]) is stops_at_minimum


def test_a_text_stream_on_the_full_sizes_head_speaks_its_text_in_rounds(tmp_path: Path) -> None:
    # A text stream has no minimum length: its rounds end at the fill token, its final stage may stop
    # at once. A head whose fill wins at every step (as the stop ids do) left it without speech.
    llm = TorchSpeechLLM(tiny_llm_with_head_of(full_size(), tmp_path / "cosyvoice2_llm"), max_slots=2)
    prompt_text = [1000 + k for k in range(30)]
    prompt_speech = vocab.speech_tokens_to_ids([(37 * k + 11) % vocab.SPEECH_TOKEN_SIZE for k in range(80)])
    text = [2000 + 13 * k for k in range(60)]
    limit = 600
    try:
        for seed in range(4):
            recorder = Recorder()
            handle = llm.open_stream(
                prompt_text,
                prompt_speech,
                SamplingParams(**{**vars(PROFILE_SAMPLING), "seed": seed}),
                max_new_tokens=limit,
                stop_ids=vocab.STOP_IDS,
                sink=recorder,
            )
            handle.add_text(text)
            handle.end_text()
            assert recorder.done.wait(60)
            assert recorder.error is None
            # About as much speech per text token as a request (2), at most the forced fills' pace
            # (with the first round, which only a drawn fill ends), and ended by the model, not the limit.
            assert len(text) <= len(recorder.tokens) <= len(text) * SPEECH_PER_ROUND // TEXT_PER_ROUND
    finally:
        llm.close()


def test_a_complete_checkpoint_is_reused_and_any_other_replaced(tmp_path: Path) -> None:
    root = tmp_path / "models"
    staging = tmp_path / "models.partial"
    staging.mkdir()
    (staging / "left-over").write_text("an interrupted write", encoding="utf-8")

    first, written = ensure_checkpoint(root, tiny_size(), seed=0)
    assert written
    assert not staging.exists()
    assert (first.model_dir / FLOW_FILENAME).is_file() and (first.llm_dir / "model.safetensors").is_file()
    flow_written = (first.model_dir / FLOW_FILENAME).stat().st_mtime_ns

    again, written = ensure_checkpoint(root, tiny_size(), seed=0)
    assert (again, written) == (first, False)
    assert (first.model_dir / FLOW_FILENAME).stat().st_mtime_ns == flow_written

    before = torch.load(first.model_dir / HIFT_FILENAME, weights_only=True)
    _, written = ensure_checkpoint(root, tiny_size(), seed=1)
    after = torch.load(first.model_dir / HIFT_FILENAME, weights_only=True)
    assert written
    assert not all(torch.equal(before[key], after[key]) for key in before)

    (root / MARKER_FILENAME).unlink()  # a checkpoint without its marker (written in place) is not trusted
    _, written = ensure_checkpoint(root, tiny_size(), seed=1)
    assert written


def test_processes_that_ask_for_one_checkpoint_at_once_get_it_written_once(tmp_path: Path) -> None:
    """As benchmarks started together over one work directory."""
    root, go = tmp_path / "models", tmp_path / "go"
    writer = textwrap.dedent(
        """
        import sys, time
        from pathlib import Path
        from tts_gateway.models.cosyvoice2.checkpoints.random_checkpoint import ensure_checkpoint
        from tts_gateway.models.cosyvoice2.checkpoints.tiny_checkpoint import tiny_size
        print("ready", flush=True)
        while not Path(sys.argv[2]).exists():
            time.sleep(0.005)
        _, written = ensure_checkpoint(Path(sys.argv[1]), tiny_size(), seed=0)
        print("written" if written else "reused", flush=True)
        """
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", writer, str(root), str(go)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    for process in processes:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
    go.touch()
    outcomes = sorted(process.communicate(timeout=300)[0].strip() for process in processes)
    assert [process.returncode for process in processes] == [0, 0, 0]
    assert outcomes == ["reused", "reused", "written"]
    checkpoint, written = ensure_checkpoint(root, tiny_size(), seed=0)
    assert not written
    assert (checkpoint.model_dir / FLOW_FILENAME).is_file() and (checkpoint.llm_dir / "model.safetensors").is_file()
