"""The model CLI's pieces: verified, resumable downloads against a real local HTTP server;
engine rebuild decisions; profile rendering with a moved model root.

The hubs cannot be reached from the test machine; the local server speaks the same
listing JSON and honours ``Range`` like they do, and can cut a transfer short.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.unit.test_cuda_mps import calls, stand_in
from tts_gateway.allocator import SERVER_MALLOC_ENV
from tts_gateway.gateway.embedded.cuda_mps import PIPE_VARIABLE
from tts_gateway.models import contract
from tts_gateway.paths import TRITON_REPOSITORY
from tts_gateway.tools import hub_download, model_prep, trtllm_engine

pytestmark = pytest.mark.cosyvoice

PAYLOAD = bytes(range(256)) * 4096  # 1 MiB
SMALL = b'{"architectures": ["Qwen2ForCausalLM"]}\n'


@dataclass
class ServerState:
    files: dict[str, bytes] = field(default_factory=dict)
    json_routes: dict[str, object] = field(default_factory=dict)
    ranges: list[str | None] = field(default_factory=list)
    ignore_range: bool = False
    cut_after: int | None = None
    """Close the connection after this many body bytes (once)."""


def _handler(state: ServerState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            return

        def do_GET(self) -> None:
            route = self.path.split("?", 1)[0]
            if route in state.json_routes:
                body = json.dumps(state.json_routes[route]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            data = state.files.get(route)
            if data is None:
                self.send_error(404)
                return
            requested = self.headers.get("Range")
            state.ranges.append(requested)
            start = 0
            if requested and not state.ignore_range:
                start = int(requested.removeprefix("bytes=").split("-")[0])
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            body = data[start:]
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if state.cut_after is not None:
                self.wfile.write(body[: state.cut_after])
                state.cut_after = None
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


@pytest.fixture
def server() -> Iterator[tuple[str, ServerState]]:
    state = ServerState()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10.0) as http:
        yield http


def _remote(url: str, data: bytes, *, path: str = "flow.pt") -> hub_download.RemoteFile:
    return hub_download.RemoteFile(path=path, url=url, size=len(data), sha256=hashlib.sha256(data).hexdigest())


def test_fresh_download_is_verified_and_renamed(
    server: tuple[str, ServerState], client: httpx.Client, tmp_path: Path
) -> None:
    base, state = server
    state.files["/f"] = PAYLOAD
    dest = tmp_path / "sub" / "flow.pt"
    seen: list[int] = []

    fetched = hub_download.download_file(client, _remote(base + "/f", PAYLOAD), dest, lambda p, d, t: seen.append(d))

    assert fetched and dest.read_bytes() == PAYLOAD
    assert not dest.with_name("flow.pt.part").exists()
    assert seen[-1] == len(PAYLOAD)
    assert state.ranges == [None]


def test_complete_file_is_not_fetched_again(
    server: tuple[str, ServerState], client: httpx.Client, tmp_path: Path
) -> None:
    base, state = server
    state.files["/f"] = PAYLOAD
    dest = tmp_path / "flow.pt"
    dest.write_bytes(PAYLOAD)
    assert not hub_download.download_file(client, _remote(base + "/f", PAYLOAD), dest)
    assert state.ranges == []


def test_interrupted_transfer_resumes_with_a_range_request(
    server: tuple[str, ServerState], client: httpx.Client, tmp_path: Path
) -> None:
    base, state = server
    state.files["/f"] = PAYLOAD
    state.cut_after = 300_000
    dest = tmp_path / "flow.pt"
    remote = _remote(base + "/f", PAYLOAD)

    with pytest.raises(hub_download.DownloadError, match="interrupted"):
        hub_download.download_file(client, remote, dest)
    part = tmp_path / "flow.pt.part"
    assert not dest.exists()
    assert part.stat().st_size == 300_000

    assert hub_download.download_file(client, remote, dest)
    assert dest.read_bytes() == PAYLOAD
    assert state.ranges == [None, "bytes=300000-"]


def test_server_ignoring_the_range_restarts_cleanly(
    server: tuple[str, ServerState], client: httpx.Client, tmp_path: Path
) -> None:
    base, state = server
    state.files["/f"] = PAYLOAD
    state.ignore_range = True
    (tmp_path / "flow.pt.part").write_bytes(PAYLOAD[:1000])

    hub_download.download_file(client, _remote(base + "/f", PAYLOAD), tmp_path / "flow.pt")

    assert (tmp_path / "flow.pt").read_bytes() == PAYLOAD
    assert state.ranges == ["bytes=1000-"]


def test_content_that_does_not_match_its_hash_is_discarded(
    server: tuple[str, ServerState], client: httpx.Client, tmp_path: Path
) -> None:
    base, state = server
    state.files["/f"] = PAYLOAD[:-1] + b"\x00"
    dest = tmp_path / "flow.pt"
    with pytest.raises(hub_download.DownloadError, match="does not match"):
        hub_download.download_file(client, _remote(base + "/f", PAYLOAD), dest)
    assert not dest.exists()
    assert not (tmp_path / "flow.pt.part").exists()


def test_listings_of_both_hubs_and_git_blob_verification(
    server: tuple[str, ServerState], client: httpx.Client, tmp_path: Path
) -> None:
    base, state = server
    git_sha1 = hashlib.sha1(b"blob %d\0" % len(SMALL) + SMALL, usedforsecurity=False).hexdigest()
    state.json_routes["/api/v1/models/iic/CosyVoice2-0.5B/repo/files"] = {
        "Code": 200,
        "Data": {
            "Files": [
                {"Path": "CosyVoice-BlankEN", "Type": "tree", "Size": 0},
                {
                    "Path": "CosyVoice-BlankEN/model.bin",
                    "Type": "blob",
                    "Size": len(PAYLOAD),
                    "Sha256": hashlib.sha256(PAYLOAD).hexdigest(),
                },
            ]
        },
    }
    state.json_routes["/api/models/yuekai/cosyvoice2_llm/tree/main"] = [
        {"type": "directory", "path": "x", "oid": "0", "size": 0},
        {"type": "file", "path": "config.json", "oid": git_sha1, "size": len(SMALL)},
    ]
    state.files["/models/iic/CosyVoice2-0.5B/resolve/master/CosyVoice-BlankEN/model.bin"] = PAYLOAD
    state.files["/yuekai/cosyvoice2_llm/resolve/main/config.json"] = SMALL

    cosy = hub_download.modelscope_files(client, "iic/CosyVoice2-0.5B", endpoint=base)
    llm = hub_download.huggingface_files(client, "yuekai/cosyvoice2_llm", endpoint=base)
    assert [f.path for f in cosy] == ["CosyVoice-BlankEN/model.bin"]
    assert llm == [
        hub_download.RemoteFile(
            path="config.json",
            url=f"{base}/yuekai/cosyvoice2_llm/resolve/main/config.json",
            size=len(SMALL),
            git_sha1=git_sha1,
        )
    ]
    assert hub_download.download_all(client, cosy + llm, tmp_path) == 2
    assert (tmp_path / "CosyVoice-BlankEN" / "model.bin").read_bytes() == PAYLOAD
    assert hub_download.download_all(client, cosy + llm, tmp_path) == 0

    (tmp_path / "config.json").write_bytes(SMALL.replace(b"Qwen2", b"Qwen3"))
    assert not hub_download.is_complete(tmp_path / "config.json", llm[0])


def test_only_the_files_the_pipeline_loads_are_selected() -> None:
    listing = [
        hub_download.RemoteFile(path=name, url=f"https://hub/{name}", size=1)
        for name in ("llm.pt", "flow.pt", "cosyvoice2.yaml", "flow.decoder.estimator.fp32.onnx")
    ]
    assert [f.path for f in hub_download.select(listing, ["cosyvoice2.yaml", "flow.pt"])] == [
        "cosyvoice2.yaml",
        "flow.pt",
    ]
    with pytest.raises(hub_download.DownloadError, match=r"hift\.pt"):
        hub_download.select(listing, ["flow.pt", "hift.pt"])


def test_listing_paths_cannot_escape_the_destination(server: tuple[str, ServerState], client: httpx.Client) -> None:
    base, state = server
    state.json_routes["/api/models/evil/repo/tree/main"] = [
        {"type": "file", "path": "../../etc/passwd", "oid": "0", "size": 1}
    ]
    with pytest.raises(hub_download.DownloadError, match="unsafe path"):
        hub_download.huggingface_files(client, "evil/repo", endpoint=base)


def _info(**changes: object) -> trtllm_engine.BuildInfo:
    values: dict[str, object] = {
        "versions": {"tensorrt_llm": "0.20.0", "tensorrt": "10.10.0"},
        "gpu": "NVIDIA L20, 8.9",
        "settings": trtllm_engine.EngineSettings(),
        "checkpoint": "abc",
    }
    values.update(changes)
    return trtllm_engine.BuildInfo(**values)  # type: ignore[arg-type]


def test_engine_is_built_once_and_rebuilt_when_the_toolchain_changes(tmp_path: Path) -> None:
    engine_dir = tmp_path / "engines" / "llm"
    commands: list[Sequence[str]] = []

    def fake_toolchain(command: Sequence[str]) -> None:
        """Stands in for convert_checkpoint / trtllm-build: writes what they would."""
        commands.append(command)
        out = Path(command[command.index("--output_dir") + 1])
        out.mkdir(parents=True)
        (out / "rank0.engine").write_bytes(b"engine")

    settings = trtllm_engine.EngineSettings()
    assert trtllm_engine.ensure_engine(tmp_path / "hf", engine_dir, _info(), settings, fake_toolchain)
    assert (engine_dir / "rank0.engine").exists()
    assert trtllm_engine.read_build_info(engine_dir) == _info()
    assert not trtllm_engine.staging_dir(engine_dir).exists()
    assert [c[0] for c in commands] == [sys.executable, "trtllm-build"]
    assert commands == trtllm_engine.build_plan(tmp_path / "hf", engine_dir, settings)

    assert not trtllm_engine.ensure_engine(tmp_path / "hf", engine_dir, _info(), settings, fake_toolchain)
    assert len(commands) == 2

    upgraded = _info(versions={"tensorrt_llm": "0.21.0", "tensorrt": "10.11.0"})
    assert trtllm_engine.needs_build(engine_dir, upgraded)
    assert trtllm_engine.needs_build(engine_dir, _info(gpu="NVIDIA H100, 9.0"))
    assert trtllm_engine.needs_build(engine_dir, _info(settings=trtllm_engine.EngineSettings(max_batch_size=8)))
    assert trtllm_engine.ensure_engine(tmp_path / "hf", engine_dir, upgraded, settings, fake_toolchain)
    assert trtllm_engine.read_build_info(engine_dir) == upgraded


def test_failed_build_keeps_the_previous_engine(tmp_path: Path) -> None:
    engine_dir = tmp_path / "llm"
    engine_dir.mkdir()
    (engine_dir / "rank0.engine").write_bytes(b"old")
    (engine_dir / trtllm_engine.BUILD_INFO).write_text(_info().to_json())

    def failing(command: Sequence[str]) -> None:
        raise trtllm_engine.EngineError("trtllm-build failed")

    with pytest.raises(trtllm_engine.EngineError):
        trtllm_engine.ensure_engine(
            tmp_path / "hf", engine_dir, _info(checkpoint="new"), trtllm_engine.EngineSettings(), failing
        )
    assert (engine_dir / "rank0.engine").read_bytes() == b"old"
    assert not trtllm_engine.staging_dir(engine_dir).exists()


def test_checkpoint_fingerprint_follows_config_and_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes(SMALL)
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = trtllm_engine.checkpoint_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert trtllm_engine.checkpoint_fingerprint(tmp_path) != first


def tts_models(*arguments: str) -> list[str]:
    """The ``tts-models`` command line."""
    return [sys.executable, "-m", "tts_gateway.tools.model_prep", *arguments]


def test_render_moves_model_paths_under_the_given_root_read_from_the_starting_directory(tmp_path: Path) -> None:
    (tmp_path / "templates").symlink_to(TRITON_REPOSITORY)
    command = tts_models("render", "--profile", "gpu-trtllm", "--dest", "out/repo", "--source", "templates")
    command += ["--models-root", "models", "--set", "cosyvoice2.max_output_tokens=600"]
    command += ["--set", "token2wav.model_dir=checkpoints/cosy"]
    subprocess.run(command, check=True, capture_output=True, cwd=tmp_path)
    dest, root = tmp_path / "out" / "repo", tmp_path / "models"
    assert f'"{root}/cosyvoice2_llm"' in (dest / "cosyvoice2" / "config.pbtxt").read_text()
    assert f'"{root}/engines/cosyvoice2_llm-bfloat16"' in (dest / "tensorrt_llm" / "config.pbtxt").read_text()
    assert f'"{tmp_path}/checkpoints/cosy"' in (dest / "token2wav" / "config.pbtxt").read_text()
    assert '"600"' in (dest / "cosyvoice2" / "config.pbtxt").read_text()
    assert '"600"' not in (dest / "cosyvoice2_stream" / "config.pbtxt").read_text()


def test_build_engine_reads_its_directories_from_the_starting_directory(tmp_path: Path) -> None:
    command = tts_models("build-engine", "--models-root", "models", "--engine-dir", "engines/llm", "--dry-run")
    printed = subprocess.run(command, check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    convert, build = (line.split() for line in printed.splitlines())
    assert convert[convert.index("--model_dir") + 1] == f"{tmp_path}/models/{model_prep.LLM_DIR}"
    staging = trtllm_engine.staging_dir(tmp_path / "engines" / "llm")
    assert build[build.index("--output_dir") + 1] == str(staging / "engine")


@pytest.mark.parametrize("command", ["download", "tiny", "random-full"])
def test_model_roots_are_read_from_the_starting_directory(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = model_prep.parser().parse_args([command, "--models-root", "var/models"])
    assert args.models_root == tmp_path / "var" / "models"


def test_bad_override_is_reported_not_raised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = model_prep.main(["render", "--profile", "cosyvoice2-cpu", "--dest", str(tmp_path), "--set", "llm.nope=1"])
    assert code == 1
    assert "unknown keys ['nope']" in capsys.readouterr().err


def launch_command(repo: Path, *options: str) -> list[str]:
    """``tts-models launch`` of the CPU profile into ``repo``."""
    return [
        sys.executable,
        "-m",
        "tts_gateway.tools.model_prep",
        "launch",
        "--profile",
        "cosyvoice2-cpu",
        "--repo",
        str(repo),
        *options,
    ]


def test_launch_dry_run_renders_and_prints_the_server_command(tmp_path: Path) -> None:
    env = {
        key: value
        for key, value in os.environ.items()
        if key != contract.OWN_GRPC_URL_ENV and not key.startswith("MALLOC_") and key != "GLIBC_TUNABLES"
    }
    result = subprocess.run(
        launch_command(tmp_path / "repo", "--grpc-port", "9001", "--dry-run"),
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.stdout.split() == [
        f"{contract.OWN_GRPC_URL_ENV}=127.0.0.1:9001",
        *(f"{name}={value}" for name, value in SERVER_MALLOC_ENV.items()),
        "tritonserver",
        f"--model-repository={tmp_path / 'repo'}",
        "--http-port=8000",
        "--grpc-port=9001",
        "--metrics-port=8002",
        "--exit-on-error=true",
        "--grpc-infer-allocation-pool-size=0",
    ]
    assert (tmp_path / "repo" / "llm" / "config.pbtxt").is_file()


def test_launch_runs_a_server_named_by_a_relative_path_or_on_path_with_the_repository_it_rendered(
    tmp_path: Path,
) -> None:
    server = tmp_path / "bin" / "fake-tritonserver"
    server.parent.mkdir()
    server.write_text('#!/bin/sh\necho "$0" "$@"\n')
    server.chmod(0o755)
    env = {**os.environ, "PATH": f"{server.parent}{os.pathsep}{os.environ['PATH']}"}
    expected = [str(server), f"--model-repository={tmp_path / 'repo'}"]
    # A path is read from the starting directory; a bare name is a program on PATH, as to a shell.
    for named in ("bin/fake-tritonserver", "fake-tritonserver"):
        command = launch_command(Path("repo"), "--tritonserver", named)
        launched = subprocess.run(command, check=True, capture_output=True, text=True, cwd=tmp_path, env=env)
        assert launched.stdout.split()[:2] == expected, named
    assert (tmp_path / "repo" / "llm" / "config.pbtxt").is_file()


def test_launch_tells_the_server_its_own_grpc_address_unless_one_is_set(tmp_path: Path) -> None:
    server = tmp_path / "fake-tritonserver"
    server.write_text(f'#!/bin/sh\necho "url=${contract.OWN_GRPC_URL_ENV}"\n')
    server.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != contract.OWN_GRPC_URL_ENV}
    command = launch_command(tmp_path / "repo", "--tritonserver", str(server), "--grpc-port", "9001")
    told = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    assert told.stdout.strip() == "url=127.0.0.1:9001"
    preset = {**env, contract.OWN_GRPC_URL_ENV: "triton-llm:8001"}
    kept = subprocess.run(command, check=True, capture_output=True, text=True, env=preset)
    assert kept.stdout.strip() == "url=triton-llm:8001"


def test_launch_gives_the_server_the_allocators_settings_unless_the_operator_set_them(tmp_path: Path) -> None:
    server = tmp_path / "fake-tritonserver"
    server.write_text("#!/bin/sh\nenv | grep ^MALLOC_ | sort\n")
    server.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_") and key != "GLIBC_TUNABLES"}
    command = launch_command(tmp_path / "repo", "--tritonserver", str(server))
    told = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    assert told.stdout.split() == sorted(f"{name}={value}" for name, value in SERVER_MALLOC_ENV.items())
    told = subprocess.run(command, check=True, capture_output=True, text=True, env={**env, "MALLOC_ARENA_MAX": "8"})
    assert "MALLOC_ARENA_MAX=8" in told.stdout.split()
    tunables = {**env, "GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}
    told = subprocess.run(command, check=True, capture_output=True, text=True, env=tunables)
    assert told.stdout.split() == []


def test_launch_starts_the_servers_cuda_mps_daemon_and_execs_the_server_under_it(tmp_path: Path) -> None:
    # Stand-ins for the NVIDIA control program (no driver here) and for tritonserver, which only says
    # where its MPS clients would look for the daemon.
    bin_dir = tmp_path / "bin"
    stand_in(bin_dir)
    server = bin_dir / "fake-tritonserver"
    server.write_text(f'#!/bin/sh\necho "pipe=${PIPE_VARIABLE}"\n')
    server.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    env.pop(PIPE_VARIABLE, None)
    command = launch_command(tmp_path / "repo", "--tritonserver", str(server))
    # auto by default: no daemon for a profile that does not ask for one...
    cpu = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    assert cpu.stdout.strip() == "pipe="
    assert calls(bin_dir) == []
    # ...one for gpu-torch, which does, where the control program is installed.
    on_gpu = [*command, "--profile", "gpu-torch"]
    result = subprocess.run(on_gpu, check=True, capture_output=True, text=True, env=env)
    pipe = tmp_path / "tts-cuda-mps" / "pipe"
    assert result.stdout.strip() == f"pipe={pipe}"
    assert [line.split()[0] for line in calls(bin_dir)] == ["args=-d"]
    off = subprocess.run([*on_gpu, "--cuda-mps", "off"], check=True, capture_output=True, text=True, env=env)
    assert off.stdout.strip() == "pipe="
    assert len(calls(bin_dir)) == 1
