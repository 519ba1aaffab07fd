"""How far a first chunk's GPU stages are from their floors on the device that ran them.

A floor is what a stage would take if the GPU did only the work it cannot avoid, at the rate this
device was measured to reach:

- the flow of a token2wav group: the estimator's arithmetic (its FLOPs counted by torch's
  ``FlopCounterMode`` on the project's own modules, for the group's rows and frames, both halves of
  the classifier-free-guidance pair, every solver step) at the device's fp16 matmul rate;
- a decode step of the LLM: reading the transformer's weights once and the KV cache of every row in
  the step at the device's copy bandwidth (the pass's streams per GPU as rows, up to the LLM's slots, each
  row as long as the request measured: its prompt and half the tokens it produced).

Real kernels reach neither (elementwise work between the matrix products, small matrices, launches),
so the ratio says how much faster kernels could win at most, not what they will.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2Config, Qwen2Model

from benchmarks.bench_stats import percentiles_ms
from tts_gateway.models.cosyvoice2.model.config import EstimatorConfig
from tts_gateway.models.cosyvoice2.model.flow_decoder import CausalConditionalDecoder
from tts_gateway.models.stage_trace import read_traces

FLOORS = (
    ("flow", "flow_floor", "token2wav: flow of its group, against its FLOPs at the fp16 matmul rate"),
    ("llm_step_gpu", "llm_step_floor", "LLM engine: a decode step, against its weights and KV cache at the copy rate"),
)


@dataclass(frozen=True)
class DeviceRates:
    """What this GPU was measured to reach: fp16 matrix products (FLOP/s) and device copies (bytes/s,
    read and written)."""

    matmul_flops: float
    copy_bytes: float


def measure_device(device: torch.device, *, size: int = 8192, copy_mib: int = 1024) -> DeviceRates:
    """The best of timed fp16 ``size``-cubed matrix products and of ``copy_mib`` MiB device copies."""
    rates = DeviceRates(
        matmul_flops=2.0 * size**3 / _matmul_s(device, size),
        copy_bytes=2.0 * (copy_mib << 20) / _copy_s(device, copy_mib),
    )
    torch.cuda.empty_cache()
    return rates


def _matmul_s(device: torch.device, size: int) -> float:
    a = torch.randn(size, size, device=device, dtype=torch.float16)
    b = torch.randn(size, size, device=device, dtype=torch.float16)
    return _best_s(device, lambda: torch.mm(a, b))


def _copy_s(device: torch.device, mib: int) -> float:
    source = torch.empty(mib << 20, device=device, dtype=torch.uint8)
    target = torch.empty_like(source)
    return _best_s(device, lambda: target.copy_(source))


def _best_s(device: torch.device, work: Callable[[], object], repeats: int = 20) -> float:
    work()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1000.0)
    return min(times)


class EstimatorFlops:
    """FLOPs of one estimator call per row (one half of a CFG pair) at a number of mel frames.

    They are a polynomial of degree two in the frames (attention grows with their square, everything
    else with the frames), so three counts on the meta device give every frame count exactly.
    """

    def __init__(self, cfg: EstimatorConfig, *, samples: tuple[int, int, int] = (64, 128, 192)) -> None:
        with torch.device("meta"):
            estimator = CausalConditionalDecoder(cfg)
        counts = [self._count(estimator, frames) for frames in samples]
        self._coefficients = np.polyfit(np.array(samples, dtype=np.float64), np.array(counts), 2)

    @staticmethod
    def _count(estimator: CausalConditionalDecoder, frames: int) -> float:
        channels = estimator.in_channels // 4  # x, mu, speaker and prompt condition are stacked
        x = torch.zeros(1, channels, frames, device="meta")
        with FlopCounterMode(display=False) as counter:
            estimator(
                x,
                torch.ones(1, 1, frames, device="meta"),
                x,
                torch.zeros(1, device="meta"),
                torch.zeros(1, channels, device="meta"),
                x,
                torch.ones(1, dtype=torch.bool, device="meta"),
            )
        return float(counter.get_total_flops())

    def __call__(self, frames: float) -> float:
        return float(np.polyval(self._coefficients, frames))


@dataclass(frozen=True)
class LlmBytes:
    """What a decode step must read: the transformer's weights (not the token embedding, of which a
    step reads one row per request) and, per row, the KV cache at each position before it."""

    weights: int
    kv_per_position: int

    @classmethod
    def of(cls, config: Qwen2Config, element_bytes: int = 2) -> LlmBytes:
        with torch.device("meta"):
            model = Qwen2Model(config)
        embedding = model.embed_tokens.weight.numel()
        weights = (sum(p.numel() for p in model.parameters()) - embedding) * element_bytes
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        kv_heads = int(config.num_key_value_heads or config.num_attention_heads)
        kv = config.num_hidden_layers * 2 * kv_heads * head_dim * element_bytes
        return cls(weights=weights, kv_per_position=kv)


@dataclass(frozen=True)
class Floors:
    rates: DeviceRates
    estimator: EstimatorFlops
    llm: LlmBytes
    n_timesteps: int

    def flow_s(self, rows: float, frames: float) -> float:
        """A group's solve: ``rows`` calls, each the CFG pair, over ``frames`` frames, every step."""
        return rows * 2 * self.n_timesteps * self.estimator(frames) / self.rates.matmul_flops

    def step_s(self, rows: float, position: float) -> float:
        """A decode step of ``rows`` rows whose caches hold ``position`` positions each."""
        return (self.llm.weights + rows * position * self.llm.kv_per_position) / self.rates.copy_bytes

    def describe(self) -> str:
        return (
            f"device measured at {self.rates.matmul_flops / 1e12:.0f} TFLOP/s (fp16 matrix products) and "
            f"{self.rates.copy_bytes / 1e12:.2f} TB/s (device copies, read and written); estimator "
            f"{self.estimator(100) / 1e9:.1f} GFLOP per row and call at 100 frames; LLM weights read per step "
            f"{self.llm.weights / 2**20:.0f} MiB, KV cache {self.llm.kv_per_position / 1024:.0f} KiB per position"
        )


def measure(device: torch.device, estimator: EstimatorConfig, llm: Qwen2Config, n_timesteps: int) -> Floors:
    started = time.perf_counter()
    floors = Floors(measure_device(device), EstimatorFlops(estimator), LlmBytes.of(llm), n_timesteps)
    print(f"floors: {floors.describe()} ({time.perf_counter() - started:.1f} s)", flush=True)
    return floors


def stage_floors(
    trace_dir: Path, sent: Mapping[str, tuple[float, float]], floors: Floors, rows: int
) -> dict[str, dict[str, float | None]]:
    """Per floor, percentiles in ms over the streamed requests in ``sent``: the flow of each request's first
    group (its rows and frames from token2wav's trace) and its decode steps (``rows`` rows, at the
    request's mean position: its prompt and half the tokens it produced)."""
    events = read_traces(trace_dir)
    sessions = {str(e["key"]) for e in events if e["stage"] == "orchestrator" and e.get("request") in sent}
    samples: dict[str, list[float]] = {"flow_floor": [], "llm_step_floor": []}
    first_groups: set[str] = set()
    for event in events:
        key = str(event["key"])
        if key not in sessions:
            continue
        if event["stage"] == "token2wav" and event["offset"] == 0 and key not in first_groups and event.get("frames"):
            first_groups.add(key)
            samples["flow_floor"].append(floors.flow_s(float(event["rows"]), float(event["frames"])))  # type: ignore[arg-type]
        elif event["stage"] == "llm" and event.get("prompt_tokens") is not None:
            position = float(event["prompt_tokens"]) + float(event["tokens"]) / 2  # type: ignore[arg-type]
            samples["llm_step_floor"].append(floors.step_s(rows, position))
    return {name: percentiles_ms(values) for name, values in samples.items() if values}
