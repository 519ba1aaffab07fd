"""What text normalisation costs: per sentence, on the event loop, and in first-byte latency.

1. Start-up: building ``TextNormalizer`` (importing wetext, reading its grammars, warming up).
2. Per sentence: ``TextNormalizer.normalize`` over a set of English, Chinese and mixed
   sentences, number-heavy and plain (``--repeats`` times each): p50, p99 and max in ms.
3. Event loop: ``normalize_async`` on the same sentences, and on one long number-heavy input,
   beside a task that wakes as often as it can; the longest gap between its wake-ups is the
   longest time normalisation held the loop.
4. Through the gateway: the real gateway on the embedded Piper voice (pinned to ``--cores``),
   number-heavy texts sent in turn with ``text_normalization`` on and off; time to the first
   byte of streamed pcm, and the difference.

Writes ``text-normalization.md`` and ``text-normalization.json`` to ``--out``.

    python -m benchmarks.text_normalization --out docs/benchmarks/ [--repeats 50] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench_load import GatewayTarget, Sample, gateway_session
from benchmarks.bench_stack import GatewayServer
from benchmarks.bench_texts import TEXTS, BenchText
from tts_gateway.gateway.speech.text_normalization import TextNormalizer
from tts_gateway.gateway.speech.text_splitting import split_sentences

NUMBER_HEAVY = (
    "It costs $5 today.",
    "I paid €12.50 and £3.20, then $0.50 for the bag.",
    "Prices rose 3.5% in 2024, to $1,234,567 in total.",
    "Meet me at 10:30am on Jan. 5, 2024 in Room 101.",
    "It was -5°C outside and 72°F inside.",
    "Call 555-123-4567 or +1 555 123 4567 before 5 pm.",
    "Dr. Smith lives at 42 St. James St., No. 5.",
    "He came 1st in the 1990s and 23rd in 2010.",
    "It weighs 25kg and runs 3.2 km at 60 mph.",
    "Mail bob@example.com or visit www.example.com today.",
    "2024年3月3日，价格是5元。",  # noqa: RUF001
    "我在Apple工作了5年，月薪12,000元。",  # noqa: RUF001
    "今天-5°C，电话：13812345678。",  # noqa: RUF001
    "3.5%的人在10:30开会，共1,234人。",  # noqa: RUF001
    "It costs $5 today，价格是5元。",  # noqa: RUF001
)
PLAIN = tuple(sentence for text in TEXTS for sentence in split_sentences(text.text))
LONG_INPUT = " ".join(NUMBER_HEAVY[:10] * 8)  # ~3,500 characters, every sentence with numbers
LOOP_SECONDS = 10.0
GATEWAY_TEXTS = tuple(BenchText(f"numbers-{i}", "en", text) for i, text in enumerate(NUMBER_HEAVY[:10]))


def percentiles(values_ms: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values_ms)
    cuts = statistics.quantiles(ordered, n=100, method="inclusive")
    return {
        "p50": round(statistics.median(ordered), 3),
        "p99": round(cuts[98], 3),
        "max": round(ordered[-1], 3),
    }


def per_sentence(normalizer: TextNormalizer, sentences: Sequence[str], repeats: int) -> dict[str, Any]:
    """Wall and CPU (this thread's) milliseconds per ``normalize`` call.

    On a shared machine the wall time also counts the time other processes had the core; the
    thread's CPU time is what the call itself cost.
    """
    wall, cpu = [], []
    for _ in range(repeats):
        for sentence in sentences:
            started, started_cpu = time.perf_counter(), time.thread_time()
            normalizer.normalize(sentence)
            cpu.append((time.thread_time() - started_cpu) * 1000)
            wall.append((time.perf_counter() - started) * 1000)
    return {"sentences": len(sentences), "calls": len(wall), "cpu": percentiles(cpu), "wall": percentiles(wall)}


async def loop_gaps(normalizer: TextNormalizer | None, texts: Sequence[str], seconds: float) -> dict[str, float]:
    """Gaps (ms) between wake-ups of a task that yields continuously, while ``texts`` are normalised
    over and over for ``seconds`` (with ``normalizer`` None: while nothing else runs, the baseline
    of what the machine's other load does to the loop)."""
    gaps: list[float] = []
    running = True

    async def ticker() -> None:
        last = time.perf_counter()
        while running:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append((now - last) * 1000)
            last = now

    task = asyncio.create_task(ticker())
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for text in texts:
            if normalizer is None:
                await asyncio.sleep(0.001)
            else:
                await normalizer.normalize_async(text)
    running = False
    await task
    return percentiles(gaps) | {"p99.9": round(sorted(gaps)[int(len(gaps) * 0.999)], 3)}


async def first_bytes(url: str, rounds: int) -> dict[str, Any]:
    """First-byte times (ms) of the number-heavy texts with normalisation on and off, taking turns."""
    samples: dict[str, list[Sample]] = {"on": [], "off": []}
    async with gateway_session(1, 300) as http:
        targets = {
            name: GatewayTarget(http, url, "piper", "joe", "pcm", {"text_normalization": name == "on"})
            for name in samples
        }
        await targets["on"].request(GATEWAY_TEXTS[0])  # warm-up
        for _ in range(rounds):
            for text in GATEWAY_TEXTS:
                for name, target in targets.items():
                    samples[name].append(await target.request(text))
    failed = [s.error for group in samples.values() for s in group if s.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    figures: dict[str, Any] = {"requests": sum(len(group) for group in samples.values())}
    for name, group in samples.items():
        figures[name] = percentiles([(s.first_byte or s.total) * 1000 for s in group])
    differences = [
        ((on.first_byte or on.total) - (off.first_byte or off.total)) * 1000
        for on, off in zip(samples["on"], samples["off"], strict=True)
    ]
    figures["added_p50_ms"] = round(statistics.median(differences), 3)
    return figures


def measure(workdir: Path, repeats: int, rounds: int, cores: int) -> dict[str, Any]:
    started = time.perf_counter()
    normalizer = TextNormalizer()
    startup_s = time.perf_counter() - started
    uncached = TextNormalizer(cached_windows=0)  # every reading computed: the cost of text never seen before
    results: dict[str, Any] = {
        "startup_s": round(startup_s, 3),
        "number_heavy": per_sentence(uncached, NUMBER_HEAVY, repeats),
        "plain": per_sentence(uncached, PLAIN, repeats),
        "all": per_sentence(uncached, NUMBER_HEAVY + PLAIN, repeats),
        "number_heavy_cached": per_sentence(normalizer, NUMBER_HEAVY, repeats),
        "long_input_chars": len(LONG_INPUT),
        "long_input": per_sentence(uncached, [LONG_INPUT], max(3, repeats // 10)),
        "loop_gaps_ms": {
            "normalising": asyncio.run(loop_gaps(uncached, [*NUMBER_HEAVY, *PLAIN], LOOP_SECONDS)),
            "idle": asyncio.run(loop_gaps(None, NUMBER_HEAVY, LOOP_SECONDS)),
        },
    }
    normalizer.close()
    uncached.close()
    usable = sorted(os.sched_getaffinity(0))[:cores]
    with GatewayServer(workdir, {"TTS_TRITON_URL": ""}, cores=set(usable)) as gateway:
        results["gateway"] = asyncio.run(first_bytes(gateway.url, rounds))
    results["gateway"]["cores"] = cores
    return results


def report(results: dict[str, Any], command: str) -> str:
    gateway = results["gateway"]
    gaps = results["loop_gaps_ms"]
    lines = [
        "# Text normalisation cost",
        "",
        f"`{command}`",
        "",
        f"{results['date']}, {results['machine']}; load average {results['load_before']} before and "
        f"{results['load_after']} after: a shared machine, so wall times and maxima carry other processes' noise.",
        "",
        f"Start-up (import wetext, read both grammars, warm up): {results['startup_s']:.2f} s, once per process "
        "(on a thread, while Triton starts).",
        "",
        "## Per sentence (`TextNormalizer.normalize`)",
        "",
        "CPU: the calling thread's CPU time; wall: elapsed time. Every reading computed (no cache), except in the "
        "row that says otherwise, where the grammars' readings of windows seen before are looked up (the gateway's "
        "default: 4096 windows per language).",
        "",
        "| sentences | count | calls | CPU p50 ms | CPU p99 ms | wall p50 ms | wall p99 ms | wall max ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, label in (
        ("number_heavy", "number-heavy (English, Chinese, mixed)"),
        ("plain", "plain (the benchmark texts' sentences)"),
        ("all", "all of them"),
        ("number_heavy_cached", "number-heavy, readings cached"),
        ("long_input", f"one {results['long_input_chars']}-character input, every sentence with numbers"),
    ):
        row = results[key]
        cpu, wall = row["cpu"], row["wall"]
        lines.append(
            f"| {label} | {row['sentences']} | {row['calls']} | {cpu['p50']} | {cpu['p99']} | "
            f"{wall['p50']} | {wall['p99']} | {wall['max']} |"
        )
    lines += [
        "",
        "## The event loop",
        "",
        f"`normalize_async` runs on the normaliser's own thread. A task yielding continuously measured the gaps "
        f"between its wake-ups for {LOOP_SECONDS:g} s while every sentence above was normalised over and over, "
        "and for as long with nothing running (the machine's own noise):",
        "",
        "| loop | gap p50 ms | p99 ms | p99.9 ms | max ms |",
        "|---|---|---|---|---|",
    ]
    for key, label in (("normalising", "while normalising"), ("idle", "idle")):
        row = gaps[key]
        lines.append(f"| {label} | {row['p50']} | {row['p99']} | {row['p99.9']} | {row['max']} |")
    lines += [
        "",
        f"## First byte through the gateway (embedded Piper, {gateway['cores']} cores, streamed pcm)",
        "",
        f"{len(GATEWAY_TEXTS)} number-heavy English texts, `text_normalization` on and off in turn, "
        f"{gateway['requests']} requests. The normalised text is longer ('five dollars' for '$5'), so part of the "
        "difference is Piper speaking more words before the first chunk.",
        "",
        "| normalisation | first byte p50 ms | p99 ms | max ms |",
        "|---|---|---|---|",
        f"| on | {gateway['on']['p50']} | {gateway['on']['p99']} | {gateway['on']['max']} |",
        f"| off | {gateway['off']['p50']} | {gateway['off']['p99']} | {gateway['off']['max']} |",
        "",
        f"Added first-byte latency, median of the paired differences (on minus off): {gateway['added_p50_ms']} ms.",
        "",
    ]
    return "\n".join(lines)


def _load() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for the Markdown and JSON reports")
    parser.add_argument("--repeats", type=int, default=50, help="times each sentence is normalised")
    parser.add_argument("--rounds", type=int, default=5, help="times each text is sent through the gateway")
    parser.add_argument("--cores", type=int, default=2, help="CPUs the gateway and its Triton may use")
    args = parser.parse_args(argv)
    load_before = _load()
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(Path(tmp), args.repeats, args.rounds, args.cores)
    results |= {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "load_before": load_before,
        "load_after": _load(),
    }
    command = "python -m benchmarks.text_normalization --out docs/benchmarks/"
    if (args.repeats, args.rounds, args.cores) != (50, 5, 2):
        command += f" --repeats {args.repeats} --rounds {args.rounds} --cores {args.cores}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "text-normalization.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "text-normalization.md").write_text(report(results, command))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
