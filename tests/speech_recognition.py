"""What the gateway's audio says, by offline speech recognition (PocketSphinx, whose wheel ships
its US-English acoustic model, language model and dictionary)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pocketsphinx
import soxr

from tests.audio_checks import DecodedAudio

_MODEL = Path(pocketsphinx.get_model_path()) / "en-us"
_RATE = 16_000


def _decoder(**search: str | None) -> pocketsphinx.Decoder:
    return pocketsphinx.Decoder(
        hmm=str(_MODEL / "en-us"), dict=str(_MODEL / "cmudict-en-us.dict"), loglevel="FATAL", **search
    )


def _decode(decoder: pocketsphinx.Decoder, audio: DecodedAudio) -> str:
    samples = soxr.resample(audio.samples, audio.sample_rate, _RATE)
    decoder.start_utt()
    decoder.process_raw((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes(), full_utt=True)
    decoder.end_utt()
    hypothesis = decoder.hyp()
    return hypothesis.hypstr if hypothesis is not None else ""


def transcribe(audio: DecodedAudio) -> str:
    """Free recognition with the general English language model: lower-case words."""
    return _decode(_decoder(lm=str(_MODEL / "en-us.lm.bin")), audio)


def which_was_said(audio: DecodedAudio, readings: list[str]) -> str:
    """The one of ``readings`` (lower-case words) that best matches the audio.

    A forced choice: the recogniser may only answer one of them, so it tells apart readings that
    differ in a few words ("five dollars" against "dollar five") far more reliably than free
    recognition spells either.
    """
    grammar = "#JSGF V1.0;\ngrammar readings;\npublic <reading> = " + " | ".join(f"( {r} )" for r in readings) + " ;\n"
    decoder = _decoder(lm=None)
    decoder.add_jsgf_string("readings", grammar)
    decoder.activate_search("readings")
    return _decode(decoder, audio)
