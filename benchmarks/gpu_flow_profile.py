"""Where a streaming first chunk's flow time goes on the GPU: encoder against solve, kernels against wall time.

On the full-size random flow and HiFT (as ``gpu_engine_check.py`` writes them), token2wav with the solve
and HiFT recorded as CUDA graphs, its U-Net levels and HiFT's activations compiled as the GPU profiles compile
them (``--compile-backend``),
converts ``--rows`` streams' first chunks at once, as the Triton model does (``--tokens``: by default the
``gpu-torch`` profile's first hop of 25 tokens and the 3-token look-ahead, after a 4 s voice prompt;
with ``--prefix-frames``, after the voice prefix recorded for that prompt).
Reported per row count: the flow's and HiFT's time (medians of 5, synchronised), the encoder's share
where it runs as a module (beyond its CUDA graphs' buckets), and from one conversion under
``torch.profiler``: how many GPU kernels ran, their summed time against the wall time, and the kernels
that took the most. Many short kernels whose sum is close to the wall time mean the GPU is busy with
launch-sized work: fusing them (a compiler) helps, more batching less so.

    python -m benchmarks.gpu_flow_profile --rows 1,32 --out /tmp/flow   # GPU: about a minute after the checkpoint
    python -m benchmarks.gpu_flow_profile --rows 1,32 --prefix-frames 200 --out /tmp/flow   # after a voice prefix
    python -m benchmarks.gpu_flow_profile --cpu --rows 1 --out /tmp/flow   # rehearsal, float32, uncompiled
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_engine_check import HIFT_HOPS, ROOT, _flow_and_hift, _synchronize, four_second_voice
from tts_gateway.models.cosyvoice2.engines.token2wav import Conversion, Token2Wav
from tts_gateway.models.cosyvoice2.model.frontend import VoicePrompt


def _first_chunks(rows: int, tag: str, prompt: VoicePrompt, tokens: NDArray[np.int64]) -> list[Conversion]:
    return [Conversion(f"{tag}-{row}", tokens, prompt, 0, False) for row in range(rows)]


def _convert(t2w: Token2Wav, calls: list[Conversion]) -> None:
    t2w.convert(calls)
    for call in calls:
        t2w.release(call.session_id)


def _timed_encoder(t2w: Token2Wav) -> tuple[list[float], Callable[[], None]]:
    """Synchronised wall time of every encoder call, until the returned function removes the hooks."""
    times: list[float] = []
    started: list[float] = []

    def before(*_: Any) -> None:
        _synchronize()
        started.append(time.monotonic())

    def after(*_: Any) -> None:
        _synchronize()
        times.append(time.monotonic() - started.pop())

    hooks = [t2w.flow.encoder.register_forward_pre_hook(before), t2w.flow.encoder.register_forward_hook(after)]

    def remove() -> None:
        for hook in hooks:
            hook.remove()

    return times, remove


def profile_rows(
    t2w: Token2Wav, rows: int, prompt: VoicePrompt, tokens: NDArray[np.int64], cuda: bool
) -> dict[str, Any]:
    for warm in range(3):
        _convert(t2w, _first_chunks(rows, f"warm{rows}-{warm}", prompt, tokens))
    encoder, unhook = _timed_encoder(t2w)
    splits = []
    for run in range(5):
        _convert(t2w, _first_chunks(rows, f"run{rows}-{run}", prompt, tokens))
        splits.append(dict(t2w.last_timing))
    unhook()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    calls = _first_chunks(rows, f"profiled{rows}", prompt, tokens)
    with profile(activities=activities) as prof:
        _synchronize()
        started = time.monotonic()
        _convert(t2w, calls)
        _synchronize()
        wall = time.monotonic() - started
    events = [event for event in prof.key_averages() if event.self_device_time_total > 0]
    events.sort(key=lambda event: event.self_device_time_total, reverse=True)
    return {
        "rows": rows,
        "flow_ms": round(1000 * float(np.median([s["flow_s"] for s in splits])), 1),
        "hift_ms": round(1000 * float(np.median([s["hift_s"] for s in splits])), 1),
        # None where the encoder was replayed from its CUDA graphs, not run as a module.
        "encoder_ms": round(1000 * float(np.median(encoder)), 1) if encoder else None,
        "profiled_wall_ms": round(1000 * wall, 1),
        "gpu_kernels": int(sum(event.count for event in events)),
        "gpu_kernel_ms": round(sum(event.self_device_time_total for event in events) / 1000, 1),
        "top_kernels": [
            {"name": event.key[:90], "calls": event.count, "ms": round(event.self_device_time_total / 1000, 2)}
            for event in events[:12]
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=ROOT / "var" / "gpu_cosyvoice2")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="1,16", help="first chunks converted together, e.g. 1,16")
    parser.add_argument("--tokens", type=int, default=28, help="target tokens of a first chunk, look-ahead included")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="the flow's U-Net levels and HiFT's activations compiled with this; empty: uncompiled",
    )
    parser.add_argument(
        "--prefix-frames", type=int, default=0, help="a voice prefix cache for prefixes up to this many frames; 0: none"
    )
    parser.add_argument(
        "--unfused", action="store_true", help="compile the estimator as it is, without fewer kernels (A/B)"
    )
    parser.add_argument("--cpu", action="store_true", help="rehearse on the CPU in float32, uncompiled")
    args = parser.parse_args()
    rows = [int(count) for count in args.rows.split(",")]
    cuda = not args.cpu
    backend = args.compile_backend if cuda else ""
    t2w = Token2Wav.from_model_dir(
        _flow_and_hift(args.workdir),
        device="cuda" if cuda else "cpu",
        dtype=torch.float16 if cuda else torch.float32,
        graph_rows=max(rows) if cuda else 0,
        graph_frames=512,
        compile_backend=backend,
        fuse_flow=not args.unfused,
        prefix_cache_mb=2048 if args.prefix_frames else 0,
        prefix_frames=args.prefix_frames,
        hift_graph_rows=max(rows) if cuda else 0,
        hift_graph_hops=HIFT_HOPS,
    )
    t2w.sync_timing = True
    rng = np.random.default_rng(0)
    prompt = four_second_voice(rng)
    tokens = rng.integers(0, 6561, args.tokens)
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "compile_backend": backend,
        "fused": backend != "" and not args.unfused,
        "tokens": args.tokens,
        "prefix_frames": args.prefix_frames,
        "runs": [profile_rows(t2w, count, prompt, tokens, cuda) for count in rows],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_flow_profile.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({**report, "runs": [{k: v for k, v in r.items() if k != "top_kernels"} for r in report["runs"]]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
