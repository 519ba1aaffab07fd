"""The GPU engines checked against their eager selves, then timed in isolation (no Triton).

On the full-size random checkpoint (``tts-models random-full``):

- LLM, for each engine variant (CUDA graphs over whole slots; over attention spans; spans with the
  regions and sampler compiled by inductor): how many of 40 greedy tokens equal the eager engine's
  before they first differ (the recorded prefill pads the prompt to its bucket and compiled kernels
  sum in another order, so bf16 sums may round differently), how many of 16 concurrent greedy
  requests match their solo tokens, and decode throughput with 1 / 16 / 64 requests in flight;
- token2wav: the graph-replayed flow solve against the eager one (relative error of the mel), the
  same for a streaming chunk solved after the recorded voice prefix, the time to record a voice's
  prefix, and the time of one batched conversion of 1 / 4 / 16 / 32 first chunks and of later
  chunks (100 tokens in), with the prefix cache and without;
- HiFT: first chunks (30 mel frames) and second chunks (58, 8 of them cached) of 1 / 4 / 16 streams
  vocoded from the recorded graphs against HiFT itself eagerly with the same noise (relative error
  of the waveform), both timed, and the time the graphs took to record.

    python -m benchmarks.gpu_engine_check --out /tmp/check   # about a minute after the checkpoint
    # token2wav alone, small graph buckets (writes only the flow and HiFT weights): ~1 minute
    python -m benchmarks.gpu_engine_check --token2wav-only --graph-rows 4 --graph-frames 512 --counts 1,4
    # the same on the CPU in float32, eagerly (no graphs): ~2 minutes
    python -m benchmarks.gpu_engine_check --token2wav-only --cpu --counts 1
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch._dynamo.utils import counters

from tts_gateway.models.cosyvoice2.checkpoints import config_writer
from tts_gateway.models.cosyvoice2.checkpoints.random_checkpoint import (
    CONFIG_FILENAME,
    COSYVOICE_DIRNAME,
    ensure_checkpoint,
    full_size,
    module_states,
)
from tts_gateway.models.cosyvoice2.engines.hift_graphs import HiftGraphs
from tts_gateway.models.cosyvoice2.engines.llm import SamplingParams, TorchSpeechLLM
from tts_gateway.models.cosyvoice2.engines.token2wav import Conversion, Token2Wav
from tts_gateway.models.cosyvoice2.model import vocab
from tts_gateway.models.cosyvoice2.model.frontend import VoicePrompt
from tts_gateway.models.cosyvoice2.model.hift_stream import DEFAULT_MEL_CACHE_FRAMES

ROOT = Path(__file__).resolve().parents[1]

GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1)
# The GPU profiles' hop schedule (first_hop_tokens, then base_hop_tokens doubling up to max_hop_tokens).
HIFT_HOPS = (15, 25, 50, 100)


def prompt_ids(seed: int, length: int = 150) -> list[int]:
    rng = np.random.default_rng(seed)
    text = rng.integers(0, 150000, length - 100).tolist()
    speech = vocab.speech_tokens_to_ids(rng.integers(0, vocab.SPEECH_TOKEN_SIZE, 100).tolist())
    return [vocab.SOS_ID, *text, vocab.TASK_ID_ID, *speech]


def run_all(llm: TorchSpeechLLM, prompts: list[list[int]], params: SamplingParams, tokens: int) -> list[list[int]]:
    """Generate for every prompt at once (each in its own thread, as Triton's requests arrive)."""
    results: list[list[int]] = [[] for _ in prompts]

    def one(index: int) -> None:
        results[index] = list(
            llm.generate(prompts[index], params, max_new_tokens=tokens, min_new_tokens=tokens, stop_ids=vocab.STOP_IDS)
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


# The LLM engines timed side by side: graphs over whole slots, uncompiled (the engine before spans and
# compiling); graphs over attention spans; and spans with the regions and sampler compiled by inductor.
LLM_VARIANTS: dict[str, dict[str, Any]] = {
    "graphs": {"spans": (), "compile_backend": ""},
    "graphs+spans": {"compile_backend": ""},
    "graphs+spans+inductor": {"compile_backend": "inductor"},
}


def compiled_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def check_llm(llm_dir: Path, report: dict[str, Any], variants: list[str]) -> None:
    """Each engine variant against the eager engine (greedy agreement), then its decode throughput."""
    eager = TorchSpeechLLM(llm_dir, "cuda", "bfloat16", max_slots=64, max_seq_len=3072, cuda_graphs=False)
    reference = run_all(eager, [prompt_ids(0)], GREEDY, 40)[0]
    eager.close()
    del eager  # its cache out of GPU memory before the next engine loads
    for name in variants:
        started = time.monotonic()
        llm = TorchSpeechLLM(
            llm_dir, "cuda", "bfloat16", max_slots=64, max_seq_len=3072, cuda_graphs=True, **LLM_VARIANTS[name]
        )
        result: dict[str, Any] = {"load_and_capture_s": round(time.monotonic() - started, 1)}
        loaded_graphs = compiled_graphs()
        solo = [run_all(llm, [prompt_ids(i)], GREEDY, 40)[0] for i in range(16)]
        agree = next((i for i, (a, b) in enumerate(zip(solo[0], reference, strict=True)) if a != b), len(reference))
        result["greedy_tokens_agreeing_with_eager"] = f"{agree}/{len(reference)}"
        batched = run_all(llm, [prompt_ids(i) for i in range(16)], GREEDY, 40)
        result["batched_greedy_equal_solo"] = f"{sum(a == b for a, b in zip(solo, batched, strict=True))}/16"
        for count in (1, 16, 64):
            run_all(llm, [prompt_ids(i) for i in range(count)], SAMPLED, 20)
            started = time.monotonic()
            out = run_all(llm, [prompt_ids(100 + i) for i in range(count)], SAMPLED, 200)
            wall = time.monotonic() - started
            result[f"tokens_per_s_{count}"] = round(sum(len(o) for o in out) / wall)
            result[f"ms_per_step_{count}"] = round(1000 * wall / 200, 2)
        # Requests must never wait for a compile: dynamo's graphs made after the load (0 expected).
        result["graphs_compiled_after_load"] = compiled_graphs() - loaded_graphs
        llm.close()
        del llm
        report.setdefault("llm", {})[name] = result
        print(name, result, flush=True)


def check_token2wav(
    model_dir: Path,
    report: dict[str, Any],
    *,
    cpu: bool = False,
    graph_rows: int = 32,
    graph_frames: int = 1536,
    hift_graph_rows: int = 32,
    counts: Any = (1, 4, 16, 32),
) -> None:
    started = time.monotonic()
    graphs = Token2Wav.from_model_dir(
        model_dir,
        device="cpu" if cpu else "cuda",
        dtype=torch.float32 if cpu else torch.float16,
        graph_rows=graph_rows,
        graph_frames=graph_frames,
        prefix_cache_mb=2048,
        prefix_frames=300,
        hift_graph_rows=hift_graph_rows,
        hift_graph_hops=HIFT_HOPS,
    )
    report["token2wav_load_and_capture_s"] = round(time.monotonic() - started, 1)
    # The flow/HiFT split of each conversion waits for the GPU at the boundary (else the flow's
    # time would show up as HiFT's, which waits for it).
    graphs.sync_timing = True
    rng = np.random.default_rng(0)
    prompt = four_second_voice(rng)
    tokens = rng.integers(0, 6561, 130)
    solver, cache = graphs.solver, graphs.prefix_cache  # no solver on the CPU: everything eager
    assert cache is not None
    with torch.inference_mode():
        item = _items(graphs, prompt, tokens[:60])[0]
        eager_mel = graphs.flow.inference_batch([item])[0]
        graph_mel = graphs.flow.inference_batch([item], solver=solver)[0]
        _synchronize()
        started = time.monotonic()
        prefix = graphs._prefix(Conversion("check", tokens[:60], prompt, 0, False), item)
        _synchronize()
        report["flow_prefix_record_ms"] = round(1000 * (time.monotonic() - started), 1)
        assert prefix is not None
        report["flow_prefix_frames"] = prefix.frames
        report["flow_prefix_mb"] = round(prefix.nbytes / 2**20, 1)
        prefix_mel = graphs.flow.inference_batch([item], solver=solver, prefixes=[prefix])[0]
    mode = "eager" if solver is None else "graph"
    report[f"flow_{mode}_vs_eager_rel_error"] = _relative(graph_mel, eager_mel)
    report[f"flow_{mode}_after_prefix_vs_eager_rel_error"] = _relative(prefix_mel, eager_mel)
    for cached in (True, False):
        graphs.prefix_cache = cache if cached else None
        label = "prefix" if cached else "whole"
        for count in counts:
            for _ in range(2):  # the first pass warms up (and records the voice's prefix)
                times = _first_then_later(graphs, prompt, tokens, count)
            for name, (ms, split) in times.items():
                report[f"token2wav_{name}_chunks_{count}_{label}_ms"] = ms
                report[f"token2wav_{name}_chunks_{count}_{label}_split"] = split
    graphs.prefix_cache = cache
    check_hift(graphs, report, rows=hift_graph_rows, counts=[count for count in counts if count <= hift_graph_rows])


def check_hift(t2w: Token2Wav, report: dict[str, Any], *, rows: int, counts: list[int]) -> None:
    """HiFT from its graphs against HiFT eagerly, with the same noise: first chunks (30 mel frames) and
    second chunks (50 new frames after the 8 cached ones)."""
    hift = t2w.hift
    graphs = t2w.hift_graphs
    ratio = t2w.flow.cfg.token_mel_ratio
    if graphs is None:  # the CPU: the same static buffers, replayed eagerly
        graphs = HiftGraphs(
            hift, max_rows=rows, hops=HIFT_HOPS, token_mel_ratio=ratio, cache_frames=DEFAULT_MEL_CACHE_FRAMES
        )
    report["hift_graphs_capture_s"] = round(graphs.capture_s, 1)
    reference = hift.conv_pre.bias
    chunks = {
        "first": (HIFT_HOPS[0] * ratio, 0),
        "second": (HIFT_HOPS[1] * ratio + DEFAULT_MEL_CACHE_FRAMES, DEFAULT_MEL_CACHE_FRAMES),
    }
    for count, (name, (frames, cached)) in itertools.product(counts, chunks.items()):
        generator = torch.Generator(device=reference.device).manual_seed(count)
        mel = torch.randn(count, 80, frames, generator=generator, device=reference.device, dtype=reference.dtype)
        noise = hift.draw_noise(count, frames, generator)
        cache = None
        if cached:
            samples = cached * hift.samples_per_frame
            cache = 0.1 * torch.randn(count, 1, samples, generator=generator, device=reference.device)
            cache = cache.to(reference.dtype)
        with torch.inference_mode():
            runs = {
                "eager": functools.partial(hift.vocode, mel, noise, cache),
                "graph": functools.partial(graphs, mel, noise, cache),
            }
            outputs = {}
            for label, run in runs.items():
                outputs[label] = run()
                timings = []
                for _ in range(5):
                    _synchronize()
                    started = time.monotonic()
                    run()
                    _synchronize()
                    timings.append(time.monotonic() - started)
                report[f"hift_{name}_chunks_{count}_{label}_ms"] = round(1000 * float(np.median(timings)), 2)
        eager, graphed = outputs["eager"], outputs["graph"]
        assert graphed is not None, f"no HiFT graph for {count} {name} chunks"
        report[f"hift_{name}_chunks_{count}_graph_vs_eager_rel_error"] = _relative(graphed[0], eager[0])


def four_second_voice(rng: np.random.Generator) -> VoicePrompt:
    """A random voice prompt of 100 speech tokens: a 4 s reference, as the GPU benchmark's voices."""
    return VoicePrompt(
        speech_tokens=rng.integers(0, 6561, 100),
        feats=rng.standard_normal((200, 80)).astype(np.float32),
        embedding=rng.standard_normal(192).astype(np.float32),
    )


def _first_then_later(
    t2w: Token2Wav, prompt: VoicePrompt, tokens: np.ndarray, count: int
) -> dict[str, tuple[float, dict[str, float]]]:
    """``count`` streams' first chunks (15 tokens + look-ahead) as one batch, then their chunks 100 tokens in."""
    first = [Conversion(f"s{count}-{i}", tokens[:18], prompt, 0, False) for i in range(count)]
    later = [Conversion(f"s{count}-{i}", tokens[:103], prompt, 15, False) for i in range(count)]
    times = {}
    for name, calls in (("first", first), ("later", later)):
        _synchronize()
        started = time.monotonic()
        t2w.convert(calls)
        _synchronize()
        times[name] = (
            round(1000 * (time.monotonic() - started), 1),
            {k: round(v, 4) for k, v in t2w.last_timing.items()},
        )
    for call in first:
        t2w.release(call.session_id)
    return times


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return round(float((got - expected).norm() / expected.norm()), 6)


def _items(t2w: Token2Wav, prompt: VoicePrompt, tokens: np.ndarray) -> list[Any]:
    call = Conversion("check", tokens, prompt, 0, False)
    return [t2w._flow_item(call, torch.as_tensor(tokens))]


def _flow_and_hift(root: Path) -> Path:
    """The full-size config, flow.pt and hift.pt alone (what token2wav loads), as the full checkpoint has them."""
    model_dir = root / COSYVOICE_DIRNAME
    model_dir.mkdir(parents=True, exist_ok=True)
    size = full_size()
    config_writer.write_config(size.model, model_dir / CONFIG_FILENAME)
    for filename, state in module_states(size.model).items():
        torch.save(state, model_dir / filename)
    return model_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=ROOT / "var" / "gpu_cosyvoice2")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--token2wav-only", action="store_true", help="skip the LLM (and writing its weights)")
    parser.add_argument("--llm-only", action="store_true", help="skip token2wav")
    parser.add_argument(
        "--cpu", action="store_true", help="token2wav on the CPU in float32, eagerly (implies --token2wav-only)"
    )
    parser.add_argument("--graph-rows", type=int, default=32)
    parser.add_argument("--graph-frames", type=int, default=1536)
    parser.add_argument("--hift-graph-rows", type=int, default=32)
    parser.add_argument("--counts", default="1,4,16,32", help="batch sizes of the token2wav timings")
    parser.add_argument(
        "--llm-variants", default=",".join(LLM_VARIANTS), help=f"LLM engines to time, of {', '.join(LLM_VARIANTS)}"
    )
    args = parser.parse_args()
    llm_variants = [name for name in args.llm_variants.split(",") if name]
    if unknown := set(llm_variants) - set(LLM_VARIANTS):
        parser.error(f"unknown LLM variants {sorted(unknown)}")
    device = "cpu" if args.cpu else torch.cuda.get_device_name()
    report: dict[str, Any] = {"device": device, "torch": torch.__version__}
    counts = [int(count) for count in args.counts.split(",")]
    if args.token2wav_only or args.cpu:
        model_dir = _flow_and_hift(args.workdir.resolve() / "token2wav_only")
        checks = []
    else:
        checkpoint, _ = ensure_checkpoint(args.workdir.resolve() / "models", full_size())
        model_dir = checkpoint.model_dir
        checks = [lambda: check_llm(checkpoint.llm_dir, report, llm_variants)]
    if not args.llm_only:
        checks.append(
            lambda: check_token2wav(
                model_dir,
                report,
                cpu=args.cpu,
                graph_rows=args.graph_rows,
                graph_frames=args.graph_frames,
                hift_graph_rows=args.hift_graph_rows,
                counts=counts,
            )
        )
    for check in checks:
        try:
            check()
        except Exception as exc:  # report what ran, then the failure
            report.setdefault("errors", []).append(f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_engine_check.json").write_text(text + "\n")
    return 1 if "errors" in report else 0


if __name__ == "__main__":
    sys.exit(main())
