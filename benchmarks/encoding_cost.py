"""CPU cost of the gateway's streaming encoders, as a share of one core per real-time stream.

Real speech (Piper's ``joe`` voice, repeated to ``--seconds``) goes through
``tts_gateway.gateway.speech.audio_encoding``'s streaming encoder for each format in chunks the size of a
streamed backend chunk, the way a response does. The process CPU time spent, over the
seconds of audio encoded, is the share of one core that one listener in real time costs.
Input at 22.05 kHz (Piper) includes resampling to 24 kHz; input at 24 kHz (CosyVoice2) does not.

    python -m benchmarks.encoding_cost [--seconds 60]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import soxr
from numpy.typing import NDArray

from benchmarks.bench_texts import FIVE_SENTENCES
from tts_gateway.gateway.speech.audio_encoding import AUDIO_FORMATS, AudioFormat, create_encoder
from tts_gateway.models.piper import PiperEngine

INPUT_RATES = (22_050, 24_000)


def speech(seconds: float) -> tuple[NDArray[np.float32], int]:
    """At least ``seconds`` of Piper speech and its sample rate."""
    engine = PiperEngine()
    once = np.concatenate(list(engine.synthesize(FIVE_SENTENCES)))
    repeats = int(np.ceil(seconds * engine.sample_rate / once.size))
    return np.tile(once, repeats), engine.sample_rate


def cpu_seconds(fmt: AudioFormat, audio: NDArray[np.float32], sample_rate: int, chunk_seconds: float) -> float:
    """Process CPU time to stream-encode ``audio`` in chunks of ``chunk_seconds``."""
    step = max(1, round(chunk_seconds * sample_rate))
    started = time.process_time()
    encoder = create_encoder(fmt, sample_rate)
    size = 0
    for start in range(0, audio.size, step):
        size += len(encoder.encode(audio[start : start + step]))
    size += len(encoder.finish())
    spent = time.process_time() - started
    if size == 0:
        raise RuntimeError(f"{fmt} encoder produced nothing")
    return spent


def measure(seconds: float = 60.0, chunk_seconds: float = 0.5) -> list[dict[str, Any]]:
    """One row per format and input rate: CPU seconds per audio second and % of one core."""
    voice, voice_rate = speech(seconds)
    rows = []
    for rate in INPUT_RATES:
        audio = voice if rate == voice_rate else soxr.resample(voice, voice_rate, rate).astype(np.float32)
        audio_seconds = audio.size / rate
        for fmt in AUDIO_FORMATS:
            cpu_seconds(fmt, audio[: rate * 2], rate, chunk_seconds)  # warm the codec up
            per_second = cpu_seconds(fmt, audio, rate, chunk_seconds) / audio_seconds
            rows.append(
                {
                    "format": fmt,
                    "input_rate": rate,
                    "audio_s": round(audio_seconds, 2),
                    "cpu_s_per_audio_s": round(per_second, 6),
                    "core_percent": round(per_second * 100, 3),
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="audio encoded per format")
    parser.add_argument("--chunk-seconds", type=float, default=0.5, help="size of the chunks fed to the encoder")
    args = parser.parse_args(argv)
    rows = measure(args.seconds, args.chunk_seconds)
    print("| format | input Hz | % of a core per real-time stream |")
    print("|---|---:|---:|")
    for row in rows:
        print(f"| {row['format']} | {row['input_rate']} | {row['core_percent']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
