"""Frontend features against the reference implementations upstream uses.

References: Whisper's mel filters and ``log_mel_spectrogram`` as shipped by the ``s3tokenizer``
package, Matcha-TTS ``mel_spectrogram`` from the upstream reference code, and the C++ Kaldi
fbank of ``kaldi-native-fbank``. Reference modules are loaded from their files; ``torchaudio``
(used by s3tokenizer only to read files) and, when absent, ``librosa``/``scipy`` (used by
Matcha only for the filterbank and to read files) are replaced by test-only stubs in
``sys.modules``. Matcha's filterbank then comes from our Slaney implementation, which is checked
separately against Whisper's librosa-generated filters.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tts_gateway.models.cosyvoice2.model import features

pytestmark = pytest.mark.cosyvoice

REFERENCE_DIR = Path(__file__).resolve().parents[2] / "var" / "reference"
S3TOKENIZER_DIR = REFERENCE_DIR / "s3tokenizer"
MATCHA_AUDIO = REFERENCE_DIR / "matcha" / "utils" / "audio.py"


def voiced_signal(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """A speech-like test signal: a gliding harmonic tone with noise, in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 120.0 + 40.0 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    tone = sum(np.sin(k * phase) / k for k in range(1, 8))
    return (0.3 * tone / 2.6 + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def load_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def stub_modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def install(name: str, **attributes: Any) -> None:
        module = types.ModuleType(name)
        for key, value in attributes.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)

    yield install


@pytest.fixture
def whisper_reference(stub_modules: Any) -> types.ModuleType:
    if not (S3TOKENIZER_DIR / "utils.py").is_file():
        pytest.skip("s3tokenizer absent: pip install --no-deps --target var/reference s3tokenizer==0.3.0")
    stub_modules("torchaudio")
    return load_module("s3tokenizer_utils_reference", S3TOKENIZER_DIR / "utils.py")


@pytest.fixture
def matcha_reference(stub_modules: Any) -> types.ModuleType:
    if not MATCHA_AUDIO.is_file():
        pytest.skip("reference code absent: pip install --no-deps --target var/reference cosyvoice-minicpmo==0.1.0")
    if importlib.util.find_spec("librosa") is None:

        def mel(*, sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
            return features.slaney_mel_filterbank(sr, n_fft, n_mels, fmin, fmax).astype(np.float32)

        stub_modules("librosa.filters", mel=mel)
        stub_modules("librosa", filters=sys.modules["librosa.filters"])
    if importlib.util.find_spec("scipy") is None:
        stub_modules("scipy")
        stub_modules("scipy.io")
        stub_modules("scipy.io.wavfile", read=None)
    return load_module("matcha_audio_reference", MATCHA_AUDIO)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_slaney_filterbank_matches_whispers_librosa_filters(n_mels: int) -> None:
    assets = S3TOKENIZER_DIR / "assets" / "mel_filters.npz"
    if not assets.is_file():
        pytest.skip("s3tokenizer absent: pip install --no-deps --target var/reference s3tokenizer==0.3.0")
    reference = np.load(assets)[f"mel_{n_mels}"]
    ours = features.slaney_mel_filterbank(16_000, 400, n_mels)
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-7)


def test_slaney_scale_round_trips_and_breaks_at_1khz() -> None:
    hz = np.array([0.0, 200.0, 999.0, 1000.0, 4000.0, 8000.0])
    np.testing.assert_allclose(features.mel_to_hz_slaney(features.hz_to_mel_slaney(hz)), hz, atol=1e-9)
    assert features.hz_to_mel_slaney(1000.0) == pytest.approx(15.0)
    assert features.hz_to_mel_slaney(6400.0) == pytest.approx(15.0 + 27.0)


def test_whisper_log_mel_matches_s3tokenizer(whisper_reference: types.ModuleType) -> None:
    wav = voiced_signal(2.5, 16_000)
    reference = whisper_reference.log_mel_spectrogram(torch.from_numpy(wav), n_mels=128).numpy()
    ours = features.whisper_log_mel(wav, n_mels=128)
    assert ours.shape == reference.shape == (128, wav.size // 160)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=2e-5)


def test_whisper_log_mel_has_whispers_dynamic_range() -> None:
    ours = features.whisper_log_mel(voiced_signal(1.0, 16_000))
    assert ours.dtype == np.float32
    assert ours.max() - ours.min() <= 2.0 + 1e-6  # floored 8 decades below the peak, scaled by 1/4


def test_flow_log_mel_matches_matcha(matcha_reference: types.ModuleType) -> None:
    wav = voiced_signal(1.3, 24_000)
    reference = matcha_reference.mel_spectrogram(
        torch.from_numpy(wav)[None],
        n_fft=1920,
        num_mels=80,
        sampling_rate=24_000,
        hop_size=480,
        win_size=1920,
        fmin=0,
        fmax=8000,
        center=False,
    )[0].numpy()
    ours = features.flow_log_mel(wav)
    assert ours.shape == reference.shape == (80, wav.size // 480)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=2e-5)


def test_kaldi_fbank_matches_kaldi_native_fbank() -> None:
    knf = pytest.importorskip("kaldi_native_fbank", reason="pip install kaldi-native-fbank for the C++ reference")
    wav = voiced_signal(1.7, 16_000)
    options = knf.FbankOptions()
    options.frame_opts.dither = 0.0
    options.frame_opts.samp_freq = 16_000
    options.mel_opts.num_bins = 80
    fbank = knf.OnlineFbank(options)
    fbank.accept_waveform(16_000, wav.tolist())
    fbank.input_finished()
    reference = np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)])
    ours = features.kaldi_fbank(wav)
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, rtol=0, atol=5e-4)


def test_kaldi_fbank_frames_snip_edges() -> None:
    for samples in (400, 559, 560, 16_000):
        assert features.kaldi_fbank(np.zeros(samples, dtype=np.float32) + 0.1).shape == (
            1 + (samples - 400) // 160,
            80,
        )


def test_kaldi_fbank_removes_dc_and_scales_in_log_domain() -> None:
    wav = voiced_signal(0.5, 16_000)
    base = features.kaldi_fbank(wav)
    np.testing.assert_allclose(features.kaldi_fbank(wav + 0.25), base, atol=2e-4)
    np.testing.assert_allclose(features.kaldi_fbank(2.0 * wav), base + 2.0 * np.log(2.0), atol=2e-4)


def test_kaldi_fbank_tone_peaks_in_the_bank_centred_on_it() -> None:
    tone = np.sin(2 * np.pi * 1000.0 * np.arange(16_000) / 16_000).astype(np.float32)
    # Bank i is centred at mel_low + (i + 1) * delta on the HTK scale 1127 ln(1 + f / 700).
    mel = 1127.0 * np.log1p(np.array([20.0, 8000.0, 1000.0]) / 700.0)
    expected = round((mel[2] - mel[0]) / ((mel[1] - mel[0]) / 81)) - 1
    assert int(np.argmax(features.kaldi_fbank(tone).mean(axis=0))) == expected


def test_kaldi_mel_banks_are_unit_triangles_without_nyquist() -> None:
    banks = features.kaldi_mel_banks(80, 512, 16_000)
    assert banks.shape == (80, 257)
    assert np.all(banks[:, -1] == 0.0)
    assert np.all(banks[:, 0] == 0.0)  # 0 Hz lies below the 20 Hz band edge
    assert banks.max() <= 1.0
    assert np.all(banks.max(axis=1) > 0.0)  # even the narrow low banks cover an FFT bin


def test_speaker_fbank_is_mean_normalised() -> None:
    feats = features.speaker_fbank(voiced_signal(1.0, 16_000))
    assert feats.shape == (98, 80)
    np.testing.assert_allclose(feats.mean(axis=0), 0.0, atol=1e-4)


def test_resample_keeps_duration_and_tone() -> None:
    tone = np.sin(2 * np.pi * 440.0 * np.arange(16_000) / 16_000).astype(np.float32)
    out = features.resample(tone, 16_000, 24_000)
    assert out.dtype == np.float32
    assert out.size == 24_000
    spectrum = np.abs(np.fft.rfft(out[2400:-2400]))
    assert np.fft.rfftfreq(out.size - 4800, 1 / 24_000)[np.argmax(spectrum)] == pytest.approx(440.0, abs=2.0)


@pytest.mark.parametrize(
    "call",
    [
        lambda: features.whisper_log_mel(np.zeros(200, dtype=np.float32)),
        lambda: features.kaldi_fbank(np.zeros(399, dtype=np.float32)),
        lambda: features.flow_log_mel(np.zeros(700, dtype=np.float32)),
        lambda: features.whisper_log_mel(np.zeros((2, 16_000), dtype=np.float32)),
    ],
)
def test_too_short_or_not_mono_audio_is_refused(call: Any) -> None:
    with pytest.raises(ValueError):
        call()
