"""The embedded Triton server and the Piper models it serves, over real gRPC."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient_sync
import tritonclient.grpc.aio as grpcclient
from numpy.typing import NDArray
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

import tts_gateway.gateway.embedded.server as embedded_triton
from tests.e2e.gateway_process import crash, free_ports, model_processes
from tests.unit.test_cuda_mps import calls, stand_in_first_on_path
from tts_gateway.allocator import SERVER_MALLOC_ENV
from tts_gateway.gateway.embedded.cuda_mps import PIPE_VARIABLE, CudaMps
from tts_gateway.gateway.embedded.server import EmbeddedTriton, EmbeddedTritonError
from tts_gateway.models import contract

pytestmark = pytest.mark.triton

SAMPLE_RATE = 22_050
THREE_SENTENCES = "Hi. This second sentence is a great deal longer than the first and the last. Bye."


def long_story(sentences: int) -> str:
    return " ".join(f"This is sentence number {i} of a long story." for i in range(1, sentences + 1))


def assert_speech(waveform: NDArray[np.float32], words: int) -> None:
    """Mono float audio at 22050 Hz whose length fits ``words`` of natural speech, not silence."""
    assert waveform.dtype == np.float32
    assert waveform.ndim == 1
    duration = waveform.shape[0] / SAMPLE_RATE
    assert words / 5 < duration < words / 2, f"{duration:.2f} s for {words} words"
    assert np.abs(waveform).max() <= 1.0
    assert np.sqrt(np.mean(waveform**2)) > 0.02, "audio is (nearly) silent"


def text_input(value: bytes) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(contract.TARGET_TEXT, [1], contract.INPUT_DTYPES[contract.TARGET_TEXT])
    tensor.set_data_from_numpy(np.array([value], dtype=np.object_))
    return tensor


def speed_input(value: float) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(contract.SPEED, [1], contract.INPUT_DTYPES[contract.SPEED])
    tensor.set_data_from_numpy(np.array([value], dtype=np.float32))
    return tensor


async def infer(server: EmbeddedTriton, inputs: list[grpcclient.InferInput]) -> NDArray[np.float32]:
    async with grpcclient.InferenceServerClient(server.grpc_url) as client:
        result = await client.infer("piper", inputs)
    waveform = result.as_numpy(contract.WAVEFORM)
    assert waveform is not None
    return waveform


async def speak(server: EmbeddedTriton, text: str, speed: float | None = None) -> NDArray[np.float32]:
    inputs = [text_input(text.encode())]
    if speed is not None:
        inputs.append(speed_input(speed))
    return await infer(server, inputs)


# tritonclient.grpc.aio cannot ask for the empty final response of a decoupled model,
# so the streaming tests speak Triton's gRPC protocol with the generated stubs.
@dataclass
class StreamEvent:
    waveform: NDArray[np.float32] | None
    error: str | None
    final: bool


def stream_request(
    text: str, *, speed: float | None = None, request_id: str = "", model: str = "piper_stream"
) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    request.inputs.add(name=contract.TARGET_TEXT, datatype="BYTES", shape=[1])
    request.raw_input_contents.append(serialize_byte_tensor(np.array([text.encode()], dtype=np.object_)).item())
    if speed is not None:
        request.inputs.add(name=contract.SPEED, datatype="FP32", shape=[1])
        request.raw_input_contents.append(np.array([speed], dtype=np.float32).tobytes())
    return request


def to_event(response: service_pb2.ModelStreamInferResponse) -> StreamEvent:
    final = response.infer_response.parameters["triton_final_response"].bool_param
    if response.error_message:
        return StreamEvent(waveform=None, error=response.error_message, final=final)
    waveform = None if final else InferResult(response.infer_response).as_numpy(contract.WAVEFORM)
    return StreamEvent(waveform=waveform, error=None, final=final)


async def stream_events(server: EmbeddedTriton, request: service_pb2.ModelInferRequest) -> AsyncIterator[StreamEvent]:
    """Events of one streamed request, up to and including its final response."""
    async with grpc.aio.insecure_channel(server.grpc_url) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request]))
        async for response in call:
            event = to_event(response)
            yield event
            if event.final:
                return


async def stream(server: EmbeddedTriton, request: service_pb2.ModelInferRequest) -> list[StreamEvent]:
    return [event async for event in stream_events(server, request)]


async def test_offline_model_returns_speech(cpu_triton: EmbeddedTriton) -> None:
    text = "The quick brown fox jumps over the lazy dog. It was a sunny day!"
    assert_speech(await speak(cpu_triton, text), words=len(text.split()))


async def test_stream_model_sends_one_chunk_per_sentence_then_final(cpu_triton: EmbeddedTriton) -> None:
    events = await stream(cpu_triton, stream_request(THREE_SENTENCES))
    assert [event.error for event in events] == [None] * 4
    assert [event.final for event in events] == [False, False, False, True]
    chunks = [event.waveform for event in events[:3]]
    assert all(chunk is not None for chunk in chunks)
    first, second, last = (chunk.shape[0] for chunk in chunks if chunk is not None)
    # In text order: the long middle sentence comes second.
    assert second > 2 * first
    assert second > 2 * last
    assert_speech(np.concatenate([chunk for chunk in chunks if chunk is not None]), len(THREE_SENTENCES.split()))


async def test_speed_shortens_offline_and_streamed_speech(cpu_triton: EmbeddedTriton) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    natural = (await speak(cpu_triton, text)).shape[0]
    fast = (await speak(cpu_triton, text, speed=2.0)).shape[0]
    assert 0.45 < fast / natural < 0.75
    events = await stream(cpu_triton, stream_request(text, speed=2.0))
    streamed = sum(event.waveform.shape[0] for event in events if event.waveform is not None)
    assert 0.45 < streamed / natural < 0.75


async def test_missing_target_text_is_invalid_argument(cpu_triton: EmbeddedTriton) -> None:
    with pytest.raises(InferenceServerException) as excinfo:
        await infer(cpu_triton, [speed_input(1.0)])
    assert excinfo.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert contract.TARGET_TEXT in str(excinfo.value.message())


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([text_input(b"  ")], "'target_text' is empty"),
        ([text_input(b"caf\xe9")], "not valid UTF-8"),
        ([text_input(b"Hello."), speed_input(10.0)], "'speed' must be in"),
    ],
)
async def test_bad_values_are_invalid_argument(
    cpu_triton: EmbeddedTriton, inputs: list[grpcclient.InferInput], message: str
) -> None:
    with pytest.raises(InferenceServerException) as excinfo:
        await infer(cpu_triton, inputs)
    assert excinfo.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert message in str(excinfo.value.message())


async def test_stream_reports_bad_values_in_its_final_response(cpu_triton: EmbeddedTriton) -> None:
    events = await stream(cpu_triton, stream_request("   "))
    assert len(events) == 1
    assert events[0].error is not None
    assert "'target_text' is empty" in events[0].error
    assert events[0].final


@pytest.mark.parametrize(
    ("script", "code"), [("tone unavailable", "[UNAVAILABLE]"), ("tone reject", "[INVALID_ARG]"), ("fail", "failed")]
)
async def test_a_streamed_error_is_the_final_response_itself(
    scripted_triton: EmbeddedTriton, script: str, code: str
) -> None:
    """Sent apart, a final flag after an error met the client's cancellation of the stream (a client
    stops at the error) and crashed Triton 2.51 now and then: 3 of 30 fresh servers sent 16 such
    streams, 8 at a time, on a 2-core machine under load."""
    events = await stream(scripted_triton, stream_request(script, model="scripted_stream"))
    chunks = script.count("tone")
    assert [(event.error is not None, event.final) for event in events] == [(False, False)] * chunks + [(True, True)]
    assert code in str(events[-1].error)


async def test_nothing_to_speak_gives_empty_waveform(cpu_triton: EmbeddedTriton) -> None:
    assert (await speak(cpu_triton, "...")).shape == (0,)
    assert [event.final for event in await stream(cpu_triton, stream_request("..."))] == [True]


async def test_long_stream_does_not_hold_up_a_short_one(cpu_triton: EmbeddedTriton) -> None:
    finished: list[str] = []

    async def run(name: str, text: str) -> None:
        events = await stream(cpu_triton, stream_request(text))
        assert events[-1].final
        finished.append(name)

    long_run = asyncio.create_task(run("long", long_story(12)))
    await asyncio.sleep(0.3)
    await run("short", "Hello there.")
    await long_run
    assert finished == ["short", "long"]


async def test_cancelled_stream_stops_synthesis(cpu_triton: EmbeddedTriton) -> None:
    request_id = f"cancel-{uuid.uuid4()}"
    async with grpc.aio.insecure_channel(cpu_triton.grpc_url) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter([stream_request(long_story(40), request_id=request_id)])
        )
        first = to_event(await anext(aiter(call)))
        assert first.waveform is not None
        call.cancel()

    # The model notices between sentences and says so; 40 sentences would take far longer.
    log_line = f"request '{request_id}' cancelled"
    for _ in range(100):
        if log_line in cpu_triton.log_path.read_text():
            break
        await asyncio.sleep(0.1)
    assert log_line in cpu_triton.log_path.read_text()
    assert cpu_triton.is_running()
    assert_speech(await speak(cpu_triton, "Still here."), words=2)


@pytest.mark.parametrize("model", ["piper", "piper_stream"])
async def test_model_config_exposes_capabilities(cpu_triton: EmbeddedTriton, model: str) -> None:
    async with grpcclient.InferenceServerClient(cpu_triton.grpc_url) as client:
        config = (await client.get_model_config(model, as_json=True))["config"]
    # Protobuf's JSON form leaves out empty strings (voice_model is empty here).
    params = {key: value.get("string_value", "") for key, value in config["parameters"].items()}
    assert set(contract.CAPABILITY_PARAMETERS) <= set(params)
    assert params[contract.PARAM_TTS_CONTRACT] == contract.CONTRACT_VERSION
    assert params[contract.PARAM_SAMPLE_RATE] == str(SAMPLE_RATE)
    assert contract.parse_bool(params[contract.PARAM_SUPPORTS_CLONING]) is False
    assert contract.parse_bool(params[contract.PARAM_SUPPORTS_SPEED]) is True
    assert contract.parse_list(params[contract.PARAM_BUILTIN_VOICES]) == ("joe",)
    assert contract.parse_list(params[contract.PARAM_LANGUAGES]) == ("en",)
    assert params[contract.PARAM_DESCRIPTION]
    assert {spec["name"]: spec["data_type"] for spec in config["input"]} == {
        contract.TARGET_TEXT: "TYPE_STRING",
        contract.SPEED: "TYPE_FP32",
    }
    assert config.get("model_transaction_policy", {}).get("decoupled", False) is (model == "piper_stream")


def test_urls_use_the_chosen_host_and_ports(cpu_triton: EmbeddedTriton) -> None:
    grpc_port = int(cpu_triton.grpc_url.rpartition(":")[2])
    assert cpu_triton.grpc_url == f"127.0.0.1:{grpc_port}"
    assert cpu_triton.http_url.startswith("http://127.0.0.1:")
    assert cpu_triton.metrics_url.endswith("/metrics")
    with socket.create_connection(("127.0.0.1", grpc_port), timeout=2):
        pass


def is_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie awaiting its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


@pytest.fixture
def empty_repository(tmp_path: Path) -> Path:
    repository = tmp_path / "models"
    repository.mkdir()
    return repository


def test_stop_is_idempotent_and_ends_the_process(empty_repository: Path, tmp_path: Path) -> None:
    server = EmbeddedTriton(empty_repository, workdir=tmp_path / "work")
    with pytest.raises(EmbeddedTritonError, match="not running"):
        _ = server.grpc_url
    server.start()
    pid = server.pid
    assert pid is not None
    assert server.is_running()
    server.stop()
    server.stop()
    assert not server.is_running()
    assert server.pid is None
    assert is_gone(pid)
    with pytest.raises(EmbeddedTritonError, match="not running"):
        _ = server.http_url


def test_the_loader_path_gets_this_interpreters_libpython_and_not_its_whole_libdir(
    empty_repository: Path, tmp_path: Path
) -> None:
    # A system Python's LIBDIR is /usr/lib/<arch>: first on the path, its libraries would shadow the
    # CUDA libraries that torch finds through its own run paths in every model process.
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if not libdir or not (Path(libdir) / soname).is_file():
        pytest.skip("this interpreter has no shared libpython")
    with EmbeddedTriton(empty_repository, workdir=tmp_path / "work") as server:
        assert server.pid is not None
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
    path = next(e for e in environ if e.startswith(b"LD_LIBRARY_PATH=")).decode().split("=", 1)[1].split(os.pathsep)
    assert libdir not in path
    first = Path(path[0])
    assert [entry.name for entry in first.iterdir()] == [soname]
    assert (first / soname).resolve() == (Path(libdir) / soname).resolve()


def write_python_model(repository: Path, name: str, source: str) -> None:
    """A Python model with one FP32 input ``x`` and one FP32 output ``y``."""
    model = repository / name / "1"
    model.mkdir(parents=True)
    (model.parent / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "x", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "y", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
    )
    (model / "model.py").write_text(source)


def test_failed_start_reports_the_log_tail(tmp_path: Path) -> None:
    write_python_model(
        tmp_path / "models",
        "broken",
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise RuntimeError('voice file is corrupt')\n",
    )
    server = EmbeddedTriton(tmp_path / "models", workdir=tmp_path / "work")
    with pytest.raises(EmbeddedTritonError, match="exited with status") as excinfo:
        server.start()
    assert "voice file is corrupt" in str(excinfo.value)
    assert not server.is_running()


def test_a_server_keeps_the_malloc_settings_it_was_made_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A gateway with several workers sets their MALLOC_ARENA_MAX in its environment after its servers are
    # made (cli.py); a server started (or restarted) then still gets its own.
    write_python_model(
        tmp_path / "models",
        "arenas",
        "import os\n"
        "import numpy as np\n"
        "import triton_python_backend_utils as pb\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        seen = np.array([float(os.environ.get('MALLOC_ARENA_MAX', '-1'))], np.float32)\n"
        "        return [pb.InferenceResponse([pb.Tensor('y', seen)]) for _ in requests]\n",
    )
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    server = EmbeddedTriton(tmp_path / "models", workdir=tmp_path / "work")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")
    with server, grpcclient_sync.InferenceServerClient(server.grpc_url) as client:
        x = grpcclient_sync.InferInput("x", [1], "FP32")
        x.set_data_from_numpy(np.zeros(1, np.float32))
        seen = client.infer("arenas", [x]).as_numpy("y")
    assert seen is not None and int(seen[0]) == int(SERVER_MALLOC_ENV["MALLOC_ARENA_MAX"])


def test_model_processes_reach_the_cuda_mps_daemon_started_for_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No GPU here: the control program is the recording stand-in of tests/unit/test_cuda_mps.py. What is
    # real is the server and its model process, which must see the daemon's pipes (an MPS client finds
    # its daemon through them), while the daemon is started before the server and quit after it.
    bin_dir = tmp_path / "bin"
    stand_in_first_on_path(bin_dir, monkeypatch)
    write_python_model(
        tmp_path / "models",
        "pipes",
        "import os\n"
        "import numpy as np\n"
        "import triton_python_backend_utils as pb\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        f"        seen = np.array([len(os.environ.get('{PIPE_VARIABLE}', ''))], np.float32)\n"
        "        return [pb.InferenceResponse([pb.Tensor('y', seen)]) for _ in requests]\n",
    )
    mps = CudaMps.for_mode("auto", tmp_path / "mps", profile_asks=True)
    assert mps is not None
    pipe = tmp_path / "mps" / "pipe"
    with EmbeddedTriton(tmp_path / "models", workdir=tmp_path / "work", cuda_mps=mps) as server:
        # The daemon was started before the server (again, after a quit, if a port was taken at the first try).
        assert calls(bin_dir)[-1].split()[0] == "args=-d"
        with grpcclient_sync.InferenceServerClient(server.grpc_url) as client:
            x = grpcclient_sync.InferInput("x", [1], "FP32")
            x.set_data_from_numpy(np.zeros(1, np.float32))
            y = client.infer("pipes", [x]).as_numpy("y")
        assert y is not None and int(y[0]) == len(str(pipe))
    assert calls(bin_dir)[-1] == f"args= pipe={pipe} log={tmp_path / 'mps' / 'log'} input=quit"


def test_slow_start_times_out_with_the_log_tail(empty_repository: Path, tmp_path: Path) -> None:
    server = EmbeddedTriton(empty_repository, workdir=tmp_path / "work", startup_timeout=0.0)
    with pytest.raises(EmbeddedTritonError, match="not ready within 0 s"):
        server.start()
    assert not server.is_running()


def test_start_retries_once_when_a_port_is_taken(
    empty_repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Forces the race the port picker accepts: another process binds a chosen port first.
    real_free_ports = embedded_triton._free_ports
    picks: list[tuple[int, int, int]] = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()

        def pick_taken_grpc_port_first(host: str) -> tuple[int, int, int]:
            grpc_port, http_port, metrics_port = real_free_ports(host)
            if not picks:
                grpc_port = taken.getsockname()[1]
            picks.append((grpc_port, http_port, metrics_port))
            return grpc_port, http_port, metrics_port

        monkeypatch.setattr(embedded_triton, "_free_ports", pick_taken_grpc_port_first)
        with EmbeddedTriton(empty_repository, workdir=tmp_path / "work") as server:
            assert len(picks) == 2
            assert server.grpc_url == f"127.0.0.1:{picks[1][0]}"
            assert server.is_running()


def test_server_dies_with_its_parent(empty_repository: Path, tmp_path: Path) -> None:
    parent_script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from tts_gateway.gateway.embedded.server import EmbeddedTriton
        server = EmbeddedTriton(Path({str(empty_repository)!r}), workdir=Path({str(tmp_path / "work")!r}))
        server.start()
        print(server.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        server_pid = int(parent.stdout.readline())
        assert not is_gone(server_pid)
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while not is_gone(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert is_gone(server_pid)


def test_numpy_2_is_refused_before_anything_starts(
    empty_repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(np, "__version__", "2.1.0")
    with pytest.raises(EmbeddedTritonError, match=r"needs numpy<2"):
        EmbeddedTriton(empty_repository, workdir=tmp_path / "work").start()
    assert not (tmp_path / "work").exists()


def test_missing_wheel_names_the_extra(empty_repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pytriton", None)
    with pytest.raises(EmbeddedTritonError, match=r"pip install 'tts-gateway\[embedded\]'"):
        EmbeddedTriton(empty_repository, workdir=tmp_path / "work").start()


@pytest.fixture
def python_model_repository(tmp_path: Path) -> Path:
    """One trivial Python model: a server with a backend stub process that starts in seconds."""
    write_python_model(
        tmp_path / "models",
        "echo",
        "import triton_python_backend_utils as pb_utils\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        return [pb_utils.InferenceResponse([pb_utils.Tensor('y', pb_utils.get_input_tensor_by_name(r, 'x')"
        ".as_numpy())]) for r in requests]\n",
    )
    return tmp_path / "models"


def stub_shm_regions(workdir: Path) -> list[Path]:
    """The shared-memory files of the running stubs, named on their command lines."""
    regions = []
    for pid in model_processes(workdir):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        regions += [Path("/dev/shm") / arg for arg in args if arg.startswith("triton_python_backend_shm_region_")]
    return regions


def echo(server: EmbeddedTriton) -> float:
    client = grpcclient_sync.InferenceServerClient(server.grpc_url)
    try:
        tensor = grpcclient_sync.InferInput("x", [1], "FP32")
        tensor.set_data_from_numpy(np.array([1.5], dtype=np.float32))
        result = client.infer("echo", [tensor]).as_numpy("y")
    finally:
        client.close()
    assert result is not None
    return float(result[0])


def test_restart_after_a_crash_on_fixed_ports(python_model_repository: Path, tmp_path: Path) -> None:
    grpc_port, http_port, metrics_port = free_ports(3)
    server = EmbeddedTriton(
        python_model_repository, workdir=tmp_path / "work", ports=(grpc_port, http_port, metrics_port)
    )
    try:
        server.start()
        assert server.grpc_url == f"127.0.0.1:{grpc_port}"
        assert server.http_url == f"http://127.0.0.1:{http_port}"
        assert server.metrics_url == f"http://127.0.0.1:{metrics_port}/metrics"
        crashed = model_processes(tmp_path / "work")
        assert crashed, "the Python model runs in a stub process"
        crash(server)
        # The crashed server's stub still runs the stub binary that a new start puts in place.
        server.start()
        assert server.grpc_url == f"127.0.0.1:{grpc_port}"
        assert echo(server) == 1.5
        assert not set(crashed) & set(model_processes(tmp_path / "work"))
    finally:
        server.stop(grace=2.0)


def test_stopping_a_crashed_server_removes_its_shared_memory(python_model_repository: Path, tmp_path: Path) -> None:
    server = EmbeddedTriton(python_model_repository, workdir=tmp_path / "work")
    server.start()
    regions = stub_shm_regions(tmp_path / "work")
    assert regions and all(region.exists() for region in regions)
    crash(server)
    server.stop()
    assert not [region for region in regions if region.exists()]
    deadline = time.monotonic() + 5  # SIGKILLed processes take a moment to leave /proc
    while model_processes(tmp_path / "work") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert model_processes(tmp_path / "work") == []


def test_fixed_port_taken_is_an_error(empty_repository: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        _, http_port, metrics_port = free_ports(3)
        server = EmbeddedTriton(
            empty_repository, workdir=tmp_path / "work", ports=(taken.getsockname()[1], http_port, metrics_port)
        )
        with pytest.raises(EmbeddedTritonError, match="already in use"):
            server.start()
    assert not server.is_running()


def test_start_replaces_a_stub_binary_still_in_use(empty_repository: Path, tmp_path: Path) -> None:
    """Stubs of a crashed server run on for a moment: the next start must not need to write their binary."""
    server = EmbeddedTriton(empty_repository, workdir=tmp_path / "work")
    server.start()
    server.stop()
    stub = next((tmp_path / "work" / "backends" / "python").glob("triton_python_backend_stub"))
    # A process held stopped right after it executed the stub (PTRACE_TRACEME): the file is busy.
    libc = ctypes.CDLL(None, use_errno=True)
    holder = subprocess.Popen(
        [stub], preexec_fn=lambda: libc.ptrace(0, 0, None, None), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 5
        while (state := Path(f"/proc/{holder.pid}/stat").read_text().rpartition(")")[2].split()[0]) != "t":
            if holder.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"cannot hold a process stopped after exec here (state {state})")
            time.sleep(0.05)
        with pytest.raises(OSError, match="Text file busy"):
            stub.open("r+b")
        server.start()
        assert server.is_running()
    finally:
        holder.kill()
        holder.wait()
        server.stop()
