"""Does compiling the flow estimator pay? The 10-step solve eager, as a CUDA graph, and compiled then graphed.

On the full-size random flow (as ``gpu_engine_check.py`` writes it), fp16 on CUDA: the flow decoder's whole
solve (10 Euler steps of the estimator over the classifier-free-guidance pair) over ``--frames`` mel frames
for 1 and 16 rows, timed eagerly, recorded as one CUDA graph (what token2wav replays today), and with
the estimator compiled by ``torch.compile`` (inductor, static shapes) and then recorded. Reports the
milliseconds per solve, the compile time per shape and the compiled solve's relative difference from
the eager one.

    python benchmarks/gpu_flow_compile.py --out /tmp/compile   # GPU: about 4 minutes (two compiles)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_engine_check import ROOT, _flow_and_hift

from tts_backends.cosyvoice2.token2wav import Token2Wav


def _time(run: Callable[[], Any], repeats: int = 10) -> float:
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    started = time.monotonic()
    for _ in range(repeats):
        run()
    torch.cuda.synchronize()
    return round(1000 * (time.monotonic() - started) / repeats, 2)


def _recorded(run: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=ROOT / "var" / "gpu_cosyvoice2")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--frames", type=int, default=256, help="mel frames of the solve (a first chunk: 236)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device, dtype = torch.device("cuda"), torch.float16
    decoder = Token2Wav.from_model_dir(_flow_and_hift(args.workdir), device=device, dtype=dtype).flow.decoder
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "frames": args.frames}

    def save() -> None:
        (args.out / "gpu_flow_compile.json").write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report), flush=True)

    def solver(rows: int) -> Callable[[], torch.Tensor]:
        noise = torch.Generator(device=device).manual_seed(0)
        frames = args.frames
        mu = torch.randn(rows, 80, frames, device=device, dtype=dtype, generator=noise)
        mask = torch.ones(rows, 1, frames, device=device, dtype=dtype)
        spks = torch.randn(rows, 80, device=device, dtype=dtype, generator=noise)
        cond = torch.randn(rows, 80, frames, device=device, dtype=dtype, generator=noise)
        streaming = torch.ones(rows, dtype=torch.bool, device=device)
        return lambda: decoder(mu, mask, spks, cond, 10, streaming)

    with torch.inference_mode():
        eager_mel = {}
        for rows in (1, 16):
            solve = solver(rows)
            eager_mel[rows] = solve().float()
            report[f"eager_{rows}_ms"] = _time(solve)
            report[f"graph_{rows}_ms"] = _time(_recorded(solve).replay)
            save()
        decoder.estimator = torch.compile(decoder.estimator, dynamic=False)
        for rows in (1, 16):
            solve = solver(rows)
            started = time.monotonic()
            mel = solve().float()
            torch.cuda.synchronize()
            report[f"compile_{rows}_s"] = round(time.monotonic() - started, 1)
            report[f"compiled_{rows}_rel_err"] = float((mel - eager_mel[rows]).norm() / eager_mel[rows].norm())
            report[f"compiled_eager_{rows}_ms"] = _time(solve)
            report[f"compiled_graph_{rows}_ms"] = _time(_recorded(solve).replay)
            save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
