"""The benchmark report: the project's targets checked against it, Markdown tables and a plot.

Everything here reads the JSON-ready report dict that ``bench.py`` writes, so a saved
``bench.json`` can be rendered again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

OVERHEAD_TEXT = "short-en"
# Shown for a figure the run could not measure.
_NONE = "n/a"


@dataclass(frozen=True)
class TargetCheck:
    name: str
    goal: str
    measured: str
    passed: bool | None
    """None when the run did not measure it."""


def _levels(report: dict[str, Any], model: str, mode: str) -> dict[int, dict[str, Any]]:
    for sweep in report.get("sweeps", []):
        if sweep["model"] == model and sweep["mode"] == mode:
            return {level["concurrency"]: level for level in sweep["levels"]}
    return {}


def _check(name: str, goal: str, measure: Callable[[], tuple[str, bool] | None]) -> TargetCheck:
    try:
        found = measure()
    except (KeyError, TypeError):
        found = None
    if found is None:
        return TargetCheck(name, goal, "not measured", None)
    return TargetCheck(name, goal, found[0], found[1])


def check_targets(report: dict[str, Any], overhead_model: str) -> list[TargetCheck]:
    """The project's targets; the gateway-overhead ones on ``overhead_model`` (the benchmark fixture)."""
    offline = _levels(report, overhead_model, "offline")
    stream = _levels(report, overhead_model, "stream")

    def added_latency() -> tuple[str, bool] | None:
        gateway = offline[1]["gateway"]["by_text"][OVERHEAD_TEXT]
        direct = offline[1]["direct"]["by_text"][OVERHEAD_TEXT]
        added = gateway["total_p50_ms"] - direct["total_p50_ms"]
        return f"{added:+.2f} ms ({gateway['audio_s']:.1f} s of wav)", added <= 2.0

    def throughput(levels: dict[int, dict[str, Any]]) -> tuple[str, bool] | None:
        ratio = levels[32]["ratio"]["requests_per_s"]
        return f"{ratio * 100:.1f} % of direct", ratio >= 0.95

    def first_streamed_byte() -> tuple[str, bool] | None:
        added = stream[1]["ratio"]["first_byte_added_p50_ms"]
        return f"{added:+.2f} ms over the backend's first chunk", added <= 5.0

    def memory() -> tuple[str, bool] | None:
        peak = stream[64]["gateway"]["rss_peak_mb"]
        return f"{peak:.0f} MiB", peak <= 200.0

    cpu = report.get("cpu_default") or {}

    def cpu_rtf() -> tuple[str, bool] | None:
        return f"{cpu['rtf']:.3f} on {cpu['cores']} cores", cpu["rtf"] <= 0.15

    def five_sentences() -> tuple[str, bool] | None:
        ratio = cpu["first_audio_ratio"]
        return (
            f"{ratio:.2f}x ({cpu['five_sentences_first_audio_ms']:.0f} ms vs {cpu['first_sentence_alone_ms']:.0f} ms)",
            ratio <= 1.5,
        )

    checks = [
        _check(f"gateway added latency p50, offline, concurrency 1 ({overhead_model})", "<= 2 ms", added_latency),
        _check(
            f"throughput at concurrency 32, offline ({overhead_model})",
            ">= 95 % of direct Triton",
            lambda: throughput(offline),
        ),
        _check(
            f"throughput at concurrency 32, streaming ({overhead_model})",
            ">= 95 % of direct Triton",
            lambda: throughput(stream),
        ),
        _check(
            f"first streamed byte p50, concurrency 1 ({overhead_model})",
            "<= backend first chunk + 5 ms",
            first_streamed_byte,
        ),
        _check(f"gateway RSS with 64 concurrent streams ({overhead_model})", "<= 200 MB", memory),
        _check("embedded CPU default RTF, concurrency 1 (Piper)", "<= 0.15", cpu_rtf),
        _check("first audio of 5 sentences vs first sentence alone (Piper)", "<= 1.5x", five_sentences),
    ]
    by_format = {row["format"]: row for row in report.get("encoding", []) if row["input_rate"] == 24_000}
    for fmt in ("mp3", "opus", "aac"):

        def encoding(fmt: str = fmt) -> tuple[str, bool] | None:
            percent = by_format[fmt]["core_percent"]
            return f"{percent:.2f} % of a core", percent <= 3.0

        name = f"{fmt} streaming encoding per real-time stream (24 kHz in)"
        checks.append(_check(name, "<= 3 % of a core", encoding))
    return checks


def targets_json(checks: list[TargetCheck]) -> list[dict[str, Any]]:
    return [asdict(check) for check in checks]


# -- Markdown -------------------------------------------------------------------------------------


def _ms(figures: dict[str, float | None]) -> str:
    return " / ".join(_NONE if figures[p] is None else f"{figures[p]:.1f}" for p in ("p50", "p90", "p99"))


def _num(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return _NONE if value is None else f"{value:.{digits}f}{suffix}"


def _sweep_tables(sweep: dict[str, Any]) -> Iterator[str]:
    processes = sweep.get("gateway_processes")
    yield (
        f"### {sweep['model']}, {sweep['mode']} (Triton model `{sweep['triton_model']}`, "
        f"gateway `response_format={sweep['response_format']}`, texts: {', '.join(sweep['texts'])}"
        + ("" if processes is None else f"; {processes} processes in the gateway's tree")
        + ")"
    )
    yield ""
    yield (
        "| concurrency | target | first byte ms p50 / p90 / p99 | total ms p50 / p90 / p99 | RTF | req/s | errors"
        " | RSS MiB |"
    )
    yield "|---:|---|---|---|---:|---:|---:|---:|"
    for level in sweep["levels"]:
        for target in ("direct", "gateway"):
            stats = level[target]
            yield (
                f"| {level['concurrency']} | {target} | {_ms(stats['first_byte_ms'])} | {_ms(stats['total_ms'])} "
                f"| {_num(stats['rtf'], 4)} | {_num(stats['requests_per_s'], 1)} "
                f"| {stats['errors']}/{stats['requests']} | {_num(stats['rss_peak_mb'], 0)} |"
            )
    yield ""
    yield "Gateway / direct Triton:"
    yield ""
    yield "| concurrency | first byte p50 | p90 | p99 | added p50 ms | total p50 | p90 | p99 | added p50 ms | req/s |"
    yield "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    for level in sweep["levels"]:
        r = level["ratio"]
        yield (
            f"| {level['concurrency']} | {_num(r['first_byte_p50'])} | {_num(r['first_byte_p90'])} "
            f"| {_num(r['first_byte_p99'])} | {_num(r['first_byte_added_p50_ms'], 1)} | {_num(r['total_p50'])} "
            f"| {_num(r['total_p90'])} | {_num(r['total_p99'])} | {_num(r['total_added_p50_ms'], 1)} "
            f"| {_num(r['requests_per_s'])} |"
        )
    yield ""


def _stack_line(stack: dict[str, Any]) -> str:
    workers = stack["gateway_workers"]
    gateway = "a gateway not started here" if workers is None else f"gateway workers: {workers}"
    where = {"triton": "Triton", "gateway": "gateway", "clients": "clients"}
    cpus = ", ".join(f"{where[part]} {stack['cpus'][part]}" for part in where if part in stack["cpus"])
    return f"Sweep stack: {gateway}; client processes: {stack['client_processes']}; CPUs: {cpus}."


def markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [
        "# Benchmark report",
        "",
        f"`{report['command']}`",
        "",
        f"{report['started']}, {machine['cpu']} ({machine['cpus_usable']} usable CPUs), "
        f"{machine['memory_gib']:.0f} GiB, {machine['system']}, Python {machine['python']}; "
        f"load average at start {machine['load_average']}.",
        "",
    ]
    if report.get("stack"):
        lines += [_stack_line(report["stack"]), ""]
    lines += [
        "## Targets",
        "",
        "| target | goal | measured | result |",
        "|---|---|---|---|",
    ]
    for check in report["targets"]:
        result = {True: "pass", False: "**FAIL**", None: _NONE}[check["passed"]]
        lines.append(f"| {check['name']} | {check['goal']} | {check['measured']} | {result} |")
    lines.append("")
    if report.get("sweeps"):
        lines += [
            "## Concurrency sweeps",
            "",
            "RSS: the gateway's peak resident memory, its worker processes included (summed).",
            "",
        ]
        for sweep in report["sweeps"]:
            lines += list(_sweep_tables(sweep))
    if report.get("encoding"):
        lines += [
            "## Streaming encoding cost",
            "",
            "| format | input Hz | CPU s per audio s | % of a core per real-time stream |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {row['format']} | {row['input_rate']} | {row['cpu_s_per_audio_s']:.5f} | {row['core_percent']:.2f} |"
            for row in report["encoding"]
        ]
        lines.append("")
    cpu = report.get("cpu_default")
    if cpu:
        lines += [
            "## Embedded CPU default (Piper, `tts-gateway serve` without a Triton URL)",
            "",
            f"Cores: {cpu['cores']}. RTF at concurrency 1: {cpu['rtf']:.3f} ({cpu['requests']} requests, "
            f"{cpu['audio_s']:.1f} s of audio). First audio of the 5-sentence text: "
            f"{cpu['five_sentences_first_audio_ms']:.0f} ms; its first sentence alone, whole response: "
            f"{cpu['first_sentence_alone_ms']:.0f} ms (ratio {cpu['first_audio_ratio']:.2f}).",
            "",
        ]
    return "\n".join(lines)


# -- plot -----------------------------------------------------------------------------------------


def plot(report: dict[str, Any], path: Path) -> None:
    """First-byte latency p50 and throughput against concurrency, one line per sweep and target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter, ScalarFormatter

    fig, (latency, throughput) = plt.subplots(1, 2, figsize=(12, 4.5))
    ticks: set[int] = set()
    for index, sweep in enumerate(report.get("sweeps", [])):
        levels = [level["concurrency"] for level in sweep["levels"]]
        ticks.update(levels)
        # One colour per sweep; direct Triton dashed, the gateway solid.
        for target, style in (("direct", "--"), ("gateway", "-")):
            label = f"{sweep['model']} {sweep['mode']} {target}"
            first = [level[target]["first_byte_ms"]["p50"] for level in sweep["levels"]]
            rate = [level[target]["requests_per_s"] for level in sweep["levels"]]
            colour = f"C{index % 10}"
            latency.plot(levels, first, style, color=colour, marker="o", label=label)
            throughput.plot(levels, rate, style, color=colour, marker="o", label=label)
    for axis, title, unit in (
        (latency, "time to first audio byte, p50", "ms"),
        (throughput, "throughput", "requests/s"),
    ):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(sorted(ticks))
        axis.xaxis.set_major_formatter(ScalarFormatter())
        # Plain numbers (20, not 2 x 10^1) on the logarithmic latency and throughput axes.
        axis.yaxis.set_major_formatter(LogFormatter())
        axis.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        axis.set_xlabel("concurrency")
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
    throughput.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
