"""The flow estimator's levels compiled (flow_compile.py): the same audio, compiled once at load for every shape.

The GPU profiles compile with inductor; here ``aot_eager`` runs the same dynamo and AOTAutograd
tracing with symbolic shapes on the CPU, without generating kernels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from tests.cosyvoice.test_token2wav_batching import calls, tokens, voice
from tts_gateway.models.cosyvoice2.checkpoints.config_writer import tiny_config
from tts_gateway.models.cosyvoice2.checkpoints.random_checkpoint import official_config
from tts_gateway.models.cosyvoice2.engines.flow_compile import ALIGNED_FRAMES, compile_flow_levels
from tts_gateway.models.cosyvoice2.engines.token2wav import Conversion, Token2Wav
from tts_gateway.models.cosyvoice2.model.flow import CausalFlow, FlowItem
from tts_gateway.models.cosyvoice2.model.flow_decoder import Attention, UNetLevel
from tts_gateway.models.cosyvoice2.model.hift import Snake, snake

pytestmark = pytest.mark.cosyvoice


def _compiled_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def test_compiled_blocks_convert_every_shape_as_uncompiled_without_compiling_again(token2wav_dir: Path) -> None:
    plain = Token2Wav.from_model_dir(token2wav_dir)
    before = _compiled_graphs()
    compiled = Token2Wav.from_model_dir(token2wav_dir, compile_backend="aot_eager")
    loaded = _compiled_graphs()
    assert loaded > before
    # HiFT's activations too (hift_compile.py), so its part of the audio below runs compiled as well.
    assert all(m.activation is not snake for m in compiled.hift.modules() if isinstance(m, Snake))
    # One to six rows, first, later and final chunks and offline calls, frames of every length.
    batches = [calls("mixed"), calls("mixed-2")[:1], calls("mixed-3")[2:5]]
    for batch in batches:
        expected = plain.convert(batch)
        got = compiled.convert(batch)
        for want, have in zip(expected, got, strict=True):
            assert isinstance(want, np.ndarray) and isinstance(have, np.ndarray)
            np.testing.assert_allclose(have, want, atol=2e-4)
    later = Conversion("mixed-first-a", tokens(43, 1), voice(1, 10), 15, True)
    expected_later = plain.convert([later])[0]
    got_later = compiled.convert([later])[0]
    assert isinstance(expected_later, np.ndarray) and isinstance(got_later, np.ndarray)
    np.testing.assert_allclose(got_later, expected_later, atol=2e-4)
    assert _compiled_graphs() == loaded


def test_alike_levels_share_one_compiled_graph() -> None:
    """CosyVoice2's estimator has 14 U-Net levels: one down, 12 mid levels alike, one up."""
    flow = CausalFlow(official_config().flow).eval()
    torch._dynamo.reset()
    before = _compiled_graphs()
    compile_flow_levels(flow, "aot_eager", n_timesteps=2)
    assert sum(isinstance(module, UNetLevel) for module in flow.modules()) == 14
    assert _compiled_graphs() - before == 3


def test_compiled_levels_solve_several_voices_after_their_prefixes_without_compiling_again(
    token2wav_dir: Path,
) -> None:
    """Two voices' streams, their chunks in one solve each after its own voice's prefix (150 and 100 frames);
    the warm-up at load compiled the levels for a prefix too."""
    plain = Token2Wav.from_model_dir(token2wav_dir)
    compiled = Token2Wav.from_model_dir(token2wav_dir, compile_backend="aot_eager", prefix_cache_mb=64)
    loaded = _compiled_graphs()
    speakers = [voice(1, 80), voice(2, 60)]
    spoken = tokens(70, 3)
    for offset, end in ((0, 28), (25, 53), (50, 70)):
        batch = [Conversion(f"voice-{n}", spoken[:end], s, offset, end == 70) for n, s in enumerate(speakers)]
        for want, have in zip(plain.convert(batch), compiled.convert(batch), strict=True):
            assert isinstance(want, np.ndarray) and isinstance(have, np.ndarray)
            np.testing.assert_allclose(have, want, atol=2e-4)
    assert compiled.prefix_cache is not None and len(compiled.prefix_cache) == 2
    assert _compiled_graphs() == loaded


def test_compiling_needs_graph_buckets_of_aligned_frames(token2wav_dir: Path) -> None:
    with pytest.raises(ValueError, match="graph_frame_step a multiple of 8"):
        Token2Wav.from_model_dir(token2wav_dir, compile_backend="aot_eager", graph_rows=4, graph_frame_step=60)


def test_a_compile_that_fails_says_how_to_run_without(token2wav_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="empty compile_backend runs it uncompiled"):
        Token2Wav.from_model_dir(token2wav_dir, compile_backend="no-such-backend")


def test_without_a_warm_up_the_first_solve_compiles_the_levels() -> None:
    """What token2wav does before recording CUDA graphs: their largest bucket is the first call."""
    flow = CausalFlow(official_config().flow).eval()
    torch._dynamo.reset()
    before = _compiled_graphs()
    compile_flow_levels(flow, "aot_eager", n_timesteps=2, warm_up=False)
    assert _compiled_graphs() == before
    assert flow.frame_multiple == ALIGNED_FRAMES
    tokens = torch.zeros(20, dtype=torch.long)
    item = FlowItem(tokens, tokens, torch.zeros(40, 80), torch.ones(192), streaming=True, finalize=False)
    flow.inference_batch([item], n_timesteps=2)
    assert _compiled_graphs() - before == 3


def test_a_frame_count_equal_to_a_fused_weights_size_does_not_tie_the_two() -> None:
    """The tiny estimator's joined query/key/value weight has 96 rows: a first solve over 96 frames
    must not compile levels that only take 96 frames (CUDA graphs record every other count after it)."""
    torch.manual_seed(0)
    flow = CausalFlow(tiny_config().flow).eval()
    torch._dynamo.reset()
    compile_flow_levels(flow, "aot_eager", n_timesteps=2, warm_up=False)
    attention = next(m for m in flow.modules() if isinstance(m, Attention))
    assert attention.qkv_weight is not None and attention.qkv_weight.size(0) == 96
    decoder = flow.decoder

    def step(frames: int) -> None:
        mu, cond = torch.randn(2, 80, frames), torch.randn(2, 80, frames)
        guide = decoder.guidance(
            mu, torch.ones(2, 1, frames), torch.randn(2, 80), cond, torch.ones(2, dtype=torch.bool)
        )
        with torch.inference_mode():
            decoder.step(torch.randn(2, 80, frames), guide, torch.zeros(1), torch.full((1,), 0.5))

    before = _compiled_graphs()
    step(96)
    compiled = _compiled_graphs()
    assert compiled - before == 3
    for frames in (104, 160, 64):
        step(frames)
    assert _compiled_graphs() == compiled
