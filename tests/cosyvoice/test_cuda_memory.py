"""The watch over a process's CUDA memory: it reports steps of its high-water mark, not every wobble."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tts_gateway.models.cosyvoice2.engines.cuda_memory import ReservedMemoryWatch
from tts_gateway.models.cosyvoice2.engines.token2wav import Token2Wav
from tts_gateway.models.cosyvoice2.model.frontend import VoicePrompt

pytestmark = pytest.mark.cosyvoice

MIB = 1 << 20


def test_a_rise_is_reported_once_and_only_past_the_step() -> None:
    readings = iter([100 * MIB, 150 * MIB, 200 * MIB, 180 * MIB, 210 * MIB, 300 * MIB])
    watch = ReservedMemoryWatch(lambda: next(readings), min_step=64 * MIB)
    assert watch.rise() is None  # +50 MiB: below the step
    assert watch.rise() == (100 * MIB, 200 * MIB)
    assert watch.rise() is None  # fell back: the mark stays
    assert watch.rise() is None  # +10 MiB over the mark
    assert watch.rise() == (200 * MIB, 300 * MIB)
    assert watch.high == 300 * MIB


def test_no_watch_off_cuda() -> None:
    assert ReservedMemoryWatch.for_device(torch.device("cpu")) is None


def test_token2wav_logs_the_work_that_raised_its_memory(token2wav_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    t2w = Token2Wav.from_model_dir(token2wav_dir, device="cpu", dtype=torch.float32)
    readings = iter([0, 0, 512 * MIB])
    t2w.memory_watch = ReservedMemoryWatch(lambda: next(readings))
    rng = np.random.default_rng(0)
    prompt = VoicePrompt(
        speech_tokens=rng.integers(0, 6561, 12),
        feats=rng.standard_normal((24, 80)).astype(np.float32),
        embedding=rng.standard_normal(192).astype(np.float32),
    )
    tokens = rng.integers(0, 6561, 20)
    with caplog.at_level(logging.INFO, logger="tts_gateway.models.cosyvoice2.engines.token2wav"):
        t2w.offline(tokens, prompt)  # the watch reads 0: nothing to say
        assert not [r for r in caplog.records if "CUDA memory" in r.message]
        t2w.offline(tokens, prompt)
    (line,) = [r.getMessage() for r in caplog.records if "CUDA memory" in r.message]
    # 12 prompt + 20 target tokens, 2 mel frames a token; without HiFT graphs every call is vocoded eagerly.
    assert line == (
        "CUDA memory reserved rose from 0 to 512 MiB while converting 1 calls of up to 64 mel frames"
        " (HiFT batches vocoded eagerly: 1 x 40 frames)"
    )


def test_the_reserving_call_runs_the_padded_path_and_leaves_the_global_generator_alone(
    token2wav_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made at load on CUDA only; here on the CPU for its shapes and its draws."""
    t2w = Token2Wav.from_model_dir(token2wav_dir, device="cpu", dtype=torch.float32)
    vocoded: list[tuple[tuple[int, ...], bool]] = []
    vocode = t2w.hift.vocode

    def recording(mel: torch.Tensor, *args: Any) -> Any:
        vocoded.append((tuple(mel.shape), args[2] is not None))
        return vocode(mel, *args)

    monkeypatch.setattr(t2w.hift, "vocode", recording)
    state = torch.get_rng_state()
    t2w._reserve_eager_vocoding()
    assert torch.equal(torch.get_rng_state(), state)
    assert vocoded == [((32, 80, 100), True)]
