"""Make the reference voices shipped in ``ref_audios/`` from the embedded Piper voice.

``lumen`` is the Piper voice as it is; ``harbor`` is the same reading shifted down in
pitch (WSOLA stretch, then resampling back to the original length), so the two clone
targets differ audibly. Both are ours to ship: synthesised here, from CC0 voice data.

    python -m tts_gateway.tools.reference_voices [--out DIR]
"""

from __future__ import annotations

import argparse

import numpy as np
import soundfile as sf
import soxr
from numpy.typing import NDArray

from tts_gateway.gateway.speech.time_stretch import TimeStretcher
from tts_gateway.models.piper.engine import PiperEngine
from tts_gateway.paths import REFERENCE_VOICES, invocation_path

VOICES = {
    "lumen": ("The morning light came through the window, and the whole room felt calm and bright.", 1.0),
    "harbor": ("Boats rocked gently in the harbor while the old captain told stories of the sea.", 0.82),
}
OUTPUT_RATE = 24_000


def pitch_shift(samples: NDArray[np.float32], rate: int, factor: float) -> NDArray[np.float32]:
    """Scale pitch by ``factor`` keeping the duration: shorten by ``factor``, then resample back."""
    stretcher = TimeStretcher(1.0 / factor, rate)
    stretched = np.concatenate([stretcher.process(samples), stretcher.flush()])
    return np.asarray(soxr.resample(stretched, rate * factor, rate), dtype=np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=invocation_path, default=REFERENCE_VOICES)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    engine = PiperEngine()
    for name, (text, pitch) in VOICES.items():
        audio = np.concatenate(list(engine.synthesize(text)))
        if pitch != 1.0:
            audio = pitch_shift(audio, engine.sample_rate, pitch)
        audio = soxr.resample(audio, engine.sample_rate, OUTPUT_RATE)
        audio = 0.9 * audio / max(float(np.max(np.abs(audio))), 1e-6)
        sf.write(args.out / f"{name}.wav", audio, OUTPUT_RATE, subtype="PCM_16")
        (args.out / f"{name}.txt").write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
