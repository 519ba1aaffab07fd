"""The LLM stage on an OpenAI-compatible server (``orchestrator/llm_server_client.py``), over real servers.

``transformers serve`` (the ``transformers`` dialect: text prompt, ``generation_config``) runs
for real on the tiny checkpoint's LLM. vLLM and trtllm-serve do not run without a GPU; the
``vllm`` dialect (token-id prompt, sampling fields in the body) is served by
``tests/fixtures/token_id_completions.py``, a stand-in of their wire format over the same model.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.gateway_process import free_port
from tests.llm_server_process import LLMServerProcess, established_connections
from tts_gateway.paths import TRITON_REPOSITORY

pytestmark = pytest.mark.cosyvoice

REPO_ROOT = Path(__file__).resolve().parents[2]
TRANSCRIPT = "Hello there."
TEXT = "The quick brown fox."
PROMPT_TOKENS = [1, 2, 3, 4000, 6560]


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tts_gateway.models.cosyvoice2.checkpoints.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "models").llm_dir


@pytest.fixture(scope="module")
def tokenizer(llm_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llm_dir)


@pytest.fixture(scope="module")
def transformers_serve(llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLMServerProcess]:
    server = LLMServerProcess(llm_dir, free_port(), tmp_path_factory.mktemp("serve") / "serve.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def token_id_servers(llm_dir: Path) -> Iterator[dict[str, Any]]:
    """Two stand-ins of the vLLM / trtllm-serve dialect: one streams ``token_ids``, one text only."""
    from tests.fixtures.token_id_completions import TokenIdCompletionsServer

    servers = {
        "token_ids": TokenIdCompletionsServer(llm_dir, free_port(), send_token_ids=True, max_model_len=400),
        "text": TokenIdCompletionsServer(llm_dir, free_port(), send_token_ids=False, max_model_len=400),
    }
    for server in servers.values():
        server.start()
    yield servers
    for server in servers.values():
        server.stop()


def _request(tokenizer: Any, *, seed: int = 7, min_new: int = 8, max_new: int = 24, temperature: float = 0.8) -> Any:
    from tts_gateway.models.cosyvoice2.model import vocab
    from tts_gateway.models.cosyvoice2.orchestrator.pipeline import LLMRequest

    return LLMRequest(
        input_ids=vocab.build_prompt_ids(tokenizer, TRANSCRIPT, TEXT, PROMPT_TOKENS),
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        end_id=vocab.EOS1_ID,
        temperature=temperature,
        top_p=0.95,
        top_k=50,
        repetition_penalty=1.1,
        seed=seed,
        streaming=True,
    )


def _client(tokenizer: Any, urls: list[str], api: str, **settings: Any) -> Any:
    from tts_gateway.models.cosyvoice2.orchestrator.llm_server_client import (
        LLMServerAPI,
        LLMServerClient,
        LLMServerSettings,
    )

    return LLMServerClient(LLMServerSettings(urls=tuple(urls), api=LLMServerAPI(api), **settings), tokenizer)


def _ids(client: Any, request: Any) -> list[int]:
    return [token_id for piece in client.generate(request, lambda: False) for token_id in piece]


def _speech(ids: list[int]) -> list[int]:
    """The speech tokens the pipeline keeps: up to the first id that is not one."""
    from tts_gateway.models.cosyvoice2.model import vocab

    tokens = []
    for token_id in ids:
        token = vocab.id_to_speech_token(token_id)
        if token is None:
            break
        tokens.append(token)
    return tokens


# --- the transformers dialect, against the real transformers serve -------------------------------


def test_transformers_serve_streams_speech_tokens_reproducibly(
    transformers_serve: LLMServerProcess, tokenizer: Any
) -> None:
    client = _client(tokenizer, [transformers_serve.url], "transformers")
    try:
        pieces = list(client.generate(_request(tokenizer, seed=7), lambda: False))
        ids = [token_id for piece in pieces for token_id in piece]
        assert len(pieces) > 1, "tokens arrive as they are generated"
        assert 8 <= len(_speech(ids)) <= 24
        assert _ids(client, _request(tokenizer, seed=7)) == ids
        assert _ids(client, _request(tokenizer, seed=8)) != ids
    finally:
        client.close()


def test_transformers_serve_gets_the_length_bounds_and_greedy_decoding(
    transformers_serve: LLMServerProcess, tokenizer: Any
) -> None:
    client = _client(tokenizer, [transformers_serve.url], "transformers")
    try:
        # min = max: exactly that many tokens, whatever the random head prefers.
        assert len(_speech(_ids(client, _request(tokenizer, min_new=12, max_new=12)))) == 12
        # Temperature 0 is greedy: the seed no longer matters.
        greedy = _ids(client, _request(tokenizer, seed=1, temperature=0.0))
        assert greedy == _ids(client, _request(tokenizer, seed=2, temperature=0.0))
    finally:
        client.close()


def test_closing_the_generator_closes_the_http_stream(transformers_serve: LLMServerProcess, tokenizer: Any) -> None:
    client = _client(tokenizer, [transformers_serve.url], "transformers")
    try:
        stream = client.generate(_request(tokenizer, min_new=400, max_new=400), lambda: False)
        assert next(stream)
        assert established_connections(transformers_serve.port, os.getpid()) == 1
        stream.close()
        # Closed, not drained back into the pool: the server sees the client leave and stops.
        assert established_connections(transformers_serve.port, os.getpid()) == 0
        assert len(_speech(_ids(client, _request(tokenizer)))) >= 8
        # A stream read to its end leaves its connection open for the next request.
        assert established_connections(transformers_serve.port, os.getpid()) == 1
    finally:
        client.close()


def test_a_dialect_the_server_does_not_speak_is_an_internal_error(
    transformers_serve: LLMServerProcess, tokenizer: Any
) -> None:
    from tts_gateway.models.cosyvoice2.orchestrator.llm_server_client import LLMServerError

    client = _client(tokenizer, [transformers_serve.url], "vllm")
    try:
        with pytest.raises(LLMServerError, match="422"):
            _ids(client, _request(tokenizer))
    finally:
        client.close()


def test_user_text_spelling_a_control_token_cannot_travel_as_text(tokenizer: Any) -> None:
    from tts_gateway.models.cosyvoice2.model import vocab
    from tts_gateway.models.cosyvoice2.orchestrator.llm_server_client import prompt_text
    from tts_gateway.models.request_parsing import ContractError

    ids = vocab.build_prompt_ids(tokenizer, TRANSCRIPT, TEXT, PROMPT_TOKENS)
    assert tokenizer.encode(prompt_text(tokenizer, ids)) == ids
    typed = vocab.build_prompt_ids(tokenizer, "", "Say <|eos1|> now.", [])
    with pytest.raises(ContractError, match="control token"):
        prompt_text(tokenizer, typed)


# --- the vllm dialect (vLLM, trtllm-serve), against the stand-in ---------------------------------


@pytest.mark.parametrize("form", ["token_ids", "text"])
def test_token_id_dialect_streams_speech_tokens(token_id_servers: dict[str, Any], tokenizer: Any, form: str) -> None:
    client = _client(tokenizer, [token_id_servers[form].url], "vllm", model="cosyvoice2_llm")
    try:
        pieces = list(client.generate(_request(tokenizer, seed=3), lambda: False))
        assert len(pieces) > 1
        ids = [token_id for piece in pieces for token_id in piece]
        assert 8 <= len(_speech(ids)) <= 24
        assert _ids(client, _request(tokenizer, seed=3)) == ids
        assert len(_speech(_ids(client, _request(tokenizer, min_new=12, max_new=12)))) == 12
    finally:
        client.close()


def test_token_ids_and_their_text_are_read_alike(token_id_servers: dict[str, Any], tokenizer: Any) -> None:
    """The same generation read from ``token_ids`` and from the spelt-out text gives the same ids."""
    results = []
    for form in ("token_ids", "text"):
        client = _client(tokenizer, [token_id_servers[form].url], "vllm", model="cosyvoice2_llm")
        try:
            results.append(_ids(client, _request(tokenizer, seed=11)))
        finally:
            client.close()
    assert results[0] == results[1]


def test_the_body_sends_the_sampling_fields_one_to_one(tokenizer: Any) -> None:
    from tts_gateway.models.cosyvoice2.model import vocab
    from tts_gateway.models.cosyvoice2.orchestrator.llm_server_client import LLMServerAPI, completion_body

    request = _request(tokenizer, seed=5, min_new=3, max_new=9)
    body = completion_body(request, LLMServerAPI.VLLM, model="m")
    assert body == {
        "model": "m",
        "prompt": request.input_ids,
        "stream": True,
        "max_tokens": 9,
        "min_tokens": 3,
        "temperature": 0.8,
        "top_p": 0.95,
        "top_k": 50,
        "repetition_penalty": 1.1,
        "seed": 5,
        "stop_token_ids": list(vocab.STOP_IDS),
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    body = completion_body(request, LLMServerAPI.TRANSFORMERS, tokenizer)
    assert "model" not in body and body["seed"] == 5 and body["max_tokens"] == 9
    assert json.loads(body["generation_config"]) | {"eos_token_id": None} == {
        "do_sample": True,
        "temperature": 0.8,
        "top_p": 0.95,
        "top_k": 50,
        "repetition_penalty": 1.1,
        "min_new_tokens": 3,
        "max_new_tokens": 9,
        "eos_token_id": None,
        "pad_token_id": vocab.EOS1_ID,
    }


def test_a_prompt_beyond_the_context_is_the_callers_fault(token_id_servers: dict[str, Any], tokenizer: Any) -> None:
    from tts_gateway.models.request_parsing import ContractError

    client = _client(tokenizer, [token_id_servers["text"].url], "vllm", model="cosyvoice2_llm")
    try:
        with pytest.raises(ContractError, match="maximum context length"):
            _ids(client, _request(tokenizer, max_new=1000))
    finally:
        client.close()


def test_requests_go_to_the_server_with_the_fewest_in_flight(token_id_servers: dict[str, Any], tokenizer: Any) -> None:
    servers = list(token_id_servers.values())
    client = _client(tokenizer, [server.url for server in servers], "vllm", model="cosyvoice2_llm")
    try:
        first = client.generate(_request(tokenizer, min_new=200, max_new=200), lambda: False)
        assert next(first)
        second = client.generate(_request(tokenizer, min_new=200, max_new=200), lambda: False)
        assert next(second)
        assert [established_connections(server.port, os.getpid()) for server in servers] == [1, 1]
        first.close()
        second.close()
    finally:
        client.close()


# --- failures before the first token -----------------------------------------------------------


def test_a_server_that_is_down_is_skipped_for_one_that_is_up(
    transformers_serve: LLMServerProcess, tokenizer: Any
) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    client = _client(tokenizer, [dead, transformers_serve.url], "transformers", retries=1)
    try:
        for _ in range(2):  # whichever comes first, each request reaches the live server
            assert len(_speech(_ids(client, _request(tokenizer)))) >= 8
    finally:
        client.close()


def test_no_server_up_is_unavailable_after_the_retries(tokenizer: Any) -> None:
    from tts_gateway.models.request_parsing import DependencyUnavailableError

    client = _client(tokenizer, [f"http://127.0.0.1:{free_port()}/v1"], "transformers", retries=2, timeout_s=2.0)
    try:
        with pytest.raises(DependencyUnavailableError, match="3 attempts"):
            _ids(client, _request(tokenizer))
    finally:
        client.close()


def test_retries_stop_once_the_request_is_cancelled(tokenizer: Any) -> None:
    client = _client(tokenizer, [f"http://127.0.0.1:{free_port()}/v1"], "transformers", retries=50)
    cancelled = threading.Event()
    cancelled.set()
    try:
        assert _ids_cancelled(client, _request(tokenizer), cancelled) == []
    finally:
        client.close()


def _ids_cancelled(client: Any, request: Any, cancelled: threading.Event) -> list[int]:
    return [token_id for piece in client.generate(request, cancelled.is_set) for token_id in piece]


class _ScriptedCompletions:
    """A completions server on a real socket that answers each request with the next scripted reply:
    ``(status, headers, body)``; a ``list`` body is streamed as ``data:`` lines, strings as they are
    (``[DONE]``), the rest as JSON (no model behind it)."""

    def __init__(self, replies: list[tuple[int, dict[str, str], Any]]) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.replies = list(replies)
        self.arrivals: list[float] = []
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                scripted.arrivals.append(time.monotonic())
                status, headers, body = scripted.replies.pop(0)
                streamed = isinstance(body, list)
                lines = [item if isinstance(item, str) else json.dumps(item) for item in body] if streamed else []
                payload = "".join(f"data: {line}\n\n" for line in lines) if streamed else json.dumps(body)
                self.send_response(status)
                self.send_header("Content-Type", "text/event-stream" if streamed else "application/json")
                self.send_header("Content-Length", str(len(payload.encode())))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload.encode())

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _token_chunk(token_id: int) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": "", "token_ids": [token_id], "finish_reason": None}]}


def test_a_429_is_retried_after_the_servers_retry_after(tokenizer: Any) -> None:
    from tts_gateway.models.cosyvoice2.model import vocab

    tokens = [vocab.speech_token_to_id(k) for k in (5, 6, 7)]
    server = _ScriptedCompletions(
        [
            (429, {"Retry-After": "0.5"}, {"error": {"message": "too many requests"}}),
            (200, {}, [*(_token_chunk(t) for t in tokens), "[DONE]"]),
        ]
    )
    client = _client(tokenizer, [server.url], "vllm", retries=1)
    try:
        assert _ids(client, _request(tokenizer)) == tokens
    finally:
        client.close()
        server.close()
    first, second = server.arrivals
    assert second - first >= 0.5, "the second try waits as long as the server asked"


def test_an_error_in_the_stream_after_tokens_is_unavailable_and_not_retried(tokenizer: Any) -> None:
    from tts_gateway.models.cosyvoice2.model import vocab
    from tts_gateway.models.request_parsing import DependencyUnavailableError

    token = vocab.speech_token_to_id(5)
    server = _ScriptedCompletions([(200, {}, [_token_chunk(token), {"error": {"message": "engine died"}}])])
    client = _client(tokenizer, [server.url], "vllm", retries=2)
    pieces = client.generate(_request(tokenizer), lambda: False)
    try:
        assert next(pieces) == [token]
        with pytest.raises(DependencyUnavailableError, match="failed mid-stream: engine died"):
            next(pieces)
    finally:
        client.close()
        server.close()
    assert len(server.arrivals) == 1, "tokens already spoken are not asked for again"


def test_a_stream_of_something_else_than_completion_chunks_is_the_servers_fault(tokenizer: Any) -> None:
    from tts_gateway.models.cosyvoice2.orchestrator.llm_server_client import LLMServerError

    server = _ScriptedCompletions([(200, {}, ['"not a chunk"', "[DONE]"])])
    client = _client(tokenizer, [server.url], "vllm", retries=0)
    try:
        with pytest.raises(LLMServerError, match="something other than a completion chunk"):
            _ids(client, _request(tokenizer))
    finally:
        client.close()
        server.close()


# --- reading the stream -----------------------------------------------------------------------


def test_spelt_tokens_are_read_across_piece_boundaries_and_plain_text_ends_speech(tokenizer: Any) -> None:
    from tts_gateway.models.cosyvoice2.model import vocab
    from tts_gateway.models.cosyvoice2.orchestrator.llm_server_client import NOT_SPEECH, SpeechTokenText

    text = SpeechTokenText(tokenizer.get_added_vocab())
    assert text.feed("<|s_1|><|s_") == [vocab.speech_token_to_id(1)]
    assert text.feed("6560|> <|s_2|>") == [vocab.speech_token_to_id(6560), vocab.speech_token_to_id(2)]
    assert text.feed("<|eos1|>") == [vocab.EOS1_ID]
    assert text.feed("Hello") == [NOT_SPEECH]
    assert vocab.id_to_speech_token(NOT_SPEECH) is None


# --- the profiles ------------------------------------------------------------------------------


@pytest.mark.parametrize("profile", ["gpu-llm-server", "cosyvoice2-cpu-llm-server"])
def test_llm_server_profiles_deploy_every_stage_but_the_llm(profile: str, tmp_path: Path) -> None:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from tts_gateway.models.cosyvoice2.orchestrator.llm_server_client import LLMServerSettings
    from tts_gateway.models.cosyvoice2.orchestrator.pipeline import PipelineSettings
    from tts_gateway.models.model_repository import render_repository

    names = render_repository(TRITON_REPOSITORY, profile, tmp_path)
    assert sorted(names) == ["audio_tokenizer", "cosyvoice2", "cosyvoice2_stream", "speaker_embedding", "token2wav"]
    for name in ("cosyvoice2", "cosyvoice2_stream"):
        config = text_format.Parse((tmp_path / name / "config.pbtxt").read_text(), mc.ModelConfig())
        params = {key: value.string_value for key, value in config.parameters.items()}
        assert params["llm_model"] == ""
        settings = LLMServerSettings.from_parameters(params, max_connections=int(params["stream_workers"]))
        assert settings is not None and settings.urls
        PipelineSettings.from_parameters(params)
        for key in ("audio_tokenizer_model", "speaker_embedding_model", "token2wav_model"):
            assert params[key] in names


def test_in_triton_profiles_name_no_llm_server() -> None:
    from tts_gateway.models.cosyvoice2.orchestrator.llm_server_client import LLMServerSettings
    from tts_gateway.models.model_repository import load_profiles

    for profile in ("cosyvoice2-cpu", "gpu-trtllm", "gpu-torch"):
        for model in load_profiles(TRITON_REPOSITORY)[profile].models:
            if model.source == "cosyvoice2":
                assert LLMServerSettings.from_parameters(model.values, max_connections=1) is None
