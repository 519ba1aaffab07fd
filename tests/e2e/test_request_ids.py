"""Every response carries x-request-id; the id reaches the gateway's log lines and Triton."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
import tritonclient.http as httpclient
from openai import OpenAI

from tests.e2e.gateway_process import GatewayProcess
from tests.fixtures.scripted_triton import start_scripted_triton
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = pytest.mark.triton

SPEECH = {"model": "scripted", "voice": "beeper", "input": "tone", "response_format": "wav"}
GENERATED = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    server = start_scripted_triton(tmp_path_factory.mktemp("request_ids_triton"))
    # Verbose logging, set while it runs, makes Triton log each request's id.
    httpclient.InferenceServerClient(server.http_url.removeprefix("http://")).update_log_settings(
        settings={"log_verbose_level": 1}
    )
    yield server
    server.stop(grace=1.0)


@pytest.fixture(scope="module")
def gateway(triton: EmbeddedTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("request_ids_gateway")
    process = GatewayProcess(
        root / "gateway.log",
        {"TTS_TRITON_URL": triton.grpc_url, "TTS_VOICES_DIR": str(root / "voices"), "TTS_API_KEYS": "sesame"},
    )
    process.start()
    yield process
    process.stop()


AUTH = {"Authorization": "Bearer sesame"}


def test_the_clients_id_goes_to_the_log_and_to_triton(gateway: GatewayProcess, triton: EmbeddedTriton) -> None:
    response = httpx.post(
        f"{gateway.url}/v1/audio/speech", json=SPEECH, headers={**AUTH, "X-Request-Id": "trace-me-42"}, timeout=30
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-me-42"
    access = [line for line in gateway.log_path.read_text().splitlines() if "POST /v1/audio/speech" in line]
    assert "[trace-me-42]" in access[-1]
    assert "[request id: trace-me-42-0]" in triton.log_path.read_text(), "sentence 0 of the request, at Triton"


def test_an_id_is_generated_for_every_answer(gateway: GatewayProcess) -> None:
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="sesame", max_retries=0)
    speech = client.audio.speech.with_raw_response.create(model="scripted", voice="beeper", input="tone")
    first = speech.headers["x-request-id"]
    assert GENERATED.fullmatch(first)
    again = client.models.with_raw_response.list().headers["x-request-id"]
    assert GENERATED.fullmatch(again) and again != first
    # Refused before any route (a missing key), no route, an invalid body: each answer has its id, once.
    for answer, status in (
        (httpx.get(f"{gateway.url}/v1/models"), 401),
        (httpx.get(f"{gateway.url}/v1/nowhere", headers=AUTH), 404),
        (httpx.post(f"{gateway.url}/v1/audio/speech", json={"model": "scripted"}, headers=AUTH), 400),
    ):
        assert answer.status_code == status
        assert len(answer.headers.get_list("x-request-id")) == 1
        assert GENERATED.fullmatch(answer.headers["x-request-id"])
    probe = httpx.get(f"{gateway.url}/health", headers={"X-Request-Id": "probe-1"})
    assert probe.status_code == 200 and probe.headers["x-request-id"] == "probe-1"


@pytest.mark.parametrize("unusable", [b"has spaces in it", b"x" * 129, b"tab\there", "caf\u00e9".encode()])
def test_an_unusable_client_id_is_replaced(gateway: GatewayProcess, unusable: bytes) -> None:
    response = httpx.get(f"{gateway.url}/health", headers=[(b"X-Request-Id", unusable)])
    assert GENERATED.fullmatch(response.headers["x-request-id"])
