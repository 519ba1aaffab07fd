"""The CosyVoice2 flow on tiny random weights: shapes, determinism, streaming causality, checkpoints."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import Tensor

from tts_gateway.models.cosyvoice2.checkpoints.config_writer import tiny_config
from tts_gateway.models.cosyvoice2.model.config import FlowConfig
from tts_gateway.models.cosyvoice2.model.flow import CausalFlow
from tts_gateway.models.cosyvoice2.model.flow_decoder import Attention, CausalConv1d

pytestmark = pytest.mark.cosyvoice

PROMPT_TOKENS = 20
MEL = 80


@dataclasses.dataclass(frozen=True)
class Inputs:
    token: Tensor
    prompt_token: Tensor
    prompt_feat: Tensor
    embedding: Tensor


def make_inputs(target_tokens: int, seed: int = 7) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    return Inputs(
        token=torch.randint(0, 6561, (1, target_tokens), generator=g),
        prompt_token=torch.randint(0, 6561, (1, PROMPT_TOKENS), generator=g),
        prompt_feat=torch.randn(1, 2 * PROMPT_TOKENS, MEL, generator=g),
        embedding=torch.randn(1, 192, generator=g),
    )


def run(flow: CausalFlow, inputs: Inputs, *, streaming: bool, finalize: bool) -> Tensor:
    return flow.inference(
        inputs.token,
        inputs.prompt_token,
        inputs.prompt_feat,
        inputs.embedding,
        streaming=streaming,
        finalize=finalize,
    )


def build(cfg: FlowConfig, seed: int = 0) -> CausalFlow:
    torch.manual_seed(seed)
    flow = CausalFlow(cfg).eval()
    with torch.no_grad():
        for name, parameter in flow.named_parameters():
            if "pos_bias" in name:  # zero-initialised; random values exercise the relative-position terms
                parameter.normal_(0.0, 0.5)
    return flow


@pytest.fixture(scope="module")
def flow() -> CausalFlow:
    return build(tiny_config().flow)


@pytest.mark.parametrize(
    ("streaming", "finalize", "frames"),
    [(False, True, 60), (True, True, 60), (True, False, 54), (False, False, 54)],
)
def test_mel_covers_the_target_tokens(flow: CausalFlow, streaming: bool, finalize: bool, frames: int) -> None:
    mel = run(flow, make_inputs(30), streaming=streaming, finalize=finalize)

    assert mel.shape == (1, MEL, frames)
    assert frames == flow.mel_frames(30, finalize=finalize)
    assert mel.dtype == torch.float32
    assert torch.isfinite(mel).all()
    assert mel.std() > 0.1


def test_same_input_gives_identical_mel_even_from_a_fresh_module(flow: CausalFlow) -> None:
    inputs = make_inputs(30)
    first = run(flow, inputs, streaming=True, finalize=False)
    again = run(flow, inputs, streaming=True, finalize=False)
    rebuilt = CausalFlow(flow.cfg).eval()
    rebuilt.load_state_dict(flow.state_dict())

    assert torch.equal(first, again)
    assert torch.equal(first, run(rebuilt, inputs, streaming=True, finalize=False))


def test_fixed_noise_is_not_part_of_the_checkpoint(flow: CausalFlow) -> None:
    assert "decoder.rand_noise" not in flow.state_dict()
    assert flow.decoder.rand_noise.shape == (1, MEL, 15000)
    expected = torch.randn([1, MEL, 15000], generator=torch.Generator().manual_seed(0))
    assert torch.equal(flow.decoder.rand_noise, expected)


def test_inputs_change_the_mel(flow: CausalFlow) -> None:
    base = make_inputs(30)
    mel = run(flow, base, streaming=False, finalize=True)
    other_speaker = dataclasses.replace(base, embedding=-base.embedding)
    other_tokens = dataclasses.replace(base, token=(base.token + 1) % 6561)

    assert not torch.allclose(mel, run(flow, other_speaker, streaming=False, finalize=True), atol=1e-3)
    assert not torch.allclose(mel, run(flow, other_tokens, streaming=False, finalize=True), atol=1e-3)


def test_streaming_frames_do_not_change_when_later_tokens_arrive(flow: CausalFlow) -> None:
    """With chunked attention a frame depends only on its chunk, earlier ones and the 3-token look-ahead.

    The encoder's first chunk holds prompt + target tokens 0..4 (25 tokens); their look-ahead reaches
    target token 7. A non-final call with 10 target tokens and the final call with all 30 must agree
    on target frames 0..9. Without chunked attention (offline mode) they must not.
    """
    whole = make_inputs(30)
    prefix = dataclasses.replace(whole, token=whole.token[:, :10])
    stable = 2 * (25 - PROMPT_TOKENS)

    streamed_prefix = run(flow, prefix, streaming=True, finalize=False)
    streamed_whole = run(flow, whole, streaming=True, finalize=True)
    torch.testing.assert_close(streamed_prefix[:, :, :stable], streamed_whole[:, :, :stable], rtol=0, atol=1e-5)

    offline_prefix = run(flow, prefix, streaming=False, finalize=False)
    offline_whole = run(flow, whole, streaming=False, finalize=True)
    assert (offline_prefix[:, :, :stable] - offline_whole[:, :, :stable]).abs().max() > 1e-3


def test_lookahead_tokens_shape_the_last_frames(flow: CausalFlow) -> None:
    inputs = make_inputs(12)
    changed_lookahead = inputs.token.clone()
    changed_lookahead[:, -3:] = (changed_lookahead[:, -3:] + 100) % 6561
    mel = run(flow, inputs, streaming=True, finalize=False)
    other = run(flow, dataclasses.replace(inputs, token=changed_lookahead), streaming=True, finalize=False)

    assert mel.shape == other.shape == (1, MEL, 18)
    assert (mel[:, :, -2:] - other[:, :, -2:]).abs().max() > 1e-3


def test_checkpoint_round_trip_and_dtype(flow: CausalFlow, tmp_path: Path) -> None:
    path = tmp_path / "flow.pt"
    torch.save(flow.state_dict(), path)
    inputs = make_inputs(16)
    expected = run(flow, inputs, streaming=False, finalize=True)

    loaded = CausalFlow.from_checkpoint(flow.cfg, path, torch.device("cpu"), torch.float32)
    assert not loaded.training
    assert torch.equal(run(loaded, inputs, streaming=False, finalize=True), expected)

    half = CausalFlow.from_checkpoint(flow.cfg, path, torch.device("cpu"), torch.bfloat16)
    mel = run(half, inputs, streaming=False, finalize=True)
    assert mel.dtype == torch.float32
    assert torch.corrcoef(torch.stack([mel.flatten(), expected.flatten()]))[0, 1] > 0.95


def test_checkpoint_of_another_architecture_is_refused(flow: CausalFlow, tmp_path: Path) -> None:
    path = tmp_path / "flow.pt"
    torch.save(flow.state_dict(), path)
    cfg = tiny_config().flow
    deeper = dataclasses.replace(cfg, encoder=dataclasses.replace(cfg.encoder, num_blocks=2))

    with pytest.raises(RuntimeError, match=r"(?s)flow\.pt does not match.*encoder\.encoders\.1"):
        CausalFlow.from_checkpoint(deeper, path, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"token": torch.zeros(2, 5, dtype=torch.long)}, "one utterance"),
        ({"token": torch.zeros(1, 5)}, "integer"),
        ({"prompt_feat": torch.zeros(1, 39, MEL)}, "prompt_feat must be"),
        ({"embedding": torch.zeros(1, 80)}, "embedding must be"),
        ({"token": torch.zeros(1, 2, dtype=torch.long)}, "look-ahead"),
    ],
)
def test_malformed_inputs_are_rejected(flow: CausalFlow, change: dict[str, Tensor], message: str) -> None:
    inputs = dataclasses.replace(make_inputs(8), **change)
    with pytest.raises(ValueError, match=message):
        run(flow, inputs, streaming=True, finalize=False)


def test_final_call_needs_no_lookahead(flow: CausalFlow) -> None:
    mel = run(flow, make_inputs(2), streaming=True, finalize=True)
    assert mel.shape == (1, MEL, 4)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_frame_multiple_pads_an_eager_solve_without_changing_the_mel(flow: CausalFlow, streaming: bool) -> None:
    """20 + 13 tokens give 66 frames: with a multiple of 8 (what compiling sets) the estimator sees 72,
    and the target's mel is what 66 give."""
    seen: list[int] = []
    hook = flow.decoder.estimator.register_forward_pre_hook(lambda module, args: seen.append(args[0].size(2)))
    inputs = make_inputs(13)
    try:
        assert flow.frame_multiple == 1
        plain = run(flow, inputs, streaming=streaming, finalize=True)
        assert set(seen) == {66}
        seen.clear()
        flow.frame_multiple = 8
        padded = run(flow, inputs, streaming=streaming, finalize=True)
        assert set(seen) == {72}
    finally:
        flow.frame_multiple = 1
        hook.remove()
    assert padded.shape == plain.shape == (1, MEL, 26)
    torch.testing.assert_close(padded, plain, atol=1e-5, rtol=0)


def fused_copy_gives_the_same_mel(flow: CausalFlow, cases: list[tuple[Inputs, bool, bool]]) -> CausalFlow:
    """A fused copy of ``flow``, checked against it on each (inputs, streaming, finalize) case. On the CPU the
    fused GELU is the exact one too, so only summation order differs."""
    fused = copy.deepcopy(flow)
    fused.decoder.estimator.fuse_kernels()
    for inputs, streaming, finalize in cases:
        want = run(flow, inputs, streaming=streaming, finalize=finalize)
        torch.testing.assert_close(run(fused, inputs, streaming=streaming, finalize=finalize), want)
    return fused


def test_fused_kernels_compute_the_same_mel_from_the_same_parameters(flow: CausalFlow) -> None:
    inputs = make_inputs(43)
    fused = fused_copy_gives_the_same_mel(flow, [(inputs, True, False), (inputs, True, True), (inputs, False, True)])
    before, after = flow.state_dict(), fused.state_dict()
    assert list(after) == list(before)
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=0)


def test_fused_kernels_hold_every_weight_once(flow: CausalFlow) -> None:
    fused = copy.deepcopy(flow)
    estimator = fused.decoder.estimator
    estimator.fuse_kernels()
    attention = estimator.mid_blocks[0][1][0].attn1
    assert isinstance(attention, Attention) and attention.qkv_weight is not None
    for index, linear in enumerate((attention.to_q, attention.to_k, attention.to_v)):
        assert linear.weight.untyped_storage().data_ptr() == attention.qkv_weight.untyped_storage().data_ptr()
        torch.testing.assert_close(attention.qkv_weight.chunk(3)[index], linear.weight, rtol=0, atol=0)
    convolutions = [module for module in estimator.modules() if isinstance(module, CausalConv1d)]
    assert convolutions and all(conv.as_matmul for conv in convolutions)
    # Stored tap by tap: the taps' matrices a product reads are a view, not a copy made at every call.
    assert all(conv.weight.permute(2, 0, 1).is_contiguous() for conv in convolutions)


def test_fused_kernels_compute_the_same_mel_in_a_two_level_u_net() -> None:
    """Strided down- and upsampling between the levels: their masks, biases and skips pair up as unfused."""
    tiny = tiny_config().flow
    estimator = dataclasses.replace(tiny.decoder.estimator, channels=(32, 32))
    two_levels = build(
        dataclasses.replace(tiny, decoder=dataclasses.replace(tiny.decoder, estimator=estimator)), seed=4
    )
    fused_copy_gives_the_same_mel(two_levels, [(make_inputs(21, seed=21), True, False), (make_inputs(30), False, True)])


def test_fusing_again_changes_nothing(flow: CausalFlow) -> None:
    fused = copy.deepcopy(flow)
    estimator = fused.decoder.estimator
    estimator.fuse_kernels()
    joined = [m.qkv_weight for m in estimator.modules() if isinstance(m, Attention)]
    estimator.fuse_kernels()
    again = [m.qkv_weight for m in estimator.modules() if isinstance(m, Attention)]
    assert len(again) == len(joined) > 0 and all(new is old for new, old in zip(again, joined, strict=True))
