"""Build the CosyVoice2 LLM's TensorRT-LLM engine, and rebuild it only when something changed.

A TensorRT engine is valid only for the TensorRT(-LLM) version and GPU that built it;
upstream deployments broke silently when an image update changed the version. Each engine
directory therefore carries ``build_info.json``: the versions, the GPU, the build settings
and a fingerprint of the checkpoint. :func:`ensure_engine` rebuilds when any of them differ.

Only the command lines are built here; ``tensorrt_llm`` is imported solely by
:func:`convert_checkpoint`, which runs in its own process on a GPU machine.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from tts_gateway.paths import invocation_path

BUILD_INFO = "build_info.json"
TRT_PACKAGES = ("tensorrt_llm", "tensorrt", "tensorrt_cu12")

Runner = Callable[[Sequence[str]], None]


class EngineError(RuntimeError):
    """The toolchain is missing or a build step failed."""


@dataclass(frozen=True)
class EngineSettings:
    """``trtllm-build`` settings (upstream's: bf16, 16 sequences, 32768 tokens per batch)."""

    dtype: str = "bfloat16"
    max_batch_size: int = 16
    max_num_tokens: int = 32768


@dataclass(frozen=True)
class BuildInfo:
    """Everything an engine depends on; equal infos mean the engine can be reused."""

    versions: dict[str, str]
    gpu: str
    settings: EngineSettings
    checkpoint: str
    extra: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BuildInfo:
        raw = json.loads(text)
        return cls(
            versions=dict(raw["versions"]),
            gpu=str(raw["gpu"]),
            settings=EngineSettings(**raw["settings"]),
            checkpoint=str(raw["checkpoint"]),
            extra=dict(raw.get("extra", {})),
        )


def toolchain_versions() -> dict[str, str]:
    """Installed versions of the TensorRT packages; raises when TensorRT-LLM is absent."""
    versions = {}
    for package in TRT_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    if "tensorrt_llm" not in versions:
        raise EngineError("tensorrt_llm is not installed: build engines inside the TensorRT-LLM image")
    return versions


def gpu_identity() -> str:
    """Name and compute capability of the first GPU (an engine is specific to both)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise EngineError(f"cannot query the GPU with nvidia-smi: {exc}") from exc
    return out.strip().splitlines()[0].strip()


def checkpoint_fingerprint(hf_dir: Path) -> str:
    """SHA-256 over the checkpoint's config and the names and sizes of its weight files.

    Hashing gigabytes of weights at every start would cost more than it protects; a changed
    download changes a size or the config.
    """
    digest = hashlib.sha256()
    digest.update((hf_dir / "config.json").read_bytes())
    for path in sorted(hf_dir.glob("*.safetensors")) + sorted(hf_dir.glob("*.bin")):
        digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
    return digest.hexdigest()


def convert_command(hf_dir: Path, checkpoint_dir: Path, settings: EngineSettings) -> list[str]:
    """Hugging Face Qwen2 -> TensorRT-LLM checkpoint (this module's ``convert`` entry point)."""
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--model_dir",
        str(hf_dir),
        "--output_dir",
        str(checkpoint_dir),
        "--dtype",
        settings.dtype,
    ]


def build_command(checkpoint_dir: Path, engine_dir: Path, settings: EngineSettings) -> list[str]:
    return [
        "trtllm-build",
        "--checkpoint_dir",
        str(checkpoint_dir),
        "--output_dir",
        str(engine_dir),
        "--max_batch_size",
        str(settings.max_batch_size),
        "--max_num_tokens",
        str(settings.max_num_tokens),
        "--gemm_plugin",
        settings.dtype,
    ]


def staging_dir(engine_dir: Path) -> Path:
    """Where a build happens before it replaces ``engine_dir``."""
    return engine_dir.with_name(engine_dir.name + ".building")


def build_plan(hf_dir: Path, engine_dir: Path, settings: EngineSettings) -> list[list[str]]:
    """The commands :func:`ensure_engine` runs, in order."""
    checkpoint = staging_dir(engine_dir) / "checkpoint"
    return [
        convert_command(hf_dir, checkpoint, settings),
        build_command(checkpoint, staging_dir(engine_dir) / "engine", settings),
    ]


def read_build_info(engine_dir: Path) -> BuildInfo | None:
    try:
        return BuildInfo.from_json((engine_dir / BUILD_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def needs_build(engine_dir: Path, wanted: BuildInfo) -> bool:
    """True unless ``engine_dir`` holds an engine built exactly as ``wanted``."""
    return read_build_info(engine_dir) != wanted


def run_command(command: Sequence[str]) -> None:
    try:
        subprocess.run(list(command), check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise EngineError(f"{command[0]} failed: {exc}") from exc


def ensure_engine(
    hf_dir: Path, engine_dir: Path, wanted: BuildInfo, settings: EngineSettings, run: Runner = run_command
) -> bool:
    """Build the engine into ``engine_dir`` unless an identical build is there; return whether it built.

    The build happens in a sibling directory that replaces ``engine_dir`` only once it is
    complete, so an interrupted build never leaves a half-written engine behind.
    """
    if not needs_build(engine_dir, wanted):
        return False
    staging = staging_dir(engine_dir)
    shutil.rmtree(staging, ignore_errors=True)
    engine = staging / "engine"
    try:
        for command in build_plan(hf_dir, engine_dir, settings):
            run(command)
        (engine / BUILD_INFO).write_text(wanted.to_json(), encoding="utf-8")
        shutil.rmtree(engine_dir, ignore_errors=True)
        engine.rename(engine_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


def convert_checkpoint(hf_dir: Path, output_dir: Path, dtype: str) -> None:
    """Write the TensorRT-LLM checkpoint of a Qwen2 HF directory (single GPU, no quantisation)."""
    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.models import QWenForCausalLM

    model = QWenForCausalLM.from_hugging_face(str(hf_dir), dtype=dtype, mapping=Mapping(world_size=1))
    model.save_checkpoint(str(output_dir), save_config=True)


def _main(argv: Sequence[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Convert a Qwen2 HF checkpoint for trtllm-build.")
    parser.add_argument("--model_dir", type=invocation_path, required=True)
    parser.add_argument("--output_dir", type=invocation_path, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    convert_checkpoint(args.model_dir, args.output_dir, args.dtype)


if __name__ == "__main__":
    _main(sys.argv[1:])
