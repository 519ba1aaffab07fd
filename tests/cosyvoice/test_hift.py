"""The HiFT vocoder on its own: checkpoint layout, loading, shapes, randomness and streaming cache."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tts_gateway.models.cosyvoice2.checkpoints.config_writer import tiny_config
from tts_gateway.models.cosyvoice2.model.config import HiftConfig
from tts_gateway.models.cosyvoice2.model.hift import HiFTGenerator, _fourier_bases

pytestmark = pytest.mark.cosyvoice

FRAMES = 20
SAMPLES_PER_FRAME = 480


def real_size(cfg: HiftConfig) -> HiftConfig:
    """CosyVoice2-0.5B's HiFT: the tiny preset differs only in its channel counts."""
    return dataclasses.replace(cfg, base_channels=512, f0_cond_channels=512)


@pytest.fixture(scope="module")
def cfg() -> HiftConfig:
    return tiny_config().hift


@pytest.fixture(scope="module")
def vocoder(cfg: HiftConfig) -> HiFTGenerator:
    torch.manual_seed(0)
    return HiFTGenerator(cfg).eval()


@pytest.fixture(scope="module")
def mel() -> torch.Tensor:
    return torch.randn(1, 80, FRAMES, generator=torch.Generator().manual_seed(1))


def test_real_hyperparameters_give_the_layout_of_the_released_hift_pt(cfg: HiftConfig) -> None:
    state = HiFTGenerator(real_size(cfg)).state_dict()
    # The released CosyVoice2-0.5B hift.pt: 328 tensors, 20,821,295 values, parametrized weight norm.
    assert len(state) == 328
    assert sum(tensor.numel() for tensor in state.values()) == 20_821_295
    assert state["conv_pre.parametrizations.weight.original0"].shape == (512, 1, 1)
    assert state["conv_pre.parametrizations.weight.original1"].shape == (512, 80, 7)
    assert state["ups.0.parametrizations.weight.original1"].shape == (512, 256, 16)
    assert state["source_downs.0.weight"].shape == (256, 18, 30)
    assert state["source_downs.2.weight"].shape == (64, 18, 1)
    assert state["resblocks.8.activations2.2.alpha"].shape == (64,)
    assert state["conv_post.parametrizations.weight.original1"].shape == (18, 64, 7)
    assert state["f0_predictor.condnet.8.parametrizations.weight.original1"].shape == (512, 512, 3)
    assert state["m_source.l_linear.weight"].shape == (1, 9)
    assert not any(key.endswith(("weight_g", "weight_v")) or "window" in key for key in state)


def test_inference_yields_480_samples_per_frame_within_the_audio_limit(
    vocoder: HiFTGenerator, mel: torch.Tensor
) -> None:
    wav, source = vocoder.inference(mel, generator=torch.Generator().manual_seed(0))
    assert wav.shape == (1, FRAMES * SAMPLES_PER_FRAME)
    assert source.shape == (1, 1, FRAMES * SAMPLES_PER_FRAME)
    assert wav.dtype == torch.float32
    assert torch.isfinite(wav).all()
    assert float(wav.abs().max()) <= 0.99
    assert float(wav.std()) > 1e-3


def test_the_excitation_is_reproducible_with_a_generator_and_random_without(
    vocoder: HiFTGenerator, mel: torch.Tensor
) -> None:
    first, _ = vocoder.inference(mel, generator=torch.Generator().manual_seed(7))
    again, _ = vocoder.inference(mel, generator=torch.Generator().manual_seed(7))
    other, _ = vocoder.inference(mel, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first, other)


def test_a_cached_source_replaces_the_start_of_the_excitation(vocoder: HiFTGenerator, mel: torch.Tensor) -> None:
    _, previous = vocoder.inference(mel, generator=torch.Generator().manual_seed(3))
    cache = previous[:, :, -3840:]
    _, source = vocoder.inference(mel, cache, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(source[:, :, :3840], cache, rtol=0, atol=0)
    assert not torch.equal(source[:, :, 3840:], previous[:, :, 3840:])


def test_a_full_length_cached_source_makes_the_output_independent_of_the_rng(
    vocoder: HiFTGenerator, mel: torch.Tensor
) -> None:
    _, source = vocoder.inference(mel, generator=torch.Generator().manual_seed(5))
    first, _ = vocoder.inference(mel, source, generator=torch.Generator().manual_seed(6))
    second, _ = vocoder.inference(mel, source, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_from_checkpoint_loads_a_saved_state_dict_strictly(
    tmp_path: Path, cfg: HiftConfig, vocoder: HiFTGenerator, mel: torch.Tensor
) -> None:
    path = tmp_path / "hift.pt"
    torch.save(vocoder.state_dict(), path)
    loaded = HiFTGenerator.from_checkpoint(cfg, path, torch.device("cpu"), torch.float32)
    expected, _ = vocoder.inference(mel, generator=torch.Generator().manual_seed(0))
    actual, _ = loaded.inference(mel, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert not loaded.training
    # Weight norm is folded into plain weights once loaded.
    assert "conv_pre.weight" in loaded.state_dict()
    assert not any("parametrizations" in key for key in loaded.state_dict())


def test_from_checkpoint_accepts_the_generator_prefix_and_legacy_weight_norm_names(
    tmp_path: Path, cfg: HiftConfig, vocoder: HiFTGenerator, mel: torch.Tensor
) -> None:
    legacy = {}
    for key, value in vocoder.state_dict().items():
        key = key.replace("parametrizations.weight.original0", "weight_g")
        key = key.replace("parametrizations.weight.original1", "weight_v")
        legacy[f"generator.{key}"] = value
    path = tmp_path / "hift.pt"
    torch.save(legacy, path)
    loaded = HiFTGenerator.from_checkpoint(cfg, path, torch.device("cpu"), torch.float32)
    expected, _ = vocoder.inference(mel, generator=torch.Generator().manual_seed(0))
    actual, _ = loaded.inference(mel, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_from_checkpoint_rejects_a_checkpoint_of_another_shape(
    tmp_path: Path, cfg: HiftConfig, vocoder: HiFTGenerator
) -> None:
    path = tmp_path / "hift.pt"
    state = vocoder.state_dict()
    del state["conv_post.bias"]
    torch.save(state, path)
    with pytest.raises(RuntimeError, match=r"conv_post\.bias"):
        HiFTGenerator.from_checkpoint(cfg, path, torch.device("cpu"), torch.float32)
    torch.save(HiFTGenerator(dataclasses.replace(cfg, base_channels=64)).state_dict(), path)
    with pytest.raises(RuntimeError, match="size mismatch"):
        HiFTGenerator.from_checkpoint(cfg, path, torch.device("cpu"), torch.float32)


def test_bfloat16_weights_still_return_float32_audio(
    tmp_path: Path, cfg: HiftConfig, vocoder: HiFTGenerator, mel: torch.Tensor
) -> None:
    path = tmp_path / "hift.pt"
    torch.save(vocoder.state_dict(), path)
    half = HiFTGenerator.from_checkpoint(cfg, path, torch.device("cpu"), torch.bfloat16)
    assert half.conv_pre.weight.dtype == torch.bfloat16
    wav, _ = half.inference(mel, generator=torch.Generator().manual_seed(0))
    assert wav.dtype == torch.float32
    assert wav.shape == (1, FRAMES * SAMPLES_PER_FRAME)
    assert torch.isfinite(wav).all()


def test_the_cosyvoice1_sample_rate_is_refused(cfg: HiftConfig) -> None:
    with pytest.raises(ValueError, match=r"22\.05 kHz"):
        HiFTGenerator(dataclasses.replace(cfg, sampling_rate=22050))


def test_the_source_spectrum_is_torch_stft(vocoder: HiFTGenerator) -> None:
    """Written out as a DFT matrix (a CUDA graph can record it), it computes what torch.stft does."""
    source = torch.randn(2, 1, 960, generator=torch.Generator().manual_seed(3))
    spectrum = torch.stft(
        source.squeeze(1),
        vocoder.n_fft,
        vocoder.hop_len,
        vocoder.n_fft,
        window=torch.hann_window(vocoder.n_fft),
        return_complex=True,
    )
    expected = torch.cat([spectrum.real, spectrum.imag], dim=1)
    actual = vocoder._source_spectrum(source)
    assert actual.shape == expected.shape == (2, vocoder.n_fft + 2, 960 // vocoder.hop_len + 1)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_the_inverse_stft_is_torch_istft(vocoder: HiFTGenerator) -> None:
    """Written out as inverse DFT matrices and overlap-add, it computes what torch.istft does."""
    generator = torch.Generator().manual_seed(2)
    bins = vocoder.n_fft // 2 + 1
    magnitude = torch.rand(3, bins, 41, generator=generator) * 5
    phase = torch.rand(3, bins, 41, generator=generator) * 6
    spectrum = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
    expected = torch.istft(
        spectrum, vocoder.n_fft, vocoder.hop_len, vocoder.n_fft, window=torch.hann_window(vocoder.n_fft)
    )
    actual = vocoder._inverse_stft(magnitude, phase)
    assert actual.shape == expected.shape == (3, 40 * vocoder.hop_len)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_vocoding_with_noise_drawn_first_is_inference(vocoder: HiFTGenerator, mel: torch.Tensor) -> None:
    """Per-row generators draw in the order inference draws: the excitation's noise can be made apart."""
    batch = torch.cat([mel, mel.flip(2)])
    seeds = [3, 4]
    expected_wav, expected_source = vocoder.inference(
        batch, generator=[torch.Generator().manual_seed(seed) for seed in seeds]
    )
    noise = vocoder.draw_noise(2, FRAMES, [torch.Generator().manual_seed(seed) for seed in seeds])
    with torch.inference_mode():
        wav, source = vocoder.vocode(batch, noise)
    torch.testing.assert_close(wav, expected_wav, rtol=0, atol=0)
    torch.testing.assert_close(source, expected_source, rtol=0, atol=0)
    # Each row draws what it draws alone.
    alone, _ = vocoder.inference(mel, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(wav[:1], alone, rtol=0, atol=1e-6)


@pytest.mark.parametrize("n_fft", [15, 16])
def test_the_fourier_bases_are_rfft_and_irfft(n_fft: int) -> None:
    window, forward, inverse_real, inverse_imag = _fourier_bases(n_fft, torch.device("cpu"))
    frames = torch.randn(5, n_fft, generator=torch.Generator().manual_seed(n_fft), dtype=torch.float32)
    spectrum = torch.fft.rfft(frames)
    torch.testing.assert_close(frames @ forward, torch.cat([spectrum.real, spectrum.imag], dim=1), atol=1e-5, rtol=0)
    inverse = spectrum.real @ inverse_real + spectrum.imag @ inverse_imag
    torch.testing.assert_close(inverse, torch.fft.irfft(spectrum, n=n_fft), atol=1e-6, rtol=0)
    torch.testing.assert_close(window, torch.hann_window(n_fft), atol=1e-6, rtol=0)


def test_rows_of_different_lengths_padded_into_one_batch_vocode_as_each_alone(cfg: HiftConfig) -> None:
    """Padding is cleared before every convolution, the excitation's phase held and its STFT reflected at
    each row's own end, the inverse STFT's envelope cut there: each row's samples are its own."""
    torch.manual_seed(0)
    vocoder = HiFTGenerator(cfg).eval()
    # Voiced throughout (random weights predict an F0 near 0 Hz): the excitation's phase matters.
    vocoder.f0_predictor.classifier.bias.data.fill_(220.0)
    lengths = [9, FRAMES, 12]
    mels = [torch.randn(1, 80, n, generator=torch.Generator().manual_seed(n)) for n in lengths]
    cache = torch.randn(1, 1, 3840, generator=torch.Generator().manual_seed(9)) * 0.1
    alone = []
    noises = []
    with torch.inference_mode():
        for seed, mel in enumerate(mels):
            noise = vocoder.draw_noise(1, mel.shape[2], torch.Generator().manual_seed(seed))
            noises.append(noise)
            alone.append(vocoder.vocode(mel, noise, cache))
        batch, padded, frames = vocoder.padded(mels, noises)
        assert batch.shape[2] == FRAMES and frames.tolist() == lengths
        caches = cache.expand(3, -1, -1)
        wav, source = vocoder.vocode(batch, padded, caches, frames)
        unmasked, _ = vocoder.vocode(batch, padded, caches)
    for row, (length, (alone_wav, alone_source)) in enumerate(zip(lengths, alone, strict=True)):
        end = length * SAMPLES_PER_FRAME
        torch.testing.assert_close(wav[row, :end], alone_wav[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(source[row, :, :end], alone_source[0], rtol=0, atol=1e-6)
    # Without the lengths a short row's end hears the padding after it.
    assert (unmasked[0, : 9 * SAMPLES_PER_FRAME] - alone[0][0][0]).abs().max() > 1e-3
