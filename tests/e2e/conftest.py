"""One real Triton (cpu profile) and one gateway process for the whole e2e session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from openai import AsyncOpenAI, OpenAI

from tests.conftest import CosyVoiceServer
from tests.e2e.gateway_process import GatewayProcess
from tts_gateway.gateway.embedded.server import EmbeddedTriton

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.triton


@pytest.fixture(scope="session")
def voices_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="session")
def gateway(
    cpu_triton: EmbeddedTriton, voices_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    process = GatewayProcess(log, {"TTS_TRITON_URL": cpu_triton.grpc_url, "TTS_VOICES_DIR": str(voices_dir)})
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="session")
def client(gateway: GatewayProcess) -> OpenAI:
    return OpenAI(base_url=f"{gateway.url}/v1", api_key="not-needed", max_retries=0)


@pytest.fixture()
def async_client(gateway: GatewayProcess) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="not-needed", max_retries=0)


@pytest.fixture(scope="session")
def piper_seconds(cpu_triton: EmbeddedTriton) -> PiperReference:
    return PiperReference(cpu_triton.grpc_url)


class PiperReference:
    """How long Piper's own offline model speaks a text: the expected duration of gateway audio."""

    def __init__(self, url: str) -> None:
        self._client = grpcclient.InferenceServerClient(url)

    def __call__(self, text: str, speed: float = 1.0) -> float:
        inputs = [grpcclient.InferInput("target_text", [1], "BYTES")]
        inputs[0].set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        if speed != 1.0:
            speed_input = grpcclient.InferInput("speed", [1], "FP32")
            speed_input.set_data_from_numpy(np.array([speed], dtype=np.float32))
            inputs.append(speed_input)
        result = self._client.infer("piper", inputs)
        waveform = result.as_numpy("waveform")
        assert waveform is not None
        return float(waveform.size) / 22_050

    def mean(self, text: str, draws: int = 8) -> float:
        """The mean over ``draws`` syntheses: Piper draws its durations with noise (about 2 % apart)."""
        return sum(self(text) for _ in range(draws)) / draws


@pytest.fixture(scope="module")
def cosy_gateway(
    cosyvoice_server: CosyVoiceServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """A gateway process in front of the CosyVoice2 server (tiny checkpoint), one per test module."""
    workdir = tmp_path_factory.mktemp("cosy_gateway")
    process = GatewayProcess(
        workdir / "gateway.log",
        {"TTS_TRITON_URL": cosyvoice_server.triton.grpc_url, "TTS_VOICES_DIR": str(workdir / "voices")},
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture()
def embedded(tmp_path: Path) -> Iterator[tuple[GatewayProcess, Path]]:
    """A gateway that starts and supervises its own Triton (the CPU default), and that Triton's workdir."""
    workdir = tmp_path / "embedded"
    env = {"TTS_EMBEDDED_WORKDIR": str(workdir), "TTS_VOICES_DIR": str(tmp_path / "voices"), "TTS_TRITON_URL": ""}
    gateway = GatewayProcess(tmp_path / "gateway.log", env)
    gateway.start(timeout=180)
    try:
        yield gateway, workdir
    finally:
        gateway.stop()
