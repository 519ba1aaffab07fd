"""The orchestrator's LLM stage streams the LLM model of its own Triton over gRPC (``llm_grpc.py``).

A real Triton serves a scripted decoupled LLM (one response per token, a pause between tokens,
cancellation checked between them) and a minimal orchestrator around ``TritonStages`` with
``TritonLLMStreams``, which finds the server through the environment ``EmbeddedTriton`` gives it.
``scripts/test.sh`` runs this file again under Python 3.12, the GPU images' stub interpreter.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.fixtures.scripted_llm import LLM_CONFIG
from tts_gateway.gateway.embedded.server import EmbeddedTriton
from tts_gateway.models.cosyvoice2.model import vocab
from tts_gateway.models.cosyvoice2.orchestrator.llm_grpc import TritonLLMStreams
from tts_gateway.models.cosyvoice2.orchestrator.pipeline import LLMRequest
from tts_gateway.models.request_parsing import DependencyUnavailableError

pytestmark = [pytest.mark.cosyvoice, pytest.mark.triton]

FIRST_ID = vocab.SPEECH_TOKEN_OFFSET

# request_output_len: how many tokens (0: an INVALID_ARG error, -1: a failure); min_length: milliseconds between them.
LLM_MODEL = """
import threading
import time

import triton_python_backend_utils as pb_utils

from tts_gateway.models import contract
from tts_gateway.models.cosyvoice2 import tensors


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "request_output_len").as_numpy().reshape(-1)[0])
            pause = int(pb_utils.get_input_tensor_by_name(request, "min_length").as_numpy().reshape(-1)[0]) / 1000
            threading.Thread(target=self._generate, args=(request, count, pause), daemon=True).start()
        return None

    def _generate(self, request, count, pause):
        sender = request.get_response_sender()
        if count <= 0:
            invalid = f"{contract.INVALID_ARG_PREFIX} no tokens asked for"
            error = (
                pb_utils.TritonError(invalid, pb_utils.TritonError.INVALID_ARG)
                if count == 0
                else pb_utils.TritonError("out of order", pb_utils.TritonError.INTERNAL)
            )
            sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        for token in range(count):
            if request.is_cancelled():
                pb_utils.Logger.log_info(f"llm {request.request_id()}: cancelled after {token} tokens")
                break
            outputs = tensors.llm_outputs([FIRST_ID + token])
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()]))
            time.sleep(pause)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

# tokens: [count, pause_ms, read at most, threads]; runs that many generations at once on threads of its own and
# answers the ids they read, one after the other, or the first error's class and message.
ORCHESTRATOR_MODEL = """
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from tts_gateway.models.cosyvoice2.orchestrator.llm_grpc import TritonLLMStreams, own_grpc_url
from tts_gateway.models.cosyvoice2.orchestrator.pipeline import LLMRequest
from tts_gateway.models.cosyvoice2.orchestrator.triton_stages import StageModels, TritonStages


class TritonPythonModel:
    def initialize(self, args):
        self.llm = TritonLLMStreams(own_grpc_url(), "llm")
        self.stages = TritonStages(StageModels(audio_tokenizer="", speaker_embedding="", token2wav=""), self.llm)

    def execute(self, requests):
        responses = []
        for request in requests:
            asked = pb_utils.get_input_tensor_by_name(request, "tokens").as_numpy()
            count, pause_ms, read_at_most, threads = (int(v) for v in asked)
            with ThreadPoolExecutor(max_workers=threads) as pool:
                answers = list(pool.map(
                    lambda index: self._generate(request, count, pause_ms, read_at_most, index), range(threads)
                ))
            ids = [i for piece, _ in answers for i in piece]
            error = next((error for _, error in answers if error), "")
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("ids", np.asarray(ids, dtype=np.int32)),
                pb_utils.Tensor("error", np.array([error.encode()], dtype=np.object_)),
            ]))
        return responses

    def _generate(self, request, count, pause_ms, read_at_most, index):
        llm_request = LLMRequest(
            input_ids=[1, 2, 3], max_new_tokens=count, min_new_tokens=pause_ms, end_id=None, temperature=1.0,
            top_p=1.0, top_k=0, repetition_penalty=1.0, seed=None, streaming=True,
            request_id=request.request_id() if index == 0 else f"{request.request_id()}-{index}",
        )
        ids, error = [], ""
        pieces = self.stages.generate(llm_request, request.is_cancelled)
        try:
            for piece in pieces:
                ids.extend(piece)
                if len(ids) >= read_at_most:
                    break
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            pieces.close()
        return ids, error

    def finalize(self):
        self.llm.close()
"""

ORCHESTRATOR_CONFIG = """backend: "python"
max_batch_size: 0
input [ { name: "tokens", data_type: TYPE_INT32, dims: [ 4 ] } ]
output [
  { name: "ids", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "error", data_type: TYPE_STRING, dims: [ 1 ] }
]
instance_group [ { count: 2, kind: KIND_CPU } ]
"""


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    root = tmp_path_factory.mktemp("llm_grpc")
    models = {
        "llm": (LLM_MODEL.replace("FIRST_ID", str(FIRST_ID)), LLM_CONFIG),
        "orchestrator": (ORCHESTRATOR_MODEL, ORCHESTRATOR_CONFIG),
    }
    for name, (code, config) in models.items():
        (root / "repository" / name / "1").mkdir(parents=True)
        (root / "repository" / name / "1" / "model.py").write_text(code, encoding="utf-8")
        (root / "repository" / name / "config.pbtxt").write_text(config, encoding="utf-8")
    server = EmbeddedTriton(root / "repository", workdir=root)
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=5.0)


def _orchestrate(
    triton: EmbeddedTriton, count: int, pause_ms: int, read_at_most: int, request_id: str, threads: int = 1
) -> tuple[list[int], str]:
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        tokens = grpcclient.InferInput("tokens", [4], "INT32")
        tokens.set_data_from_numpy(np.array([count, pause_ms, read_at_most, threads], dtype=np.int32))
        result = client.infer("orchestrator", [tokens], request_id=request_id, client_timeout=60.0)
    finally:
        client.close()
    ids = result.as_numpy("ids")
    error = result.as_numpy("error")
    assert ids is not None and error is not None
    return ids.tolist(), error[0].decode()


def test_concurrent_generations_each_get_their_tokens_in_order(triton: EmbeddedTriton) -> None:
    counts = [5, 12, 30, 7, 18, 25, 9, 14] * 2
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda i: _orchestrate(triton, counts[i], 2, 1000, f"order-{i}"), range(len(counts))))
    for count, (ids, error) in zip(counts, answers, strict=True):
        assert error == ""
        assert ids == list(range(FIRST_ID, FIRST_ID + count))
    log = Path(triton.log_path).read_text(encoding="utf-8", errors="replace")
    assert "Fatal Python error" not in log
    assert "not healthy" not in log


def test_a_generation_left_early_is_cancelled_in_the_llm(triton: EmbeddedTriton) -> None:
    ids, error = _orchestrate(triton, 400, 10, 3, "left-early")
    assert error == ""
    assert ids == list(range(FIRST_ID, FIRST_ID + 3))
    deadline = time.monotonic() + 10
    marker = "llm left-early: cancelled after "
    while marker not in (log := Path(triton.log_path).read_text(encoding="utf-8", errors="replace")):
        assert time.monotonic() < deadline, "the LLM was not told that its request was cancelled"
        time.sleep(0.1)
    produced = int(log.split(marker, 1)[1].split()[0])
    assert produced < 100  # of 400 tokens at 10 ms each: stopped within about a second, not run to its end
    # The process's channel serves the next generation after a cancelled one.
    assert _orchestrate(triton, 4, 1, 1000, "after-cancel") == (list(range(FIRST_ID, FIRST_ID + 4)), "")


def test_an_invalid_argument_of_the_llm_is_the_callers_fault(triton: EmbeddedTriton) -> None:
    ids, error = _orchestrate(triton, 0, 0, 1000, "invalid")
    assert ids == []
    assert error == "ContractError: no tokens asked for"


def test_threads_of_one_orchestrator_share_its_channel(triton: EmbeddedTriton) -> None:
    """The case Triton 2.51's BLS streams deadlocked on: many threads of one process reading LLM streams at once."""
    for round_ in range(3):
        ids, error = _orchestrate(triton, 20, 1, 1000, f"threads-{round_}", threads=16)
        assert error == ""
        assert ids == list(range(FIRST_ID, FIRST_ID + 20)) * 16


def test_a_failure_of_the_llm_is_the_stages_not_the_callers(triton: EmbeddedTriton) -> None:
    ids, error = _orchestrate(triton, -1, 0, 1000, "failing")
    assert ids == []
    assert error == "LLMStageError: llm: out of order"


def test_an_unreachable_server_is_unavailable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # free, and nothing listens once the socket is closed
    streams = TritonLLMStreams(f"127.0.0.1:{port}", "llm")
    request = LLMRequest(
        input_ids=[1],
        max_new_tokens=2,
        min_new_tokens=0,
        end_id=None,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        seed=None,
        streaming=True,
    )
    try:
        with pytest.raises(DependencyUnavailableError, match="UNAVAILABLE"):
            list(streams.generate(request, lambda: False))
    finally:
        streams.close()
