"""HiftGraphs: streamed chunks of recorded shapes are vocoded from the static buffers, exactly as HiFT vocodes them.

On the CPU every recorded shape replays eagerly over the same static buffers as a CUDA graph
would, so these tests check the bookkeeping (shapes, padded rows, noise and cache copied in);
that the recorded graphs replay what they recorded is the GPU check's (benchmarks/gpu_engine_check.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.cosyvoice.test_token2wav_batching import two_streams_in_step, voice
from tts_gateway.models.cosyvoice2.checkpoints.config_writer import tiny_config
from tts_gateway.models.cosyvoice2.engines.hift_graphs import HiftGraphs
from tts_gateway.models.cosyvoice2.engines.token2wav import Token2Wav
from tts_gateway.models.cosyvoice2.model.hift import ExcitationNoise, HiFTGenerator

pytestmark = pytest.mark.cosyvoice

PER_FRAME = 480


@pytest.fixture(scope="module")
def hift() -> HiFTGenerator:
    torch.manual_seed(0)
    model = HiFTGenerator(tiny_config().hift).eval()
    with torch.no_grad():
        # Random weights predict an F0 near 0 Hz: every frame unvoiced. Around 150 Hz the sines sound.
        model.f0_predictor.classifier.bias.fill_(150.0)
    return model


@pytest.fixture(scope="module")
def graphs(hift: HiFTGenerator) -> HiftGraphs:
    return HiftGraphs(hift, max_rows=4, hops=[15, 25], token_mel_ratio=2, cache_frames=8)


def inputs(
    hift: HiFTGenerator, rows: int, frames: int, cached: int, seed: int
) -> tuple[torch.Tensor, ExcitationNoise, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    mel = torch.randn(rows, 80, frames, generator=generator)
    noise = hift.draw_noise(rows, frames, [torch.Generator().manual_seed(seed + row) for row in range(rows)])
    cache = torch.randn(rows, 1, cached * PER_FRAME, generator=generator) * 0.1 if cached else None
    return mel, noise, cache


def test_shapes_are_the_hops_first_and_after_the_cached_frames(graphs: HiftGraphs) -> None:
    shapes = {(30, 0), (38, 8), (50, 0), (58, 8)}
    assert graphs.buckets == sorted((rows, *shape) for rows in (1, 2, 4) for shape in shapes)


@pytest.mark.parametrize(("rows", "frames", "cached"), [(1, 30, 0), (3, 58, 8), (4, 38, 8), (2, 50, 0)])
def test_a_recorded_shape_is_vocoded_as_hift_vocodes_it(
    hift: HiFTGenerator, graphs: HiftGraphs, rows: int, frames: int, cached: int
) -> None:
    # A larger batch first leaves its data in the static buffers: none of it may leak into this one.
    graphs(*inputs(hift, 4, 58, 8, seed=50))
    mel, noise, cache = inputs(hift, rows, frames, cached, seed=rows + frames)
    assert graphs.covers(rows, frames, cached * PER_FRAME)
    replayed = graphs(mel, noise, cache)
    assert replayed is not None
    with torch.inference_mode():
        expected_wav, expected_source = hift.vocode(mel, noise, cache)
    wav, source = replayed
    assert wav.shape == (rows, frames * PER_FRAME) and source.shape == (rows, 1, frames * PER_FRAME)
    torch.testing.assert_close(wav, expected_wav, rtol=0, atol=1e-6)
    torch.testing.assert_close(source, expected_source, rtol=0, atol=1e-6)
    if cache is not None:
        torch.testing.assert_close(source[:, :, : cache.shape[2]], cache, rtol=0, atol=0)
    assert float(wav.std()) > 1e-3


def test_the_results_are_copies_a_later_replay_leaves_alone(hift: HiFTGenerator, graphs: HiftGraphs) -> None:
    replayed = graphs(*inputs(hift, 1, 30, 0, seed=1))
    assert replayed is not None
    kept = replayed[0].clone()
    graphs(*inputs(hift, 1, 30, 0, seed=2))
    torch.testing.assert_close(replayed[0], kept, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("rows", "frames", "cached"),
    [(5, 30, 0), (1, 31, 0), (1, 30, 8), (1, 58, 0), (1, 58, 4)],
    ids=["too-many-rows", "other-frames", "first-chunk-with-a-cache", "later-chunk-without", "other-cache"],
)
def test_a_shape_not_recorded_is_left_to_hift(
    hift: HiFTGenerator, graphs: HiftGraphs, rows: int, frames: int, cached: int
) -> None:
    assert not graphs.covers(rows, frames, cached * PER_FRAME)
    assert graphs(*inputs(hift, rows, frames, cached, seed=3)) is None


def test_bad_settings_are_refused(hift: HiFTGenerator) -> None:
    for rows, hops in ((0, [15]), (4, []), (4, [0, 15])):
        with pytest.raises(ValueError, match="HiFT graphs need"):
            HiftGraphs(hift, max_rows=rows, hops=hops, token_mel_ratio=2, cache_frames=8)


class CountingGraphs(HiftGraphs):
    replayed = 0

    def __call__(
        self, mel: torch.Tensor, noise: ExcitationNoise, cache_source: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        result = super().__call__(mel, noise, cache_source)
        self.replayed += result is not None
        return result


def test_streams_vocoded_by_the_graphs_sound_as_without(token2wav_dir: Path) -> None:
    """Two streams in step (first hop 15, then 25, then the final chunk): the same audio either way."""
    eager = Token2Wav.from_model_dir(token2wav_dir, device="cpu", dtype=torch.float32)
    graphs = CountingGraphs(eager.hift, max_rows=4, hops=[15, 25], token_mel_ratio=2, cache_frames=8)
    graphed = Token2Wav(eager.flow, eager.hift, hift_graphs=graphs)
    prompt = voice(0, 12)
    tokens = np.random.default_rng(0).integers(0, 6561, 60)
    audio: dict[str, list[np.ndarray]] = {}
    for name, t2w in (("eager", eager), ("graphs", graphed)):
        chunks = two_streams_in_step(t2w, name, prompt, tokens)
        audio[name] = chunks
    # The first two chunks of both streams came from the graphs (one batch each); the final chunk did not.
    assert graphs.replayed == 2
    for expected, actual in zip(audio["eager"], audio["graphs"], strict=True):
        assert actual.shape == expected.shape
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
    assert graphed.active_streams == eager.active_streams == 0
