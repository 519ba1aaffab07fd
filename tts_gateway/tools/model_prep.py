"""CosyVoice2 model operations: download, random checkpoints (tiny, full size), TensorRT-LLM engine, render, launch.

    tts-models download --models-root /models
    tts-models tiny --models-root var/tiny
    tts-models random-full --models-root var/random-full
    tts-models build-engine --models-root /models
    tts-models render --profile cosyvoice2-cpu --dest var/repo --models-root var/tiny
    tts-models launch --profile gpu-trtllm --repo /models/repo --prepare

Every model directory lives under one root (``--models-root``): ``CosyVoice2-0.5B/`` (ModelScope
``iic/CosyVoice2-0.5B``), ``cosyvoice2_llm/`` (Hugging Face ``yuekai/cosyvoice2_llm``) and
``engines/``. Profiles name paths under ``/models``; ``--models-root`` moves them elsewhere.
Every step is idempotent, so a container runs ``launch --prepare`` at each start. ``launch``
execs the ``tritonserver`` on ``PATH`` (the NGC Triton image's); where there is none, it runs
the nvidia-pytriton wheel's server, which has the Python backend only (not TensorRT-LLM).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import httpx

from tts_gateway.allocator import server_malloc_env
from tts_gateway.gateway.embedded.cuda_mps import CudaMps, CudaMpsError
from tts_gateway.gateway.embedded.server import SERVER_MEMORY_OPTIONS, EmbeddedTriton, EmbeddedTritonError
from tts_gateway.models import contract
from tts_gateway.models.model_repository import (
    PROFILE_ROOT,
    TEMPLATE_NAME,
    Profile,
    TemplateError,
    deployment_overrides,
    load_profile,
    parse_overrides,
    render_repository,
)
from tts_gateway.paths import TRITON_REPOSITORY, invocation_path
from tts_gateway.tools import hub_download, trtllm_engine

COSYVOICE_DIR = "CosyVoice2-0.5B"
LLM_DIR = "cosyvoice2_llm"
MODELSCOPE_ID = "iic/CosyVoice2-0.5B"
HUGGINGFACE_ID = "yuekai/cosyvoice2_llm"
# What the pipeline loads from the ModelScope repository; the rest of it (the original
# llm.pt, ONNX flow exports, CosyVoice-BlankEN) is several GB that the LLM in HF
# format and the PyTorch flow make unnecessary.
COSYVOICE_FILES = ("cosyvoice2.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx")
TRT_LLM_SOURCE = "tensorrt_llm"
# The launched server's own MPS daemon (pipes and log), private to the container.
MPS_DIR = Path(tempfile.gettempdir()) / "tts-cuda-mps"
# The backends the nvidia-pytriton wheel's tritonserver ships.
WHEEL_BACKENDS = frozenset({"python"})
_BACKEND = re.compile(r'^backend:\s*"([^"]+)"', re.MULTILINE)
_WATCH_INTERVAL_S = 1.0


def fitted_overrides(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """The profile's overrides for this machine: ``--models-root``, ``--llm-urls`` and ``--set``."""
    profile = load_profile(args.source, args.profile)
    return deployment_overrides(
        profile, models_root=args.models_root, llm_urls=args.llm_urls, explicit=parse_overrides(args.set)
    )


def _progress(path: str, done: int, total: int) -> None:
    percent = 100 * done // total if total else 100
    sys.stderr.write(f"\r{path}: {done / 1e6:.1f}/{total / 1e6:.1f} MB ({percent}%)")
    if done >= total:
        sys.stderr.write("\n")


def download_models(root: Path, args: argparse.Namespace) -> None:
    with httpx.Client(timeout=httpx.Timeout(60.0, connect=20.0)) as client:
        listing = hub_download.modelscope_files(client, args.modelscope_id, args.modelscope_revision)
        cosy = hub_download.select(listing, COSYVOICE_FILES)
        fetched = hub_download.download_all(client, cosy, root / COSYVOICE_DIR, _progress)
        llm = hub_download.huggingface_files(client, args.hf_id, args.hf_revision)
        fetched += hub_download.download_all(client, llm, root / LLM_DIR, _progress)
    sys.stderr.write(f"{len(cosy) + len(llm)} files verified, {fetched} downloaded, under {root}\n")


def build_engine(hf_dir: Path, engine_dir: Path, settings: trtllm_engine.EngineSettings) -> None:
    wanted = trtllm_engine.BuildInfo(
        versions=trtllm_engine.toolchain_versions(),
        gpu=trtllm_engine.gpu_identity(),
        settings=settings,
        checkpoint=trtllm_engine.checkpoint_fingerprint(hf_dir),
    )
    built = trtllm_engine.ensure_engine(hf_dir, engine_dir, wanted, settings)
    sys.stderr.write(f"engine {'built' if built else 'up to date'}: {engine_dir}\n")


def _settings(args: argparse.Namespace) -> trtllm_engine.EngineSettings:
    return trtllm_engine.EngineSettings(args.dtype, args.max_batch_size, args.max_num_tokens)


def cmd_download(args: argparse.Namespace) -> None:
    download_models(args.models_root, args)


def cmd_tiny(args: argparse.Namespace) -> None:
    from tts_gateway.models.cosyvoice2.checkpoints.tiny_checkpoint import write_tiny_checkpoint

    write_tiny_checkpoint(args.models_root, seed=args.seed)
    sys.stderr.write(f"tiny checkpoint written under {args.models_root}\n")


def cmd_random_full(args: argparse.Namespace) -> None:
    from tts_gateway.models.cosyvoice2.checkpoints.random_checkpoint import ensure_checkpoint, full_size

    _, written = ensure_checkpoint(args.models_root, full_size(), seed=args.seed)
    state = "written" if written else "already complete"
    sys.stderr.write(f"full-size random checkpoint {state} under {args.models_root}\n")


def cmd_build_engine(args: argparse.Namespace) -> None:
    settings = _settings(args)
    hf_dir = args.models_root / LLM_DIR
    engine_dir = args.engine_dir or args.models_root / "engines" / f"{LLM_DIR}-{settings.dtype}"
    if not args.dry_run:
        build_engine(hf_dir, engine_dir, settings)
        return
    for command in trtllm_engine.build_plan(hf_dir, engine_dir, settings):
        sys.stdout.write(" ".join(command) + "\n")


def cmd_render(args: argparse.Namespace) -> None:
    overrides = fitted_overrides(args)
    names = render_repository(args.source, args.profile, args.dest, overrides)
    sys.stderr.write(f"rendered {args.profile} into {args.dest}: {', '.join(names)}\n")


def tritonserver_command(args: argparse.Namespace, server: str) -> list[str]:
    return [
        server,
        f"--model-repository={args.repo}",
        f"--http-port={args.http_port}",
        f"--grpc-port={args.grpc_port}",
        f"--metrics-port={args.metrics_port}",
        "--exit-on-error=true",
        *SERVER_MEMORY_OPTIONS,
    ]


def prepare(args: argparse.Namespace, overrides: dict[str, dict[str, str]]) -> None:
    """Download what is missing and build the engine the profile's TensorRT-LLM model names."""
    root = args.models_root or Path(PROFILE_ROOT)
    if args.verify or not (root / COSYVOICE_DIR).is_dir() or not (root / LLM_DIR).is_dir():
        download_models(root, args)
    for model in load_profile(args.source, args.profile).models:
        if model.source == TRT_LLM_SOURCE:
            engine_dir = overrides.get(model.name, {}).get("engine_dir", model.values["engine_dir"])
            build_engine(root / LLM_DIR, Path(engine_dir), _settings(args))


def cmd_launch(args: argparse.Namespace) -> None:
    profile = load_profile(args.source, args.profile)
    server = args.tritonserver or shutil.which("tritonserver")
    # Without a tritonserver of its own (the NGC image has one on PATH) the wheel's server runs it.
    wheel = server is None or _is_wheel_server(server)
    if wheel and not args.dry_run:
        _check_wheel_backends(args.source, profile)
    overrides = fitted_overrides(args)
    if args.prepare and not args.dry_run:
        prepare(args, overrides)
    names = render_repository(args.source, args.profile, args.repo, overrides)
    sys.stderr.write(f"rendered {args.profile} into {args.repo}: {', '.join(names)}\n")
    command = tritonserver_command(args, server or "tritonserver")
    # The orchestrator streams the LLM's tokens over this server's gRPC endpoint (llm_grpc.py); a value
    # already set (a proxy in front, another address) is kept.
    own_url = os.environ.setdefault(contract.OWN_GRPC_URL_ENV, f"127.0.0.1:{args.grpc_port}")
    # glibc's settings for the server's memory (tts_gateway.allocator), where the operator set none.
    allocator = server_malloc_env(os.environ)
    os.environ.update(allocator)
    if args.dry_run:
        assignments = {contract.OWN_GRPC_URL_ENV: own_url, **allocator}
        sys.stdout.write(" ".join([*(f"{name}={value}" for name, value in assignments.items()), *command]) + "\n")
        return
    mps = CudaMps.for_mode(args.cuda_mps, MPS_DIR, profile_asks=profile.cuda_mps)
    if wheel:
        serve_with_wheel(args, mps)
        return
    if shutil.which(command[0]) is None:
        raise SystemExit(f"{command[0]} not found; pass --tritonserver PATH")
    # The daemon forks and outlives this exec, and its directory's lock passes to the server; the container's
    # end takes both down.
    if mps is not None:
        try:
            mps.start()
        except CudaMpsError as exc:
            raise SystemExit(f"error: {exc}") from exc
        mps.keep_across_exec()
        os.environ.update(mps.env())
    os.execvp(command[0], command)


def _is_wheel_server(server: str) -> bool:
    """Whether ``server`` is the ``tritonserver`` inside the nvidia-pytriton package, which cannot run alone."""
    return "pytriton" in Path(server).resolve().parts


def _check_wheel_backends(source: Path, profile: Profile) -> None:
    """Refuse, before anything starts, a profile with a backend that the wheel's server lacks."""
    for model in profile.models:
        template = (source / model.source / TEMPLATE_NAME).read_text(encoding="utf-8")
        backend = _BACKEND.search(template)
        if backend is not None and backend.group(1) not in WHEEL_BACKENDS:
            raise SystemExit(
                f"profile {profile.name!r} deploys {model.name!r} on Triton's {backend.group(1)!r} backend, which"
                " the nvidia-pytriton wheel's tritonserver lacks: run it in the NGC Triton image"
                " (nvcr.io/nvidia/tritonserver:<version>-trtllm-python-py3) or pass --tritonserver PATH"
            )


def serve_with_wheel(args: argparse.Namespace, mps: CudaMps | None) -> None:
    """Run the nvidia-pytriton wheel's ``tritonserver`` on the rendered repository until it exits or is stopped.

    The wheel's server needs a backend directory assembled around it (as the embedded gateway does),
    so this process stays as its parent instead of exec-ing it; SIGTERM or SIGINT stops it.
    """
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    workdir = args.repo.with_name(f"{args.repo.name}.server")
    server = EmbeddedTriton(
        args.repo,
        workdir=workdir,
        host="0.0.0.0",
        startup_timeout=args.startup_timeout,
        ports=(args.grpc_port, args.http_port, args.metrics_port),
        cuda_mps=mps,
    )
    try:
        server.start()
    except EmbeddedTritonError as exc:
        raise SystemExit(f"error: {exc}") from exc
    sys.stderr.write(
        f"tritonserver (nvidia-pytriton) ready: gRPC {args.grpc_port}, HTTP {args.http_port}; log {server.log_path}\n"
    )
    while server.is_running() and not stopping.wait(_WATCH_INTERVAL_S):
        pass
    returncode = server.returncode
    server.stop()
    if not stopping.is_set():
        raise SystemExit(f"tritonserver exited with status {returncode}:\n{server.log_tail()}")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="tts-models", description=__doc__.split("\n")[0])
    sub = root.add_subparsers(dest="command", required=True)

    def with_root(p: argparse.ArgumentParser, required: bool) -> None:
        p.add_argument("--models-root", type=invocation_path, required=required, default=None, help="model root")

    download = sub.add_parser("download", help="fetch CosyVoice2-0.5B and the HF LLM, verified")
    with_root(download, True)
    _download_options(download)
    download.set_defaults(func=cmd_download)

    tiny = sub.add_parser("tiny", help="write a tiny random-weight checkpoint in the real layout")
    with_root(tiny, True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_tiny)

    full = sub.add_parser("random-full", help="write a random-weight checkpoint at full size (~2 GB) unless complete")
    with_root(full, True)
    full.add_argument("--seed", type=int, default=0)
    full.set_defaults(func=cmd_random_full)

    engine = sub.add_parser("build-engine", help="build the TensorRT-LLM engine unless up to date")
    with_root(engine, True)
    engine.add_argument("--engine-dir", type=invocation_path, default=None)
    _engine_options(engine)
    engine.add_argument("--dry-run", action="store_true", help="print the commands only")
    engine.set_defaults(func=cmd_build_engine)

    render = sub.add_parser("render", help="render a profile into a Triton model repository")
    _render_options(render)
    render.add_argument("--dest", type=invocation_path, required=True)
    render.set_defaults(func=cmd_render)

    launch = sub.add_parser("launch", help="render a profile and exec tritonserver on it")
    _render_options(launch)
    launch.add_argument("--repo", type=invocation_path, required=True, help="where to render the repository")
    launch.add_argument("--prepare", action="store_true", help="download and build what is missing first")
    launch.add_argument("--verify", action="store_true", help="with --prepare: re-verify every file")
    launch.add_argument(
        "--tritonserver",
        type=_program,
        default=None,
        help="server binary (default: tritonserver on PATH, as in the NGC image, else the nvidia-pytriton wheel's)",
    )
    launch.add_argument("--startup-timeout", type=float, default=600.0, help="with the wheel's server: seconds")
    launch.add_argument("--http-port", type=int, default=8000)
    launch.add_argument("--grpc-port", type=int, default=8001)
    launch.add_argument("--metrics-port", type=int, default=8002)
    launch.add_argument("--dry-run", action="store_true", help="render, then print the command")
    launch.add_argument(
        "--cuda-mps",
        choices=("auto", "on", "off"),
        default="auto",
        help="start a CUDA MPS daemon for the server's model processes (auto: for a profile that asks for it,"
        " where nvidia-cuda-mps-control exists)",
    )
    _download_options(launch)
    _engine_options(launch)
    launch.set_defaults(func=cmd_launch)
    return root


def _program(value: str) -> str:
    """A program: a bare name is looked up on ``PATH`` (as a shell does), a path read from the starting directory."""
    return str(invocation_path(value)) if os.sep in value else value


def _render_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True)
    p.add_argument("--models-root", type=invocation_path, default=None, help="replaces /models in profile paths")
    p.add_argument("--llm-urls", default=None, help="the LLM servers (comma-separated) of every model that has some")
    p.add_argument("--source", type=invocation_path, default=TRITON_REPOSITORY, help="template repository")
    p.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE")


def _download_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modelscope-id", default=MODELSCOPE_ID)
    p.add_argument("--modelscope-revision", default="master")
    p.add_argument("--hf-id", default=HUGGINGFACE_ID)
    p.add_argument("--hf-revision", default="main")


def _engine_options(p: argparse.ArgumentParser) -> None:
    defaults = trtllm_engine.EngineSettings()
    p.add_argument("--dtype", default=defaults.dtype)
    p.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size)
    p.add_argument("--max-num-tokens", type=int, default=defaults.max_num_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        args.func(args)
    except (TemplateError, hub_download.DownloadError, trtllm_engine.EngineError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
