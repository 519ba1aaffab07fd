"""Does vocoding chunks of different lengths as one padded batch pay? HiFT alone, on one GPU.

On the full-size random HiFT (as ``gpu_engine_check.py`` writes it), float32 as token2wav runs it:
``--rows`` streamed chunks of random lengths (``--min-frames`` to ``--max-frames`` mel frames, each
after a cached excitation, as a stream's later chunks are) vocoded three ways, median of 10 after
3 warm-ups: one call per chunk (how token2wav vocoded chunks of different lengths before), one call
over the batch padded to the longest with each row's frames given (:meth:`HiFTGenerator.vocode`'s
``frames``, what it does now), and the same padded batch without the frames (what padding alone
costs, its audio wrong at each row's end). Also the largest difference of a padded row from the same
chunk vocoded alone.

    python -m benchmarks.gpu_hift_batch --out /tmp/hift      # GPU: under a minute
    python -m benchmarks.gpu_hift_batch --out /tmp/hift --cpu --rows 2,4
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_engine_check import ROOT, _flow_and_hift
from tts_gateway.models.cosyvoice2.model.config import load_config
from tts_gateway.models.cosyvoice2.model.hift import HiFTGenerator
from tts_gateway.models.cosyvoice2.model.hift_stream import DEFAULT_MEL_CACHE_FRAMES

REPEATS = 10


def _median_ms(run: Callable[[], Any], device: torch.device) -> float:
    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        run()
    times = []
    for _ in range(REPEATS):
        synchronize()
        started = time.monotonic()
        run()
        synchronize()
        times.append(time.monotonic() - started)
    return round(1000 * sorted(times)[REPEATS // 2], 1)


@torch.inference_mode()
def compare(hift: HiFTGenerator, rows: int, min_frames: int, max_frames: int, seed: int) -> dict[str, float]:
    device = hift.conv_pre.bias.device
    rng = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(min_frames, max_frames + 1, (rows,), generator=rng)]
    mels = [torch.randn(1, 80, n, generator=rng).to(device) for n in lengths]
    cache = (torch.randn(1, 1, DEFAULT_MEL_CACHE_FRAMES * hift.samples_per_frame, generator=rng) * 0.1).to(device)
    noises = [hift.draw_noise(1, n, torch.Generator(device=device).manual_seed(i)) for i, n in enumerate(lengths)]
    batch, padded, frames = hift.padded(mels, noises)
    caches = cache.expand(rows, -1, -1)
    alone = [hift.vocode(mel, noise, cache)[0][0] for mel, noise in zip(mels, noises, strict=True)]
    wav, _ = hift.vocode(batch, padded, caches, frames)
    difference = max(
        float((wav[row, : n * hift.samples_per_frame] - alone[row]).abs().max()) for row, n in enumerate(lengths)
    )
    return {
        "distinct_lengths": len(set(lengths)),
        "one_call_per_chunk_ms": _median_ms(
            lambda: [hift.vocode(mel, noise, cache) for mel, noise in zip(mels, noises, strict=True)], device
        ),
        "padded_with_frames_ms": _median_ms(lambda: hift.vocode(batch, padded, caches, frames), device),
        "padded_without_frames_ms": _median_ms(lambda: hift.vocode(batch, padded, caches), device),
        "padded_vs_alone_max_abs_difference": difference,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=ROOT / "var" / "gpu_cosyvoice2")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="8,32", help="chunks vocoded together")
    parser.add_argument("--min-frames", type=int, default=40)
    parser.add_argument("--max-frames", type=int, default=110)
    parser.add_argument("--cpu", action="store_true", help="a rehearsal on the CPU")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.cpu else "cuda")
    model_dir = _flow_and_hift(args.workdir.resolve() / "token2wav_only")
    cfg = load_config(model_dir / "cosyvoice2.yaml")
    hift = HiFTGenerator.from_checkpoint(cfg.hift, model_dir / "hift.pt", device)
    report: dict[str, Any] = {
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "frames": [args.min_frames, args.max_frames],
    }
    for rows in (int(count) for count in args.rows.split(",")):
        report[f"rows_{rows}"] = compare(hift, rows, args.min_frames, args.max_frames, seed=rows)
        (args.out / "gpu_hift_batch.json").write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report[f"rows_{rows}"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
