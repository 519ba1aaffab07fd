"""The GPU engines checked against their eager selves, then timed in isolation (no Triton).

On the full-size random checkpoint (``scripts/cosyvoice_models.py random-full``):

- LLM: how many of 40 greedy tokens from the CUDA-graph engine equal the eager engine's before they
  first differ (the recorded prefill pads the prompt to its bucket, so bf16 sums may round differently),
  how many of 16 concurrent greedy requests match their solo tokens, and decode throughput with
  1 / 16 / 64 requests in flight;
- token2wav: the graph-replayed flow solve against the eager one (relative error of the mel), and
  the time of one batched conversion of 1 / 4 / 16 / 32 first chunks.

    python benchmarks/gpu_engine_check.py --out /tmp/check   # about a minute after the checkpoint
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_sanity import ROOT

from tts_backends.cosyvoice2 import vocab
from tts_backends.cosyvoice2.frontend import VoicePrompt
from tts_backends.cosyvoice2.llm import SamplingParams, TorchSpeechLLM
from tts_backends.cosyvoice2.random_checkpoint import ensure_checkpoint, full_size
from tts_backends.cosyvoice2.token2wav import Conversion, Token2Wav

GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1)


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


def check_llm(llm_dir: Path, report: dict[str, Any]) -> None:
    started = time.monotonic()
    graphs = TorchSpeechLLM(llm_dir, "cuda", "bfloat16", max_slots=64, max_seq_len=3072, cuda_graphs=True)
    report["llm_load_and_capture_s"] = round(time.monotonic() - started, 1)
    eager = TorchSpeechLLM(llm_dir, "cuda", "bfloat16", max_slots=64, max_seq_len=3072, cuda_graphs=False)
    solo = [run_all(graphs, [prompt_ids(i)], GREEDY, 40)[0] for i in range(16)]
    reference = run_all(eager, [prompt_ids(0)], GREEDY, 40)[0]
    agree = next((i for i, (a, b) in enumerate(zip(solo[0], reference, strict=True)) if a != b), len(reference))
    report["llm_graph_vs_eager_greedy_tokens_agreeing"] = f"{agree}/{len(reference)}"
    batched = run_all(graphs, [prompt_ids(i) for i in range(16)], GREEDY, 40)
    report["llm_batched_greedy_equal_solo"] = f"{sum(a == b for a, b in zip(solo, batched, strict=True))}/16"
    for count in (1, 16, 64):
        run_all(graphs, [prompt_ids(i) for i in range(count)], SAMPLED, 20)
        started = time.monotonic()
        out = run_all(graphs, [prompt_ids(100 + i) for i in range(count)], SAMPLED, 200)
        wall = time.monotonic() - started
        report[f"llm_tokens_per_s_{count}"] = round(sum(len(o) for o in out) / wall)
        report[f"llm_ms_per_step_{count}"] = round(1000 * wall / 200, 2)
    graphs.close()
    eager.close()


def check_token2wav(model_dir: Path, report: dict[str, Any]) -> None:
    started = time.monotonic()
    graphs = Token2Wav.from_model_dir(model_dir, device="cuda", dtype=torch.float16, graph_rows=32)
    report["token2wav_load_and_capture_s"] = round(time.monotonic() - started, 1)
    rng = np.random.default_rng(0)
    prompt = VoicePrompt(
        speech_tokens=rng.integers(0, 6561, 100),
        feats=rng.standard_normal((200, 80)).astype(np.float32),
        embedding=rng.standard_normal(192).astype(np.float32),
    )
    tokens = rng.integers(0, 6561, 60)
    with torch.inference_mode():
        graphs.solver, solver = None, graphs.solver
        eager_mel = graphs.flow.inference_batch(_items(graphs, prompt, tokens))[0]
        graphs.solver = solver
        graph_mel = graphs.flow.inference_batch(_items(graphs, prompt, tokens), solver=solver)[0]
    error = float((graph_mel - eager_mel).norm() / eager_mel.norm())
    report["flow_graph_vs_eager_rel_error"] = round(error, 6)
    for count in (1, 4, 16, 32):
        calls = [Conversion(f"s{count}-{i}", tokens[:18], prompt, 0, False) for i in range(count)]
        graphs.convert(calls)
        for call in calls:
            graphs.release(call.session_id)
        torch.cuda.synchronize()
        started = time.monotonic()
        graphs.convert(calls)
        torch.cuda.synchronize()
        report[f"token2wav_first_chunks_{count}_ms"] = round(1000 * (time.monotonic() - started), 1)
        report[f"token2wav_first_chunks_{count}_split"] = {k: round(v, 4) for k, v in graphs.last_timing.items()}
        for call in calls:
            graphs.release(call.session_id)


def _items(t2w: Token2Wav, prompt: VoicePrompt, tokens: np.ndarray) -> list[Any]:
    call = Conversion("check", tokens, prompt, 0, False)
    return [t2w._flow_item(call, torch.as_tensor(tokens))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=ROOT / "var" / "gpu_cosyvoice2")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    checkpoint, _ = ensure_checkpoint(args.workdir.resolve() / "models", full_size())
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for check in (lambda: check_llm(checkpoint.llm_dir, report), lambda: check_token2wav(checkpoint.model_dir, report)):
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
