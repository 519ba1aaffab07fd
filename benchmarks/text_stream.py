"""Benchmark the text-to-speech WebSocket against the OpenAI HTTP path, with text arriving as an LLM writes it.

Each utterance (a few sentences) is streamed over ``multi-stream-input`` one word at a time at
``--paces`` (milliseconds per word: 30 is an LLM at full speed, 200 a slow one). Measured per
utterance, as a listener who starts playing at the first audio hears it:

- first audio after the first word was sent;
- first audio after the first sentence's last word was sent (the gateway waits for the next
  word to know the sentence has ended, so one word's pace is part of it);
- stalls: the playback buffer running dry before the last audio (count and seconds).

The HTTP baseline is what a client of ``POST /v1/audio/speech`` does with the same LLM: each
sentence is sent whole as soon as its last word has arrived (streamed pcm), sentences in
parallel as they come, played in order; the same three figures. ``--levels`` runs that many
sockets (and HTTP clients) at once. Writes NAME.json and NAME.md into ``--out`` (``--name``,
default ``text-stream``).

    python -m benchmarks.text_stream --out var/bench --levels 1,4
    python -m benchmarks.text_stream --gateway-url http://HOST:8080 --voice alloy --levels 1,4,16
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import websockets

from benchmarks.bench_stack import GatewayServer
from benchmarks.bench_stats import percentiles_ms

UTTERANCES = (
    "Thanks for calling. Your order shipped this morning and should arrive on Thursday. "
    "Is there anything else I can help you with today?",
    "The weather will be sunny with a light breeze. Later in the evening, expect some clouds. "
    "Tomorrow looks much the same.",
)
PCM_RATE = 24_000
_STALL_MIN = 0.02  # a gap shorter than this is not heard as a stall


@dataclass
class Playback:
    """When audio arrived, and what a listener who starts at the first audio hears."""

    started: float
    first_sentence_end: float
    arrivals: list[tuple[float, float]] = field(default_factory=list)  # (arrival, seconds of audio)

    def add(self, seconds: float) -> None:
        self.arrivals.append((time.perf_counter(), seconds))

    def figures(self) -> dict[str, float]:
        if not self.arrivals:
            raise RuntimeError("no audio arrived")
        first = self.arrivals[0][0]
        clock = first
        stalls = 0
        stalled = 0.0
        for arrival, seconds in self.arrivals:
            if arrival - clock > _STALL_MIN:
                stalls += 1
                stalled += arrival - clock
            clock = max(clock, arrival) + seconds
        return {
            "first_audio_after_first_text": first - self.started,
            "first_audio_after_sentence_end": first - self.first_sentence_end,
            "stalls": stalls,
            "stalled_s": stalled,
            "audio_s": sum(seconds for _, seconds in self.arrivals),
        }


def words_of(text: str) -> list[str]:
    words = text.split(" ")
    return [words[0], *(f" {word}" for word in words[1:])]


async def over_websocket(url: str, text: str, pace: float, voice: str, context: str) -> dict[str, float]:
    query = f"model_id=eleven_flash_v2_5&output_format=pcm_{PCM_RATE}"
    ws_url = url.replace("http://", "ws://") + f"/v1/text-to-speech/{voice}/multi-stream-input?{query}"
    async with websockets.connect(ws_url, max_size=16 * 2**20) as ws:
        await ws.send(json.dumps({"text": " ", "context_id": context}))
        playback = Playback(started=0.0, first_sentence_end=0.0)

        async def write() -> None:
            sentence_ended = False
            playback.started = time.perf_counter()
            for word in words_of(text):
                await ws.send(json.dumps({"text": word, "context_id": context}))
                if not sentence_ended and word.rstrip().endswith((".", "?", "!")):
                    playback.first_sentence_end = time.perf_counter()
                    sentence_ended = True
                await asyncio.sleep(pace)
            await ws.send(json.dumps({"text": "", "context_id": context, "flush": True}))
            await ws.send(json.dumps({"context_id": context, "close_context": True}))

        writer = asyncio.create_task(write())
        async for raw in ws:
            message = json.loads(raw)
            if message.get("error"):
                raise RuntimeError(message["message"])
            if message.get("audio"):
                playback.add(len(base64.b64decode(message["audio"])) / 2 / PCM_RATE)
            if message.get("isFinal"):
                break
        await writer
    return playback.figures()


async def over_http(client: httpx.AsyncClient, url: str, text: str, pace: float, voice: str) -> dict[str, float]:
    """Sentences posted whole as the LLM completes them; their audio played in order."""
    sentences: list[str] = []
    current = ""
    for word in words_of(text):
        current += word
        if word.rstrip().endswith((".", "?", "!")):
            sentences.append(current.strip())
            current = ""
    if current.strip():
        sentences.append(current.strip())
    started = time.perf_counter()
    queues: list[asyncio.Queue[bytes | None]] = [asyncio.Queue() for _ in sentences]
    ends: list[float] = []

    async def speak(sentence: str, queue: asyncio.Queue[bytes | None]) -> None:
        body = {"model": "tts-1", "voice": voice, "input": sentence, "response_format": "pcm"}
        async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
            response.raise_for_status()
            async for data in response.aiter_bytes():
                await queue.put(data)
        await queue.put(None)

    async def write() -> list[asyncio.Task[None]]:
        tasks = []
        for sentence, queue in zip(sentences, queues, strict=True):
            await asyncio.sleep(pace * len(sentence.split(" ")))
            ends.append(time.perf_counter())
            tasks.append(asyncio.create_task(speak(sentence, queue)))
        return tasks

    writer = asyncio.create_task(write())
    playback = Playback(started=started, first_sentence_end=0.0)
    for queue in queues:
        while (data := await queue.get()) is not None:
            playback.add(len(data) / 2 / PCM_RATE)
    tasks = await writer
    await asyncio.gather(*tasks)
    playback.first_sentence_end = ends[0]
    return playback.figures()


def summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "runs": len(runs),
        "first_audio_after_first_text_ms": percentiles_ms([r["first_audio_after_first_text"] for r in runs]),
        "first_audio_after_sentence_end_ms": percentiles_ms([r["first_audio_after_sentence_end"] for r in runs]),
        "stalls_per_utterance": round(sum(r["stalls"] for r in runs) / len(runs), 2),
        "stalled_s_per_utterance": round(sum(r["stalled_s"] for r in runs) / len(runs), 3),
        "audio_s_per_utterance": round(sum(r["audio_s"] for r in runs) / len(runs), 2),
    }


async def level(url: str, sockets: int, pace: float, rounds: int, voice: str) -> dict[str, Any]:
    async def one_socket(index: int) -> list[dict[str, float]]:
        runs = []
        for round_ in range(rounds):
            text = UTTERANCES[(index + round_) % len(UTTERANCES)]
            runs.append(await over_websocket(url, text, pace, voice, f"s{index}r{round_}"))
        return runs

    async def one_http(client: httpx.AsyncClient, index: int) -> list[dict[str, float]]:
        runs = []
        for round_ in range(rounds):
            runs.append(await over_http(client, url, UTTERANCES[(index + round_) % len(UTTERANCES)], pace, voice))
        return runs

    ws_runs = [run for runs in await asyncio.gather(*(one_socket(i) for i in range(sockets))) for run in runs]
    async with httpx.AsyncClient(timeout=120) as client:
        http_runs = [
            run for runs in await asyncio.gather(*(one_http(client, i) for i in range(sockets))) for run in runs
        ]
    return {
        "sockets": sockets,
        "pace_ms": round(pace * 1000),
        "websocket": summary(ws_runs),
        "http": summary(http_runs),
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Text streaming: {report['name']}",
        "",
        f"Gateway: {report['gateway']}; voice {report['voice']}; {report['rounds']} utterances per socket and level; "
        f"host {report['host']}.",
        "",
        "First audio after the first word, after the first sentence's last word (p50 / p90 ms), and stalls a "
        "listener hears (per utterance), over the WebSocket (`ws`) and the OpenAI HTTP path fed whole "
        "sentences (`http`).",
        "",
        "| pace ms/word | sockets | path | first text → audio | sentence end → audio | stalls | stalled s |",
        "|---:|---:|---|---|---|---:|---:|",
    ]
    for row in report["levels"]:
        for path in ("websocket", "http"):
            figures = row[path]
            first = figures["first_audio_after_first_text_ms"]
            end = figures["first_audio_after_sentence_end_ms"]
            lines.append(
                f"| {row['pace_ms']} | {row['sockets']} | {'ws' if path == 'websocket' else 'http'} "
                f"| {first['p50']:.0f} / {first['p90']:.0f} | {end['p50']:.0f} / {end['p90']:.0f} "
                f"| {figures['stalls_per_utterance']} | {figures['stalled_s_per_utterance']} |"
            )
    return "\n".join(lines) + "\n"


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    levels = []
    for pace in args.paces:
        for sockets in args.levels:
            levels.append(await level(url, sockets, pace / 1000, args.rounds, args.voice))
            print(json.dumps(levels[-1]), flush=True)
    return {
        "name": args.name,
        "gateway": args.gateway_url or "started here (embedded CPU default)",
        "voice": args.voice,
        "rounds": args.rounds,
        "host": f"{platform.node()} {platform.machine()}",
        "utterances": list(UTTERANCES),
        "levels": levels,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("var/bench"), help="where NAME.json/.md go")
    parser.add_argument("--name", default="text-stream", help="file stem of the report")
    parser.add_argument("--levels", default="1,4", help="sockets at once, comma-separated (default: 1,4)")
    parser.add_argument("--paces", default="30,200", help="ms between words, comma-separated (default: 30,200)")
    parser.add_argument("--rounds", type=int, default=3, help="utterances per socket and level (default: 3)")
    parser.add_argument("--voice", default="joe", help="voice (default: joe, Piper's)")
    parser.add_argument("--gateway-url", help="use this gateway instead of starting one on the embedded CPU default")
    args = parser.parse_args()
    args.levels = [int(value) for value in args.levels.split(",")]
    args.paces = [float(value) for value in args.paces.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.gateway_url:
        report = asyncio.run(run(args, args.gateway_url.rstrip("/")))
    else:
        with GatewayServer((args.out / f"{args.name}-stack").resolve(), {}) as gateway:
            report = asyncio.run(run(args, gateway.url))
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
