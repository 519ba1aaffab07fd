"""Numerical parity of our HiFT with upstream's ``cosyvoice.hifigan.generator.HiFTGenerator``.

Both models get the same seeded random weights (upstream's state dict, loaded strictly into ours).

The harmonic source is stochastic: upstream draws a random initial phase per overtone and additive
noise from torch's global RNG. Ours makes the same draws, in the same order and memory layout, so
seeding the global RNG identically before each call must give the same waveform; that is the
first comparison. The second needs no seeding at all: a ``cache_source`` as long as the
excitation replaces every random sample in both models, leaving a deterministic function of the
mel and the weights. Together they cover the random and the deterministic parts separately.

The streamed comparison runs upstream's own chunk loop (``CosyVoice2Model.token2wav``: mel and
source caches, Hamming cross-fade, withheld tail) against :class:`HiftStreamState` with the raw
Hamming halves upstream uses, both fed the same mel.

Upstream's ``generator.py`` imports ``scipy.signal.get_window`` only to build its periodic Hann
window. scipy is not a dependency of this project; when it is absent, a stand-in computing that
window from its definition (``0.5 - 0.5 cos(2 pi n / N)``) is registered for the import and removed
right after. ``cosyvoice/cli/model.py`` imports torchaudio (through ``cosyvoice.utils.file_utils``)
without using it in ``token2wav``; an empty stand-in module is registered for that import only.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

from tts_gateway.models.cosyvoice2.checkpoints.config_writer import tiny_config
from tts_gateway.models.cosyvoice2.model.config import HiftConfig
from tts_gateway.models.cosyvoice2.model.hift import HiFTGenerator
from tts_gateway.models.cosyvoice2.model.hift_stream import HiftStreamState

pytestmark = pytest.mark.cosyvoice

TOLERANCE = 1e-4
FRAMES = 24


def periodic_hann(name: str, length: int, fftbins: bool = True) -> NDArray[np.float64]:
    if name != "hann" or not fftbins:
        raise NotImplementedError(f"stand-in get_window only builds the periodic Hann window, not {name!r}")
    window: NDArray[np.float64] = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(length) / length)
    return window


@contextmanager
def stand_in(name: str) -> Iterator[None]:
    """An empty module ``name`` for the duration of an import that does not use it."""
    sys.modules[name] = types.ModuleType(name)
    try:
        yield
    finally:
        del sys.modules[name]


@contextmanager
def scipy_signal_available() -> Iterator[None]:
    try:
        importlib.import_module("scipy.signal")
    except ImportError:
        signal = types.ModuleType("scipy.signal")
        signal.get_window = periodic_hann  # type: ignore[attr-defined]
        scipy = types.ModuleType("scipy")
        scipy.signal = signal  # type: ignore[attr-defined]
        sys.modules.update({"scipy": scipy, "scipy.signal": signal})
        try:
            yield
        finally:
            del sys.modules["scipy"], sys.modules["scipy.signal"]
    else:
        yield


@pytest.fixture(scope="module")
def upstream(reference_dir: Path) -> types.SimpleNamespace:
    with scipy_signal_available():
        generator = importlib.import_module("cosyvoice.hifigan.generator")
    f0_predictor = importlib.import_module("cosyvoice.hifigan.f0_predictor")
    with stand_in("torchaudio"):
        model = importlib.import_module("cosyvoice.cli.model")
    return types.SimpleNamespace(
        HiFTGenerator=generator.HiFTGenerator,
        F0=f0_predictor.ConvRNNF0Predictor,
        CosyVoice2Model=model.CosyVoice2Model,
    )


def build_upstream(upstream: types.SimpleNamespace, cfg: HiftConfig) -> Any:
    return upstream.HiFTGenerator(
        in_channels=cfg.in_channels,
        base_channels=cfg.base_channels,
        nb_harmonics=cfg.nb_harmonics,
        sampling_rate=cfg.sampling_rate,
        nsf_alpha=cfg.nsf_alpha,
        nsf_sigma=cfg.nsf_sigma,
        nsf_voiced_threshold=cfg.nsf_voiced_threshold,
        upsample_rates=list(cfg.upsample_rates),
        upsample_kernel_sizes=list(cfg.upsample_kernel_sizes),
        istft_params={"n_fft": cfg.istft_n_fft, "hop_len": cfg.istft_hop_len},
        resblock_kernel_sizes=list(cfg.resblock_kernel_sizes),
        resblock_dilation_sizes=[list(d) for d in cfg.resblock_dilation_sizes],
        source_resblock_kernel_sizes=list(cfg.source_resblock_kernel_sizes),
        source_resblock_dilation_sizes=[list(d) for d in cfg.source_resblock_dilation_sizes],
        lrelu_slope=cfg.lrelu_slope,
        audio_limit=cfg.audio_limit,
        f0_predictor=upstream.F0(
            num_class=cfg.f0_num_class, in_channels=cfg.f0_in_channels, cond_channels=cfg.f0_cond_channels
        ),
    ).eval()


CONFIGS = {
    "tiny": tiny_config().hift,
    # Two stages, another kernel set and fewer harmonics: the loops must not assume three.
    "two-stage": dataclasses.replace(
        tiny_config().hift,
        base_channels=24,
        nb_harmonics=4,
        upsample_rates=(8, 15),
        upsample_kernel_sizes=(16, 15),
        resblock_kernel_sizes=(3, 5),
        resblock_dilation_sizes=((1, 3), (1, 3)),
        source_resblock_kernel_sizes=(7, 11),
        source_resblock_dilation_sizes=((1, 3, 5), (1, 3, 5)),
        f0_cond_channels=16,
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest, upstream: types.SimpleNamespace) -> tuple[Any, HiFTGenerator, torch.Tensor]:
    """Upstream and our model with the same seeded random weights, and a mel to vocode."""
    cfg = CONFIGS[request.param]
    torch.manual_seed(1234)
    reference = build_upstream(upstream, cfg)
    mel = torch.randn(1, cfg.in_channels, FRAMES, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
        # Rescale the F0 head so the predicted F0 has a 30 Hz spread around 0 Hz: after abs(),
        # about a quarter of the frames fall below the 10 Hz voicing threshold.
        classifier = reference.f0_predictor.classifier
        raw = classifier(reference.f0_predictor.condnet(mel).transpose(1, 2))
        classifier.weight.mul_(30.0 / raw.std())
        classifier.bias.sub_(raw.mean()).mul_(30.0 / raw.std())
        voiced = (reference.f0_predictor(mel) > cfg.nsf_voiced_threshold).float().mean().item()
    ours = HiFTGenerator(cfg).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    assert 0.2 < voiced < 0.9, "the weights must give both voiced and unvoiced frames"
    return reference, ours, mel


def test_state_dict_keys_and_shapes_match_upstream(upstream: types.SimpleNamespace) -> None:
    real = dataclasses.replace(tiny_config().hift, base_channels=512, f0_cond_channels=512)
    for cfg in (*CONFIGS.values(), real):
        expected = {key: tuple(value.shape) for key, value in build_upstream(upstream, cfg).state_dict().items()}
        actual = {key: tuple(value.shape) for key, value in HiFTGenerator(cfg).state_dict().items()}
        assert actual == expected


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_waveform_and_source_match_upstream(pair: tuple[Any, HiFTGenerator, torch.Tensor], seed: int) -> None:
    reference, ours, mel = pair
    torch.manual_seed(seed)
    expected_wav, expected_source = reference.inference(mel)
    torch.manual_seed(seed)
    actual_wav, actual_source = ours.inference(mel)
    assert actual_wav.shape == expected_wav.shape == (1, FRAMES * 480)
    assert float((actual_source - expected_source).abs().max()) < TOLERANCE
    assert float((actual_wav - expected_wav).abs().max()) < TOLERANCE
    assert float(expected_wav.std()) > 1e-3


def test_an_explicit_generator_draws_what_upstreams_global_rng_draws(
    pair: tuple[Any, HiFTGenerator, torch.Tensor],
) -> None:
    reference, ours, mel = pair
    torch.manual_seed(5)
    expected, _ = reference.inference(mel)
    actual, _ = ours.inference(mel, generator=torch.Generator().manual_seed(5))
    assert float((actual - expected).abs().max()) < TOLERANCE


def test_with_the_whole_source_cached_the_output_matches_without_seeding(
    pair: tuple[Any, HiFTGenerator, torch.Tensor],
) -> None:
    reference, ours, mel = pair
    torch.manual_seed(11)
    _, source = reference.inference(mel)
    expected, _ = reference.inference(mel, cache_source=source)
    actual, _ = ours.inference(mel, source)
    assert float((actual - expected).abs().max()) < TOLERANCE


def test_a_partial_cache_source_is_applied_like_upstream(pair: tuple[Any, HiFTGenerator, torch.Tensor]) -> None:
    reference, ours, mel = pair
    cache = 0.1 * torch.randn(1, 1, 8 * 480, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(21)
    expected_wav, expected_source = reference.inference(mel, cache_source=cache)
    torch.manual_seed(21)
    actual_wav, actual_source = ours.inference(mel, cache)
    assert float((actual_source - expected_source).abs().max()) < TOLERANCE
    assert float((actual_wav - expected_wav).abs().max()) < TOLERANCE


def test_upstreams_saved_checkpoint_loads_through_from_checkpoint(
    tmp_path: Path, pair: tuple[Any, HiFTGenerator, torch.Tensor]
) -> None:
    reference, _, mel = pair
    path = tmp_path / "hift.pt"
    torch.save(reference.state_dict(), path)
    cfg = next(cfg for cfg in CONFIGS.values() if cfg.base_channels == reference.conv_pre.out_channels)
    loaded = HiFTGenerator.from_checkpoint(cfg, path, torch.device("cpu"), torch.float32)
    torch.manual_seed(8)
    expected, _ = reference.inference(mel)
    torch.manual_seed(8)
    actual, _ = loaded.inference(mel)
    assert float((actual - expected).abs().max()) < TOLERANCE


class PrecomputedFlow:
    """Stands in for upstream's flow inside ``CosyVoice2Model.token2wav``: the mel of a token prefix,
    cut from one fixed mel exactly as the real flow cuts it (look-ahead tokens get no frames)."""

    token_mel_ratio = 2
    pre_lookahead_len = 3

    def __init__(self, mel: torch.Tensor) -> None:
        self.mel = mel

    def inference(self, *, token: torch.Tensor, finalize: bool, **_: Any) -> tuple[torch.Tensor, None]:
        voiced = token.shape[1] if finalize else token.shape[1] - self.pre_lookahead_len
        return self.mel[:, :, : self.token_mel_ratio * voiced], None


@pytest.mark.filterwarnings("ignore:`torch.cuda.amp.autocast:FutureWarning")
def test_streamed_chunks_match_upstreams_token2wav_loop(
    upstream: types.SimpleNamespace, pair: tuple[Any, HiFTGenerator, torch.Tensor]
) -> None:
    reference, ours, _ = pair
    total_tokens, hops = 70, [15, 25]
    mel = torch.randn(1, 80, 2 * total_tokens, generator=torch.Generator().manual_seed(4))
    model = upstream.CosyVoice2Model(None, PrecomputedFlow(mel), reference)
    model.hift_cache_dict["request"] = None
    state = HiftStreamState(normalized_crossfade=False)
    no_prompt_tokens, no_prompt_feat = torch.zeros(1, 0, dtype=torch.int32), torch.zeros(1, 0, 80)
    embedding = torch.zeros(1, 192)

    offset, chunk = 0, 0
    for hop in [*hops, None]:
        final = hop is None
        end = total_tokens if hop is None else offset + hop + PrecomputedFlow.pre_lookahead_len
        tokens = torch.zeros(1, end, dtype=torch.int32)
        torch.manual_seed(100 + chunk)
        expected = model.token2wav(
            tokens, no_prompt_tokens, no_prompt_feat, embedding, offset, "request", stream=not final, finalize=final
        )[0]
        torch.manual_seed(100 + chunk)
        voiced = end if final else end - PrecomputedFlow.pre_lookahead_len
        actual = state.step(mel[:, :, 2 * offset : 2 * voiced], ours.inference, final=final)
        assert actual.shape == expected.shape
        assert float((actual - expected).abs().max()) < TOLERANCE
        offset, chunk = offset + (hop or 0), chunk + 1
