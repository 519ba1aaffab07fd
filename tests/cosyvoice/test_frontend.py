"""Voice prompts from real onnxruntime sessions over the tiny tokenizer and speaker models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tts_gateway.models.cosyvoice2.checkpoints import tiny_frontend
from tts_gateway.models.cosyvoice2.model import features, vocab
from tts_gateway.models.cosyvoice2.model.frontend import (
    AudioTokenizer,
    SpeakerEmbedder,
    VoicePrompt,
    build_voice_prompt,
    prompt_feats,
)

pytestmark = pytest.mark.cosyvoice


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("frontend_onnx")
    tiny_frontend.write_tiny_tokenizer_onnx(root / tiny_frontend.TOKENIZER_FILENAME)
    tiny_frontend.write_tiny_campplus_onnx(root / tiny_frontend.CAMPPLUS_FILENAME)
    return root


@pytest.fixture(scope="module")
def tokenizer(onnx_dir: Path) -> AudioTokenizer:
    return AudioTokenizer(onnx_dir / tiny_frontend.TOKENIZER_FILENAME)


@pytest.fixture(scope="module")
def embedder(onnx_dir: Path) -> SpeakerEmbedder:
    return SpeakerEmbedder(onnx_dir / tiny_frontend.CAMPPLUS_FILENAME, providers=["CPUExecutionProvider"])


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16_000)) / 16_000
    f0 = 110.0 + 30.0 * rng.random() + 25.0 * np.sin(2 * np.pi * 0.9 * t)
    phase = 2 * np.pi * np.cumsum(f0) / 16_000
    voiced = sum(np.sin(k * phase) / k for k in range(1, 10)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * t))
    return (0.2 * voiced + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def expected_tokens(samples: int) -> int:
    frames = samples // 160
    return ((frames - 1) // 2) // 2 + 1


@pytest.mark.parametrize("seconds", [0.5, 1.0, 3.21])
def test_tokenizer_yields_25_tokens_per_second(tokenizer: AudioTokenizer, seconds: float) -> None:
    wav = speech_like(seconds)
    tokens = tokenizer.tokenize(wav)
    assert tokens.dtype == np.int64
    assert tokens.shape == (expected_tokens(wav.size),)
    assert tokens.min() >= 0 and tokens.max() < vocab.SPEECH_TOKEN_SIZE
    assert len(set(tokens.tolist())) > 1
    np.testing.assert_array_equal(tokenizer.tokenize(wav), tokens)


def test_tokenizer_refuses_more_than_30_seconds(tokenizer: AudioTokenizer) -> None:
    with pytest.raises(ValueError, match="30 s"):
        tokenizer.tokenize(np.zeros(30 * 16_000 + 1, dtype=np.float32))


def test_tokenizer_checks_the_model_interface(onnx_dir: Path) -> None:
    with pytest.raises(ValueError, match="feats"):
        AudioTokenizer(onnx_dir / tiny_frontend.CAMPPLUS_FILENAME)


def test_embedder_gives_one_192_vector_per_voice(embedder: SpeakerEmbedder) -> None:
    first = embedder.embed(speech_like(1.0, seed=1))
    second = embedder.embed(speech_like(1.0, seed=2))
    assert first.shape == second.shape == (192,)
    assert first.dtype == np.float32
    assert np.all(np.isfinite(first))
    assert not np.allclose(first, second)


def test_embedder_sees_mean_normalised_fbank(embedder: SpeakerEmbedder) -> None:
    # CAM++ gets fbank minus its time mean, so a constant gain (a log-domain offset) cancels out.
    wav = speech_like(1.0)
    np.testing.assert_allclose(embedder.embed(3.0 * wav), embedder.embed(wav), atol=1e-4)


def test_prompt_feats_are_24khz_log_mel_frames() -> None:
    wav = speech_like(2.0)
    feats = prompt_feats(wav)
    assert feats.shape == (100, 80)  # 48000 samples at 24 kHz / hop 480
    np.testing.assert_array_equal(feats, features.flow_log_mel(features.resample(wav, 16_000, 24_000)).T)


# At 0.37 s and 2.49 s the flow frames are the limit (of 10 and 63 tokens); at 1 s and 4 s both
# sides agree.
@pytest.mark.parametrize(("seconds", "length"), [(0.37, 9), (1.0, 25), (2.49, 62), (4.0, 100)])
def test_voice_prompt_keeps_two_frames_per_token(
    tokenizer: AudioTokenizer, embedder: SpeakerEmbedder, seconds: float, length: int
) -> None:
    wav = speech_like(seconds)
    tokens = tokenizer.tokenize(wav)
    feats = prompt_feats(wav)
    assert length == min(feats.shape[0] // 2, tokens.size)
    prompt = build_voice_prompt(wav, tokenizer, embedder)
    np.testing.assert_array_equal(prompt.speech_tokens, tokens[:length])
    np.testing.assert_array_equal(prompt.feats, feats[: 2 * length])
    np.testing.assert_array_equal(prompt.embedding, embedder.embed(wav))
    assert prompt.feats.dtype == np.float32
    assert not prompt.feats.flags.writeable
    assert not prompt.speech_tokens.flags.writeable


def test_voice_prompt_rejects_misaligned_arrays() -> None:
    with pytest.raises(ValueError, match="prompt frames"):
        VoicePrompt(
            speech_tokens=np.zeros(3, dtype=np.int64),
            feats=np.zeros((5, 80), dtype=np.float32),
            embedding=np.zeros(192, dtype=np.float32),
        )
