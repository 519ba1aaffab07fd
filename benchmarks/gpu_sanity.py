"""GPU sanity run of the ``gpu-torch`` profile: CosyVoice2 on CUDA behind a real Triton, tiny random weights.

Writes the tiny checkpoint, renders the profile over it with one instance per model, starts
the embedded tritonserver and sends offline and streaming requests with two reference voices
over gRPC, twice (the first round pays CUDA's lazy start-up). With random weights the audio is
noise, so the checks are structural: float32 at 24 kHz in whole tokens of 960 samples, finite
and not silent, the first stream chunk's size, a stream as long as the offline call with the
same seed. It reports first-chunk latency and total times, and which model processes hold
CUDA memory (nvidia-smi), and exits non-zero on any failure. A sanity proof, not a benchmark.

    python -m benchmarks.gpu_sanity --workdir /tmp/gpu_sanity
    python -m benchmarks.gpu_sanity --cpu   # rehearsal without a GPU: same dtypes, devices on the CPU

The model processes (nvidia-pytriton 0.7.0's Python backend stub) need numpy<2 and ignore
PYTHONPATH: the project must be installed in the interpreter's environment (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soxr
import tritonclient.grpc as grpcclient
from numpy.typing import NDArray
from transformers import AutoTokenizer
from tritonclient.utils import InferenceServerException

from benchmarks.gpu_query import cuda_mib_by_pid, nvidia_smi, used_mib_by_gpu
from tts_gateway.gateway.embedded.server import EmbeddedTriton, EmbeddedTritonError
from tts_gateway.models import contract
from tts_gateway.models.cosyvoice2.checkpoints.tiny_checkpoint import write_tiny_checkpoint
from tts_gateway.models.cosyvoice2.orchestrator.first_hop import AdaptiveFirstHop
from tts_gateway.models.triton_logging import STACK_DUMP_SIGNAL
from tts_gateway.paths import REFERENCE_VOICES
from tts_gateway.tools import model_prep

ROOT = Path(__file__).resolve().parents[1]

MODEL = "cosyvoice2"
SAMPLE_RATE = 24_000
SAMPLES_PER_TOKEN = 960  # 2 mel frames of 480 samples
CROSS_FADE_SAMPLES = 8 * 480  # the first chunk's tail withheld for the cross-fade with the second
TEXT = "The quick brown fox jumps over the lazy dog near the river bank today."
VOICES = ("harbor", "lumen")
# One instance of everything: a sanity run needs no parallelism and loads faster.
SINGLE_INSTANCES = (
    "cosyvoice2.instance_count=1",
    "cosyvoice2_stream.instance_count=1",
    "audio_tokenizer.instance_count=1",
    "speaker_embedding.instance_count=1",
    "llm.instance_count=1",
)
CPU_DEVICES = ("token2wav.device=cpu", "token2wav.instance_kind=KIND_CPU", "llm.device=cpu")
GPU_MODELS = ("llm", "token2wav")
REQUEST_TIMEOUT_S = 60.0  # per call, and per chunk of a stream


class SanityError(AssertionError):
    """A check of the run failed."""


@dataclass(frozen=True)
class Voice:
    name: str
    wav: NDArray[np.float32]
    text: str


@dataclass(frozen=True)
class Timed:
    audio: NDArray[np.float32]
    first_s: float
    total_s: float
    chunks: list[int]


def load_voice(name: str) -> Voice:
    """A reference recording (16-bit PCM WAV) as 6 s of 16 kHz float32, with its transcript."""
    with wave.open(str(REFERENCE_VOICES / f"{name}.wav"), "rb") as wav:
        if wav.getsampwidth() != 2:
            raise SanityError(f"{name}.wav is not 16-bit PCM")
        frames = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2").reshape(-1, wav.getnchannels())
        rate = wav.getframerate()
    mono = frames.astype(np.float32).mean(axis=1) / 32768.0
    resampled = soxr.resample(mono, rate, contract.REFERENCE_SAMPLE_RATE).astype(np.float32)
    text = (REFERENCE_VOICES / f"{name}.txt").read_text(encoding="utf-8").strip()
    return Voice(name, resampled[: 6 * contract.REFERENCE_SAMPLE_RATE], text)


def request_inputs(voice: Voice, seed: int) -> list[grpcclient.InferInput]:
    arrays: dict[str, NDArray[np.generic]] = {
        contract.TARGET_TEXT: np.array([TEXT.encode()], dtype=np.object_),
        contract.REFERENCE_WAV: voice.wav,
        contract.REFERENCE_WAV_LEN: np.array([voice.wav.size], dtype=np.int32),
        contract.REFERENCE_TEXT: np.array([voice.text.encode()], dtype=np.object_),
        contract.SEED: np.array([seed], dtype=np.int64),
    }
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), contract.INPUT_DTYPES[name])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def offline(url: str, voice: Voice, seed: int) -> Timed:
    client = grpcclient.InferenceServerClient(url)
    try:
        started = time.perf_counter()
        result = client.infer(MODEL, request_inputs(voice, seed), client_timeout=REQUEST_TIMEOUT_S)
        total = time.perf_counter() - started
    finally:
        client.close()
    audio = result.as_numpy(contract.WAVEFORM)
    if audio is None:
        raise SanityError("offline response has no waveform")
    return Timed(audio, total, total, [audio.size])


def stream(url: str, voice: Voice, seed: int) -> Timed:
    """One decoupled request; chunk arrival times are taken in the gRPC callback."""
    arrivals: queue.Queue[tuple[float, NDArray[np.float32] | InferenceServerException | None]] = queue.Queue()

    def on_response(result: grpcclient.InferResult | None, error: InferenceServerException | None) -> None:
        now = time.perf_counter()
        if error is not None:
            arrivals.put((now, error))
        elif result is None or result.get_response().parameters["triton_final_response"].bool_param:
            arrivals.put((now, None))
        else:
            arrivals.put((now, result.as_numpy(contract.WAVEFORM)))

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=on_response)
    chunks: list[NDArray[np.float32]] = []
    try:
        started = time.perf_counter()
        client.async_stream_infer(
            contract.stream_model_name(MODEL), request_inputs(voice, seed), enable_empty_final_response=True
        )
        first = 0.0
        while True:
            at, item = arrivals.get(timeout=REQUEST_TIMEOUT_S)
            if isinstance(item, InferenceServerException):
                raise SanityError(f"stream failed: {item}")
            if item is None:
                total = at - started
                break
            if item.size:
                first = first or at - started
                chunks.append(item)
    finally:
        client.stop_stream()
        client.close()
    if not chunks:
        raise SanityError("stream returned no audio")
    return Timed(np.concatenate(chunks), first, total, [chunk.size for chunk in chunks])


def config_parameters(url: str, model: str) -> dict[str, str]:
    """A served model's config parameters."""
    client = grpcclient.InferenceServerClient(url)
    try:
        config = client.get_model_config(model, as_json=True)["config"]
        return {key: value.get("string_value", "") for key, value in config["parameters"].items()}
    finally:
        client.close()


def first_chunk_samples(url: str) -> list[int]:
    """The sizes a stream's first chunk can have on the served streaming model: each first hop it may take (it
    grows under load up to ``max_first_hop_tokens``), less the cross-fade tail."""
    params = config_parameters(url, contract.stream_model_name(MODEL))
    first, most = int(params["first_hop_tokens"]), int(params["max_first_hop_tokens"])
    return [hop * SAMPLES_PER_TOKEN - CROSS_FADE_SAMPLES for hop in AdaptiveFirstHop(first, max(first, most)).ladder]


def check_audio(label: str, timed: Timed, token_bounds: tuple[int, int], first_chunks: list[int]) -> None:
    audio = timed.audio
    if audio.dtype != np.float32 or audio.ndim != 1:
        raise SanityError(f"{label}: expected 1-D float32, got {audio.dtype} {audio.shape}")
    if audio.size % SAMPLES_PER_TOKEN:
        raise SanityError(f"{label}: {audio.size} samples is not a whole number of {SAMPLES_PER_TOKEN}-sample tokens")
    tokens = audio.size // SAMPLES_PER_TOKEN
    if not token_bounds[0] <= tokens <= token_bounds[1]:
        raise SanityError(f"{label}: {tokens} tokens outside the expected {token_bounds}")
    if not np.isfinite(audio).all():
        raise SanityError(f"{label}: waveform holds NaN or inf")
    if float(np.std(audio)) == 0.0:
        raise SanityError(f"{label}: waveform is constant")
    if len(timed.chunks) > 1 and timed.chunks[0] not in first_chunks:
        raise SanityError(f"{label}: first chunk has {timed.chunks[0]} samples, expected one of {first_chunks}")


def describe(label: str, timed: Timed) -> str:
    samples = timed.audio.size
    seconds = samples / SAMPLE_RATE
    line = (
        f"{label}: {samples} samples = {samples // SAMPLES_PER_TOKEN} tokens = {seconds:.2f} s audio, "
        f"first audio {timed.first_s * 1000:.0f} ms, total {timed.total_s * 1000:.0f} ms "
        f"(RTF {timed.total_s / seconds:.3f}), peak |x| {float(np.abs(timed.audio).max()):.3f}"
    )
    if len(timed.chunks) > 1:
        line += f", {len(timed.chunks)} chunks {timed.chunks}"
    return line


def model_processes(repository: Path) -> dict[int, str]:
    """Process id -> deployed model, for every Python backend stub serving ``repository``.

    Each stub's command line holds its model's path, ``<repository>/<model>/1/model.py``.
    """
    names = [d.name for d in repository.iterdir() if d.is_dir()]
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "triton_python_backend_stub" not in command:
            continue
        for name in names:
            if f"{repository / name}/" in command:
                found[int(proc.name)] = name
    return found


def dump_stub_stacks(repository: Path, settle_s: float = 2.0) -> None:
    """Have every model stub of ``repository`` write its threads' Python stacks to the server's log
    (``tts_gateway.models.triton_logging.enable_stack_dumps``), and give them ``settle_s`` to do so."""
    stubs = model_processes(repository)
    for pid in stubs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STACK_DUMP_SIGNAL)
    if stubs:
        print(f"asked {len(stubs)} model stubs to write their threads' stacks to the server's log", flush=True)
        time.sleep(settle_s)


def gpu_memory_used() -> int:
    """MiB in use on GPU 0."""
    return used_mib_by_gpu()[0]


def cuda_memory_by_model(repository: Path, server_pid: int | None) -> dict[str, int]:
    """MiB of CUDA memory each model's stub process (and the server) holds, from nvidia-smi."""
    stubs = model_processes(repository)
    if server_pid is not None:
        stubs[server_pid] = "tritonserver"
    held: dict[str, int] = {}
    for pid, memory in cuda_mib_by_pid().items():
        name = stubs.get(pid, f"pid {pid} (not a stub)")
        held[name] = held.get(name, 0) + memory
    return held


def instance_lines(log: Path) -> list[str]:
    """Triton's lines naming where each model instance was created (CPU or GPU device N)."""
    text = log.read_text(encoding="utf-8", errors="replace")
    return [line for line in text.splitlines() if "TRITONBACKEND_ModelInstanceInitialize" in line]


def print_server_errors(log: Path, limit: int = 80) -> None:
    """The server log's error lines and tracebacks (the models log their failures there)."""
    if not log.is_file():
        return
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    wanted = [line for line in lines if line.startswith("E") or line.startswith((" ", "Traceback")) or "Error" in line]
    print(f"--- {len(wanted)} error lines of {log}, the last {limit}:")
    for line in wanted[-limit:]:
        print(line)
    print("---")


def execution_stats(url: str) -> list[str]:
    client = grpcclient.InferenceServerClient(url)
    try:
        stats = client.get_inference_statistics(as_json=True)["model_stats"]
    finally:
        client.close()
    lines = []
    for model in stats:
        success = model["inference_stats"]["success"]
        count = int(success.get("count", 0))
        compute = model["inference_stats"].get("compute_infer", {})
        mean_ms = int(compute.get("ns", 0)) / max(count, 1) / 1e6
        lines.append(f"{model['name']}: {count} requests, mean compute {mean_ms:.1f} ms")
    return lines


def check_cuda(repository: Path, idle_mib: int, server_pid: int | None) -> None:
    """The LLM and token2wav processes hold CUDA memory (or, where nvidia-smi names no process, the GPU does)."""
    print(f"GPU: {', '.join(nvidia_smi('gpu=name,driver_version,memory.used,memory.total')[0])} (MiB)")
    used = gpu_memory_used()
    print(f"GPU memory in use: {idle_mib} MiB before tritonserver, {used} MiB now")
    held = cuda_memory_by_model(repository, server_pid)
    print(f"CUDA memory by model process (MiB): {held}")
    if held:
        missing = [name for name in GPU_MODELS if held.get(name, 0) <= 0]
        if missing:
            raise SanityError(f"models without CUDA memory: {missing}")
    elif used <= idle_mib:
        raise SanityError("no process holds CUDA memory and GPU memory use did not grow")
    else:
        print("nvidia-smi names no compute process here; GPU memory use grew while the models served")


def run(workdir: Path, profile: str, overrides: list[str], *, cpu: bool, startup_timeout: float) -> None:
    started = time.perf_counter()
    tiny = write_tiny_checkpoint(workdir / "models")
    repository = workdir / "repository"
    sets = [*SINGLE_INSTANCES, *(CPU_DEVICES if cpu else ()), *overrides]
    args = ["render", "--profile", profile, "--dest", str(repository), "--models-root", str(workdir / "models")]
    if model_prep.main([*args, *(item for value in sets for item in ("--set", value))]) != 0:
        raise SanityError("rendering the repository failed")
    print(f"tiny checkpoint and {profile} repository ready in {time.perf_counter() - started:.1f} s ({workdir})")
    for name in GPU_MODELS:
        params = (repository / name / "config.pbtxt").read_text(encoding="utf-8")
        wanted = [line.strip() for line in params.splitlines() if '"device"' in line or '"dtype"' in line]
        print(f"  {name}: {' '.join(wanted)}")

    voices = [load_voice(name) for name in VOICES]
    text_tokens = len(AutoTokenizer.from_pretrained(tiny.llm_dir).encode(TEXT))
    bounds = (2 * text_tokens, 20 * text_tokens)

    idle_mib = 0 if cpu else gpu_memory_used()
    triton = EmbeddedTriton(repository, workdir=workdir, startup_timeout=startup_timeout)
    loading = time.perf_counter()
    triton.start()
    try:
        print(f"tritonserver ready in {time.perf_counter() - loading:.1f} s (log: {triton.log_path})")
        for line in instance_lines(triton.log_path):
            print(f"  {line.split('] ', 1)[-1]}")
        print("  (Triton calls llm a CPU instance: its torch device is the 'device' parameter above)")
        url = triton.grpc_url
        first_chunks = first_chunk_samples(url)
        results: dict[tuple[str, str, int], Timed] = {}
        failures: list[str] = []
        # Each round runs both voices, one offline and one streamed; the warm round swaps them,
        # so every voice and seed is heard both ways. A failed request is reported and the run
        # goes on: offline and streaming are served by different model processes.
        for round_name, (off_voice, off_seed), (str_voice, str_seed) in (
            ("cold", (voices[0], 1), (voices[1], 2)),
            ("warm", (voices[1], 2), (voices[0], 1)),
        ):
            for mode, voice, seed, call in (
                ("offline", off_voice, off_seed, offline),
                ("stream", str_voice, str_seed, stream),
            ):
                label = f"{round_name} {mode:7} {voice.name} seed {seed}"
                try:
                    timed = call(url, voice, seed)
                    check_audio(label, timed, bounds, first_chunks)
                except (SanityError, InferenceServerException, queue.Empty) as exc:
                    failures.append(f"{label}: {type(exc).__name__}: {exc}")
                    print(f"{label}: FAILED: {exc}")
                    continue
                print(describe(label, timed))
                results[(mode, voice.name, seed)] = timed
        for voice, seed in ((voices[0], 1), (voices[1], 2)):
            solo, streamed = results.get(("offline", voice.name, seed)), results.get(("stream", voice.name, seed))
            # Seeded generation yields the same tokens streamed or not: the same amount of audio.
            if solo is not None and streamed is not None:
                same = solo.audio.size == streamed.audio.size
                print(f"{voice.name} seed {seed}: offline and stream lengths {'match' if same else 'DIFFER'}")
                if not same:
                    failures.append(
                        f"{voice.name} seed {seed}: offline {solo.audio.size}, stream {streamed.audio.size}"
                    )
        for line in execution_stats(url):
            print(f"  {line}")
        stubs = model_processes(repository)
        print(f"model stub processes: {dict(sorted(stubs.items()))}")
        if not cpu:
            check_cuda(repository, idle_mib, triton.pid)
        if failures:
            raise SanityError(f"{len(failures)} failed: " + "; ".join(failures))
    finally:
        triton.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="gpu-torch")
    parser.add_argument("--workdir", type=Path, default=None, help="kept afterwards; default: a temporary folder")
    parser.add_argument("--cpu", action="store_true", help="move every device to the CPU (no GPU check)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for every model to load")
    parser.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE", help="extra overrides")
    args = parser.parse_args()
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="gpu_sanity_"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        run(workdir, args.profile, args.set, cpu=args.cpu, startup_timeout=args.startup_timeout)
    except (
        SanityError,
        EmbeddedTritonError,
        InferenceServerException,
        queue.Empty,
        OSError,
        subprocess.SubprocessError,
    ) as exc:
        if not isinstance(exc, EmbeddedTritonError):  # that one already carries the log's errors
            print_server_errors(workdir / "tritonserver.log")
        print(f"FAIL: {type(exc).__name__}: {exc}")
        return 1
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
