"""Schema fuzzing: schemathesis drives every operation of a real gateway process, Piper behind it.

Every operation gets schema-derived valid and invalid requests (the coverage phase adds the
boundary values of every field); no answer may be a 5xx, every error must be OpenAI's
envelope (ElevenLabs' on ElevenLabs' paths), and answers must match the schema. A second test gives the speech operation
valid models and voices, so the generated text really goes through synthesis and back.
Bounded and derandomised for CI: the same requests every run, about half a minute in all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import Case, GenerationMode
from schemathesis.checks import (
    positive_data_acceptance,
)

from tests.audio_checks import decode
from tests.e2e.gateway_process import GatewayProcess
from tts_gateway.gateway.api.elevenlabs_api import REST_PATHS
from tts_gateway.gateway.app_factory import create_app
from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.gateway.settings import Settings

pytestmark = pytest.mark.triton

_FUZZ_SETTINGS = settings(
    max_examples=30,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
# Schema-valid requests may still be refused: voices and models must exist, and an upload
# must hold real audio, which no schema can express.
_EXCLUDED = [positive_data_acceptance]
_ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def fuzz_gateway(cpu_triton: EmbeddedTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway of its own: the fuzzer uploads and deletes voices at random."""
    root = tmp_path_factory.mktemp("fuzz")
    process = GatewayProcess(
        root / "gateway.log", {"TTS_TRITON_URL": cpu_triton.grpc_url, "TTS_VOICES_DIR": str(root / "voices")}
    )
    process.start()
    yield process
    process.stop()


# Built from the application object, as collection needs it before any server runs; the first
# test checks that the gateway process serves this very schema.
API_SCHEMA = create_app(Settings()).openapi()
schema = schemathesis.openapi.from_dict(API_SCHEMA)


def test_the_fuzzed_schema_is_the_served_one(fuzz_gateway: GatewayProcess) -> None:
    assert httpx.get(f"{fuzz_gateway.url}/openapi.json").json() == API_SCHEMA


def _assert_error_envelope(response: httpx.Response | Any, path: str = "/v1/audio/speech") -> None:
    body = response.json()
    # ElevenLabs' paths answer in ElevenLabs' envelope, a wrong method (405) included.
    if path.startswith(REST_PATHS):
        assert set(body) == {"detail"}, body
        assert set(body["detail"]) == {"status", "message"}, body
        assert isinstance(body["detail"]["message"], str) and body["detail"]["message"]
        return
    assert set(body) == {"error"}, body
    assert set(body["error"]) == _ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


@schema.parametrize()
@_FUZZ_SETTINGS
def test_every_operation_answers_within_its_schema(case: Case, fuzz_gateway: GatewayProcess) -> None:
    response = case.call_and_validate(base_url=fuzz_gateway.url, excluded_checks=_EXCLUDED, timeout=60)

    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        _assert_error_envelope(response, case.path)


def _speakable(case: Case, choice: int) -> Case:
    """The generated request with a model and voice that exist, and a bounded text."""
    body = dict(case.body)
    body["model"], body["voice"] = [("tts-1", "alloy"), ("piper", "joe"), ("piper", {"id": "joe"})][choice % 3]
    body["input"] = body["input"][:200]
    case.body = body
    return case


def test_generated_text_goes_through_real_synthesis(fuzz_gateway: GatewayProcess) -> None:
    operation = schema["/v1/audio/speech"]["POST"]
    strategy = operation.as_strategy(GenerationMode.POSITIVE)
    outcomes: dict[int, int] = {}

    @settings(_FUZZ_SETTINGS, max_examples=40)
    @given(case=strategy)
    def speak(case: Case) -> None:
        case = _speakable(case, sum(outcomes.values()))
        response = case.call(base_url=fuzz_gateway.url, timeout=60)
        outcomes[response.status_code] = outcomes.get(response.status_code, 0) + 1
        if response.status_code == 400:
            # Text that is all symbols or whitespace yields no audio at all.
            _assert_error_envelope(response)
            assert response.json()["error"]["code"] in {"nothing_to_speak", "invalid_value"}, response.text
            return
        assert response.status_code == 200, response.text
        if case.body.get("stream_format") == "sse":
            assert response.headers["content-type"][0].startswith("text/event-stream")  # schemathesis: lists
            assert b'"type":"speech.audio.done"' in response.content
            return
        audio = decode(response.content, case.body.get("response_format", "mp3"))
        assert audio.duration > 0.05

    speak()
    assert outcomes.get(200, 0) >= 20, outcomes
