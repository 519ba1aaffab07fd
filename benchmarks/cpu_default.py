"""The embedded CPU default as users run it: ``tts-gateway serve`` with no Triton URL (Piper).

Starts the gateway, which starts its own Triton on the ``cpu`` profile, pinned to
``--cores`` CPUs, then measures at concurrency 1 over streamed pcm responses:

- RTF: wall time over audio seconds, over the English texts of the benchmark set;
- first audio of the 5-sentence text against the whole synthesis of its first sentence
  alone (the target: at most 1.5 times; the gateway pipelines the later sentences).

    python -m benchmarks.cpu_default [--cores 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench_load import GatewayTarget, Sample, gateway_session
from benchmarks.bench_stack import GatewayServer
from benchmarks.bench_texts import FIVE_SENTENCES, BenchText, select_texts
from tts_gateway.gateway.speech.text_splitting import split_sentences

MODEL = "piper"
VOICE = "alloy"


def pinned_cores(count: int) -> set[int]:
    """The first ``count`` CPUs this process may run on."""
    usable = sorted(os.sched_getaffinity(0))
    if count > len(usable):
        raise ValueError(f"{count} cores asked for, {len(usable)} usable")
    return set(usable[:count])


async def _measure(url: str, rounds: int) -> dict[str, Any]:
    five = BenchText("long-en", "en", FIVE_SENTENCES)
    first_sentence = BenchText("first-sentence", "en", split_sentences(FIVE_SENTENCES)[0])
    async with gateway_session(1, 300) as http:
        target = GatewayTarget(http, url, MODEL, VOICE, "pcm")
        texts = select_texts(None, ["en"])
        await target.request(texts[0])  # warm-up
        runs: list[Sample] = []
        fives: list[Sample] = []
        alone: list[Sample] = []
        for _ in range(rounds):
            runs += [await target.request(text) for text in texts]
            fives.append(await target.request(five))
            alone.append(await target.request(first_sentence))
    failed = [s.error for s in (*runs, *fives, *alone) if s.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    wall = sum(s.total for s in runs)
    audio = sum(s.audio_seconds for s in runs)
    first_ms = statistics.median(s.first_byte or s.total for s in fives) * 1000
    alone_ms = statistics.median(s.total for s in alone) * 1000
    return {
        "requests": len(runs),
        "audio_s": round(audio, 2),
        "rtf": round(wall / audio, 4),
        "five_sentences_first_audio_ms": round(first_ms, 1),
        "first_sentence_alone_ms": round(alone_ms, 1),
        "first_audio_ratio": round(first_ms / alone_ms, 3),
    }


def measure(workdir: Path, cores: int = 2, rounds: int = 3) -> dict[str, Any]:
    """Start the embedded default on ``cores`` CPUs, measure, stop it."""
    with GatewayServer(workdir, {"TTS_TRITON_URL": ""}, cores=pinned_cores(cores)) as gateway:
        figures = asyncio.run(_measure(gateway.url, rounds))
    return {"cores": cores, "model": MODEL, **figures}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", type=int, default=2, help="CPUs the gateway and its Triton may use")
    parser.add_argument("--rounds", type=int, default=3, help="times each text is sent")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        figures = measure(Path(tmp), args.cores, args.rounds)
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
