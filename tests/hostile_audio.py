"""Hostile recordings shared by the unit and end-to-end tests of voice uploads."""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile as sf


def wav_with_header(rate: int, channels: int = 1, bits: int = 16, frames: int = 16_000) -> bytes:
    """A PCM WAV whose ``fmt`` chunk says whatever it is told, built by hand since libsndfile
    refuses to write odd rates or channel counts. The samples are a sparse click train: not silence."""
    samples = np.zeros(frames * channels, dtype="<i2")
    samples[::7] = 1000
    payload = samples.tobytes()
    block_align = bits // 8 * channels
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * block_align % 2**32, block_align % 2**16, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", len(body)) + body


def flac_silence_bomb(minutes: int = 180) -> bytes:
    """A decompression bomb: about 1.5 kB of FLAC per minute of 8 kHz silence (3 hours: 270 kB,
    330 MB once decoded to float32)."""
    buffer = io.BytesIO()
    minute = np.zeros(60 * 8_000, dtype=np.int16)
    with sf.SoundFile(buffer, "w", 8_000, 1, format="FLAC", subtype="PCM_16") as bomb:
        for _ in range(minutes):
            bomb.write(minute)
    return buffer.getvalue()
