"""Does compiling the flow pay? token2wav with its flow's U-Net levels compiled against without, on one GPU.

On the full-size random flow and HiFT (as ``gpu_engine_check.py`` writes them), fp16 flow, the GPU
profiles' graphs (flow solve up to 32 rows and 1536 frames, HiFT up to 32 rows): token2wav is loaded
without a compile backend and then with ``inductor`` (:mod:`tts_gateway.models.cosyvoice2.engines.flow_compile`:
the estimator's U-Net levels compiled with symbolic shapes before the graphs are recorded).
For each it reports the load time (compile and graph capture), the milliseconds of ``--counts``
streams' first chunks converted as one batch and of their chunks 100 tokens in (after a 4 s voice
prompt, flow and HiFT split), how many graphs dynamo compiled during the load and during the
conversions (none is expected after the load), and the compiled flow's relative difference from
the uncompiled one.

``--encoder-graphs`` instead loads token2wav once as the GPU profiles do (compiled levels, graphs) and
times the same conversions with the flow's token encoder replayed from CUDA graphs
(:mod:`tts_gateway.models.cosyvoice2.engines.encoder_graphs`) and eagerly, alternating, with the
relative difference of the two encoders' ``mu`` and of the mel after them.

``--whole-estimator`` instead times the 10-step solve over ``--frames`` frames at 1 and 16 rows:
eager, as one CUDA graph, and with the estimator compiled whole (static shapes) then recorded.

    python -m benchmarks.gpu_flow_compile --out /tmp/compile                    # GPU: about 3 minutes
    python -m benchmarks.gpu_flow_compile --whole-estimator --out /tmp/compile  # about 4 minutes
    python -m benchmarks.gpu_flow_compile --encoder-graphs --graph-frames 512 --out /tmp/compile  # about 2 minutes
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
from torch._dynamo.utils import counters

from benchmarks.gpu_engine_check import (
    HIFT_HOPS,
    ROOT,
    _first_then_later,
    _flow_and_hift,
    _items,
    _relative,
    four_second_voice,
)
from tts_gateway.models.cosyvoice2.engines.token2wav import Token2Wav


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


def _compiled_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _gpu_token2wav(model_dir: Path, backend: str, *, graph_frames: int = 1536) -> Token2Wav:
    """token2wav as the GPU profiles load it (fp16 flow, graphs up to 32 rows), its flow compiled by ``backend``."""
    return Token2Wav.from_model_dir(
        model_dir,
        device="cuda",
        dtype=torch.float16,
        graph_rows=32,
        graph_frames=graph_frames,
        hift_graph_rows=32,
        hift_graph_hops=HIFT_HOPS,
        compile_backend=backend,
    )


def compare_token2wav(model_dir: Path, report: dict[str, Any], counts: list[int], save: Callable[[], None]) -> None:
    rng = np.random.default_rng(0)
    prompt = four_second_voice(rng)
    tokens = rng.integers(0, 6561, 130)
    mels = {}
    for backend in ("", "inductor"):
        label = backend or "uncompiled"
        graphs_before = _compiled_graphs()
        started = time.monotonic()
        t2w = _gpu_token2wav(model_dir, backend)
        report[f"{label}_load_s"] = round(time.monotonic() - started, 1)
        loaded_graphs = _compiled_graphs()
        report[f"{label}_graphs_compiled_at_load"] = loaded_graphs - graphs_before
        t2w.sync_timing = True
        with torch.inference_mode():
            mels[label] = t2w.flow.inference_batch([_items(t2w, prompt, tokens[:60])[0]], solver=t2w.solver)[0]
        for count in counts:
            for _ in range(2):  # the first pass warms up
                times = _first_then_later(t2w, prompt, tokens, count)
            for name, (ms, split) in times.items():
                report[f"{label}_{name}_chunks_{count}_ms"] = ms
                report[f"{label}_{name}_chunks_{count}_split"] = split
            save()
        report[f"{label}_graphs_compiled_after_load"] = _compiled_graphs() - loaded_graphs
        report[f"{label}_gpu_memory_peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
        del t2w
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        save()
    report["inductor_flow_vs_uncompiled_rel_error"] = _relative(mels["inductor"], mels["uncompiled"])


def compare_encoders(
    model_dir: Path, report: dict[str, Any], counts: list[int], graph_frames: int, save: Callable[[], None]
) -> None:
    """The flow's encoder replayed from graphs against eager, in one token2wav (see the module's doc)."""
    rng = np.random.default_rng(0)
    prompt = four_second_voice(rng)
    tokens = rng.integers(0, 6561, 130)
    started = time.monotonic()
    t2w = _gpu_token2wav(model_dir, "inductor", graph_frames=graph_frames)
    graphs = t2w.encoder_graphs
    assert graphs is not None, "token2wav records encoder graphs with its flow graphs on CUDA"
    report["load_s"] = round(time.monotonic() - started, 1)
    report["encoder_capture_s"] = round(graphs.capture_s, 1)
    report["encoder_buckets"] = len(graphs.buckets)
    t2w.sync_timing = True
    # Three rows of different lengths: the graph pads them into a bucket, eager to the longest.
    items = [item for length in (60, 90, 30) for item in _items(t2w, prompt, tokens[:length])]
    with torch.inference_mode():
        mels = {}
        for label, encoder in (("graphs", graphs), ("eager", None)):
            mels[label] = t2w.flow.inference_batch(items, solver=t2w.solver, encoder=encoder)
        report["mel_rel_error_graphs_vs_eager"] = max(
            _relative(graphed, eager) for graphed, eager in zip(mels["graphs"], mels["eager"], strict=True)
        )
        flow = t2w.flow
        row = torch.as_tensor(np.concatenate([prompt.speech_tokens, tokens[:60]]))[None]
        lengths = torch.tensor([row.size(1) - 3], device="cuda")
        yes = torch.tensor([True], device="cuda")
        eager_mu = flow.encode(row.cuda(), lengths, yes, yes)
        graphed_mu = graphs(row, lengths, yes, yes)
        assert graphed_mu is not None
        report["mu_rel_error_graphs_vs_eager"] = _relative(graphed_mu.float(), eager_mu.float())
        for rows in counts:
            batch = (row.expand(rows, -1), lengths.expand(rows), yes.expand(rows), yes.expand(rows))
            report[f"encoder_graphs_{rows}_rows_ms"] = _time(lambda batch=batch: graphs(*batch))
            report[f"encoder_eager_{rows}_rows_ms"] = _time(
                lambda batch=batch: flow.encode(batch[0].cuda(), *batch[1:])
            )
        save()
    for count in counts:
        # Untimed first: a count's first conversions meet new shapes (HiFT's, cuBLAS's heuristics).
        for encoder in (graphs, None):
            t2w.encoder_graphs = encoder
            _first_then_later(t2w, prompt, tokens, count)
        for label, encoder in (("graphs", graphs), ("eager", None)) * 3:
            t2w.encoder_graphs = encoder
            times = _first_then_later(t2w, prompt, tokens, count)
            for name, (ms, split) in times.items():
                report.setdefault(f"{label}_{name}_chunks_{count}_ms", []).append(ms)
                report.setdefault(f"{label}_{name}_chunks_{count}_flow_ms", []).append(round(1000 * split["flow_s"], 1))
        save()
    t2w.encoder_graphs = graphs
    report["gpu_memory_peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)


def whole_estimator(model_dir: Path, report: dict[str, Any], frames: int, save: Callable[[], None]) -> None:
    device, dtype = torch.device("cuda"), torch.float16
    decoder = Token2Wav.from_model_dir(model_dir, device=device, dtype=dtype).flow.decoder

    def solver(rows: int) -> Callable[[], torch.Tensor]:
        noise = torch.Generator(device=device).manual_seed(0)
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
            report[f"compiled_{rows}_rel_err"] = _relative(mel, eager_mel[rows])
            report[f"compiled_eager_{rows}_ms"] = _time(solve)
            report[f"compiled_graph_{rows}_ms"] = _time(_recorded(solve).replay)
            save()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=ROOT / "var" / "gpu_cosyvoice2")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--counts", default="1,4,16,32", help="streams converted together")
    parser.add_argument("--whole-estimator", action="store_true", help="the static-shape probe of the estimator")
    parser.add_argument("--frames", type=int, default=256, help="--whole-estimator: mel frames of the solve")
    parser.add_argument("--encoder-graphs", action="store_true", help="the flow's encoder from graphs against eager")
    parser.add_argument("--graph-frames", type=int, default=1536, help="--encoder-graphs: token2wav's graph_frames")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = _flow_and_hift(args.workdir.resolve() / "token2wav_only")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save() -> None:
        (args.out / "gpu_flow_compile.json").write_text(json.dumps(report, indent=1) + "\n")

    counts = [int(count) for count in args.counts.split(",")]
    if args.encoder_graphs:
        compare_encoders(model_dir, report, counts, args.graph_frames, save)
    elif args.whole_estimator:
        report["frames"] = args.frames
        whole_estimator(model_dir, report, args.frames, save)
    else:
        compare_token2wav(model_dir, report, counts, save)
    save()
    print(json.dumps(report, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
