"""The voice prompt: speech tokens, speaker embedding and flow features of a reference recording.

ONNX interfaces, as upstream uses them:

- ``speech_tokenizer_v2.onnx`` (S3Tokenizer v2): ``feats`` float32 [1, 128, T] (Whisper log-mel)
  and ``feats_length`` int32 [1] in, ``indices`` [1, T'] out (25 tokens per second). Upstream
  refuses references longer than 30 s.
- ``campplus.onnx`` (CAM++): one input float32 [1, T, 80] (mean-normalised Kaldi fbank; named
  ``input`` in upstream's TensorRT conversion), first output [1, 192].

The flow prompt is the 24 kHz Matcha log-mel of the reference; it is cut together with the
tokens to ``L = min(frames // 2, tokens)`` so that it holds exactly two mel frames per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import onnxruntime as ort
from numpy.typing import NDArray

from tts_gateway.models.cosyvoice2.model import features

REFERENCE_SAMPLE_RATE: Final = 16_000
FLOW_SAMPLE_RATE: Final = 24_000
MAX_TOKENIZER_SECONDS: Final = 30.0
SPEAKER_EMBEDDING_DIM: Final = 192
MEL_FRAMES_PER_TOKEN: Final = 2

TOKENIZER_INPUTS: Final = ("feats", "feats_length")
DEFAULT_PROVIDERS: Final = ("CPUExecutionProvider",)


@dataclass(frozen=True)
class VoicePrompt:
    """Everything synthesis needs from a reference voice; arrays are read-only (shared by a cache)."""

    speech_tokens: NDArray[np.int64]  # (L,)
    feats: NDArray[np.float32]  # (2L, 80), 24 kHz log-mel
    embedding: NDArray[np.float32]  # (192,)

    def __post_init__(self) -> None:
        if self.speech_tokens.ndim != 1 or self.feats.ndim != 2 or self.embedding.ndim != 1:
            raise ValueError("VoicePrompt wants tokens (L,), feats (2L, mels) and embedding (dim,)")
        if self.feats.shape[0] != MEL_FRAMES_PER_TOKEN * self.speech_tokens.shape[0]:
            raise ValueError(f"{self.feats.shape[0]} prompt frames do not match {self.speech_tokens.shape[0]} tokens")
        for array in (self.speech_tokens, self.feats, self.embedding):
            array.setflags(write=False)


class AudioTokenizer:
    """S3Tokenizer v2 over onnxruntime: 16 kHz audio to speech tokens in [0, 6561)."""

    def __init__(self, onnx_path: Path, providers: Sequence[str] | None = None, *, intra_op_threads: int = 1) -> None:
        self._session = _session(onnx_path, providers, intra_op_threads)
        names = tuple(node.name for node in self._session.get_inputs())
        if names != TOKENIZER_INPUTS:
            raise ValueError(f"{onnx_path}: expected inputs {TOKENIZER_INPUTS}, found {names}")

    def tokenize(self, wav16k: NDArray[np.float32]) -> NDArray[np.int64]:
        """Speech tokens of mono 16 kHz audio in [-1, 1], shape (tokens,)."""
        seconds = wav16k.shape[-1] / REFERENCE_SAMPLE_RATE
        if seconds > MAX_TOKENIZER_SECONDS:
            raise ValueError(f"reference audio of {seconds:.1f} s exceeds {MAX_TOKENIZER_SECONDS:.0f} s")
        mel = features.whisper_log_mel(wav16k, n_mels=128)
        outputs = self._session.run(
            None,
            {
                TOKENIZER_INPUTS[0]: mel[np.newaxis],
                TOKENIZER_INPUTS[1]: np.array([mel.shape[1]], dtype=np.int32),
            },
        )
        return np.asarray(outputs[0]).reshape(-1).astype(np.int64)


class SpeakerEmbedder:
    """CAM++ over onnxruntime: 16 kHz audio to a 192-d speaker embedding."""

    def __init__(self, onnx_path: Path, providers: Sequence[str] | None = None, *, intra_op_threads: int = 1) -> None:
        self._session = _session(onnx_path, providers, intra_op_threads)
        inputs = self._session.get_inputs()
        if len(inputs) != 1:
            raise ValueError(f"{onnx_path}: expected one input, found {[node.name for node in inputs]}")
        self._input_name = inputs[0].name

    def embed(self, wav16k: NDArray[np.float32]) -> NDArray[np.float32]:
        """Speaker embedding of mono 16 kHz audio in [-1, 1], shape (192,)."""
        feats = features.speaker_fbank(wav16k)
        outputs = self._session.run(None, {self._input_name: feats[np.newaxis]})
        embedding = np.asarray(outputs[0], dtype=np.float32).reshape(-1)
        if embedding.shape != (SPEAKER_EMBEDDING_DIM,):
            raise ValueError(f"speaker model returned shape {embedding.shape}, not ({SPEAKER_EMBEDDING_DIM},)")
        return embedding


def prompt_feats(wav16k: NDArray[np.float32]) -> NDArray[np.float32]:
    """The flow's prompt features: 24 kHz 80-bin log-mel of the reference, shape (frames, 80)."""
    wav24k = features.resample(wav16k, REFERENCE_SAMPLE_RATE, FLOW_SAMPLE_RATE)
    return np.ascontiguousarray(features.flow_log_mel(wav24k).T)


def build_voice_prompt(
    wav16k: NDArray[np.float32], tokenizer: AudioTokenizer, embedder: SpeakerEmbedder
) -> VoicePrompt:
    """Tokens, features and embedding of one reference recording, aligned two frames per token."""
    tokens = tokenizer.tokenize(wav16k)
    feats = prompt_feats(wav16k)
    length = min(feats.shape[0] // MEL_FRAMES_PER_TOKEN, tokens.shape[0])
    if length == 0:
        raise ValueError("reference audio is too short to yield a speech token")
    return VoicePrompt(
        speech_tokens=tokens[:length].copy(),
        feats=feats[: MEL_FRAMES_PER_TOKEN * length].copy(),
        embedding=embedder.embed(wav16k),
    )


def _session(onnx_path: Path, providers: Sequence[str] | None, intra_op_threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads
    return ort.InferenceSession(str(onnx_path), sess_options=options, providers=list(providers or DEFAULT_PROVIDERS))
