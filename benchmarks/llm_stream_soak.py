"""Soak test of the orchestrator's LLM stream on a real Triton: decoupled BLS (the old way) against gRPC (llm_grpc.py).

A scripted LLM model sends tokens the way ``llm_torch`` does (one engine thread, responses on
outbox lanes, cancellation watched), and an orchestrator model runs ``--threads`` threads that each
open ``--per-round`` streams one after another (a fifth of them left after three responses). With
``--transport bls`` the orchestrator reads them as decoupled BLS streams, as it did before
``llm_grpc.py``; with ``grpc`` through :class:`~tts_gateway.models.cosyvoice2.orchestrator.llm_grpc.TritonLLMStreams`.
A round that does not finish within ``--round-timeout-s`` is a hang: the native stacks of the server
and its stubs are written next to the report (``gdb``, where installed) and the run stops.

    python -m benchmarks.llm_stream_soak --transport bls --out /tmp/soak-bls
    python -m benchmarks.llm_stream_soak --transport grpc --out /tmp/soak-grpc

No GPU: the models are CPU-only scripts; the stub's locking is what is under test.
"""

from __future__ import annotations

import argparse
import json
import queue
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from tests.e2e.gateway_process import cmdline, model_processes, tritonserver_pid
from tests.fixtures.scripted_llm import LLM_CONFIG
from tts_gateway.gateway.embedded.server import EmbeddedTriton

ROOT = Path(__file__).resolve().parents[1]

LLM_MODEL = """
import threading
import time

import triton_python_backend_utils as pb_utils

from tts_gateway.models.cosyvoice2 import tensors
from tts_gateway.models.cosyvoice2.stage_models.llm_responses import CancellationWatch, Outbox, TokenStream


class _Handle:
    cancelled = False

    def cancel(self):
        self.cancelled = True


class TritonPythonModel:
    def initialize(self, args):
        self.outbox = Outbox("llm")
        self.watch = CancellationWatch("llm")
        self.lock = threading.Lock()
        self.active = []
        threading.Thread(target=self._engine, daemon=True).start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            count = int(pb_utils.get_input_tensor_by_name(request, "request_output_len").as_numpy().reshape(-1)[0])
            handle, lane = _Handle(), self.outbox.next_lane()
            stream = TokenStream(self.outbox, lane, lambda ids, s=sender: s.send(_response(ids)))
            self.watch.watch(handle, request.is_cancelled)
            with self.lock:
                self.active.append([handle, stream, count, lane, sender])

    def _engine(self):
        while True:
            time.sleep(0.002)  # a decode step
            with self.lock:
                running = []
                for item in self.active:
                    handle, stream, left, lane, sender = item
                    if handle.cancelled or left == 0:
                        self.outbox.put(lane, lambda h=handle, s=sender: self._final(h, s))
                        continue
                    stream.push(6561 + left)
                    item[2] = left - 1
                    running.append(item)
                self.active = running

    def _final(self, handle, sender):
        self.watch.forget(handle)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _response(ids):
    return pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in tensors.llm_outputs(ids).items()])
"""

ORCHESTRATOR_MODEL = """
import random
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from tts_gateway.models.cosyvoice2 import tensors
from tts_gateway.models.cosyvoice2.orchestrator.llm_grpc import TritonLLMStreams, own_grpc_url
from tts_gateway.models.cosyvoice2.orchestrator.pipeline import LLMRequest


def _bls_stream(request, kept):
    # As TritonStages read the LLM before llm_grpc.py, which kept each stream until the stub let go of it.
    inference = pb_utils.InferenceRequest(
        model_name="llm",
        inputs=[pb_utils.Tensor(k, v) for k, v in tensors.llm_inputs(request).items()],
        requested_output_names=list(tensors.LLM_OUTPUT_DTYPES),
    )
    responses = inference.exec(decoupled=True)
    kept.append(responses)
    for response in responses:
        if response.has_error():
            raise RuntimeError(response.error().message())
        yield [0]


class TritonPythonModel:
    def initialize(self, args):
        self.grpc = TritonLLMStreams(own_grpc_url(), "llm")

    def execute(self, requests):
        for request in requests:
            threads, per_thread, grpc = (int(v) for v in pb_utils.get_input_tensor_by_name(request, "round").as_numpy())
            sender = request.get_response_sender()
            threading.Thread(target=self._round, args=(sender, threads, per_thread, grpc), daemon=True).start()

    def _round(self, sender, threads, per_thread, grpc):
        done = []

        def work(seed):
            rng = random.Random(seed)
            kept = []
            for index in range(per_thread):
                request = LLMRequest(
                    input_ids=[1, 2, 3], max_new_tokens=rng.randint(5, 40), min_new_tokens=0, end_id=None,
                    temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, seed=None, streaming=True,
                    request_id=f"{seed}-{index}",
                )
                stream = self.grpc.generate(request, lambda: False) if grpc else _bls_stream(request, kept)
                leave_after = 3 if rng.random() < 0.2 else None
                for count, _ in enumerate(stream, start=1):
                    if count == leave_after:
                        break
                stream.close()
            done.append(seed)

        workers = [threading.Thread(target=work, args=(seed,)) for seed in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        out = np.array([len(done) * per_thread], dtype=np.int64)
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("streams", out)]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

ORCHESTRATOR_CONFIG = """backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "round", data_type: TYPE_INT32, dims: [ 3 ] } ]
output [ { name: "streams", data_type: TYPE_INT64, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


def _repository(root: Path) -> Path:
    repository = root / "repository"
    for name, code, config in (
        ("llm", LLM_MODEL, LLM_CONFIG),
        ("orchestrator", ORCHESTRATOR_MODEL, ORCHESTRATOR_CONFIG),
    ):
        (repository / name / "1").mkdir(parents=True, exist_ok=True)
        (repository / name / "1" / "model.py").write_text(code, encoding="utf-8")
        (repository / name / "config.pbtxt").write_text(config, encoding="utf-8")
    return repository


def _round(server: EmbeddedTriton, threads: int, per_thread: int, grpc: bool, timeout_s: float) -> int | None:
    """Streams completed in one round, or None when the round hung."""
    answers: queue.SimpleQueue[tuple[object, object]] = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        asked = grpcclient.InferInput("round", [3], "INT32")
        asked.set_data_from_numpy(np.array([threads, per_thread, int(grpc)], dtype=np.int32))
        client.async_stream_infer("orchestrator", [asked])
        try:
            result, error = answers.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if error is not None:
            raise RuntimeError(f"the orchestrator failed: {error}")
        return int(result.as_numpy("streams")[0])  # type: ignore[attr-defined]
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def _native_stacks(workdir: Path, out: Path) -> list[str]:
    if shutil.which("gdb") is None:
        return []
    written = []
    for pid in [tritonserver_pid(workdir), *model_processes(workdir)]:
        trace = subprocess.run(
            ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"], capture_output=True, text=True, timeout=300
        ).stdout
        path = out / f"stacks-{pid}.txt"
        path.write_text(cmdline(pid).replace(b"\0", b" ").decode(errors="replace") + "\n\n" + trace, encoding="utf-8")
        written.append(path.name)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transport", choices=("bls", "grpc"), required=True)
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--per-round", type=int, default=100, help="streams per thread and round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--round-timeout-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = args.out / "work"
    server = EmbeddedTriton(_repository(workdir), workdir=workdir)
    server.start()
    rounds: list[dict[str, float | int]] = []
    hung = failed = False
    stacks: list[str] = []
    try:
        for index in range(args.rounds):
            started = time.monotonic()
            streams = _round(server, args.threads, args.per_round, args.transport == "grpc", args.round_timeout_s)
            if streams is None:
                hung = True
                stacks = _native_stacks(workdir, args.out)
                print(f"round {index}: no answer in {args.round_timeout_s:.0f} s: hung", flush=True)
                break
            rounds.append({"round": index, "streams": streams, "seconds": round(time.monotonic() - started, 1)})
            print(f"round {index}: {streams} streams in {rounds[-1]['seconds']} s", flush=True)
            if streams < args.threads * args.per_round:
                failed = True
                print(f"round {index}: a thread failed (its traceback is in {server.log_path})", flush=True)
                break
    finally:
        server.stop(grace=5.0)
    report = {
        "transport": args.transport,
        "threads": args.threads,
        "streams_per_thread_and_round": args.per_round,
        "rounds_completed": len(rounds),
        "streams_completed": sum(int(r["streams"]) for r in rounds),
        "hung": hung,
        "failed": failed,
        "stack_files": stacks,
        "rounds": rounds,
    }
    (args.out / "llm_stream_soak.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    verdict = "hung" if hung else "a thread failed" if failed else "no hang"
    print(f"{args.transport}: {report['streams_completed']} streams in {len(rounds)} rounds, {verdict}", flush=True)
    return 1 if hung or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
