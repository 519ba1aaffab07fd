"""A finished LLM stream must not be freed by the Python backend stub's own thread.

The stub keeps every decoupled BLS response stream in a map and removes a finished one from
its stub-to-parent thread, without the GIL. If that drops the last reference, the responses'
NumPy arrays are freed without a Python thread state: a segfault of the orchestrator's stub
on Python 3.12, a silent allocator race on 3.11. ``TritonStages.generate`` keeps the stream
until the stub has let go of it.

The orchestrator here is a minimal model around ``TritonStages.generate`` over a scripted
decoupled LLM. After the last token it logs a burst: log records go through that same thread,
so the stub's clean-up of the stream is queued behind them and always comes last. Without the
fix the orchestrator's stub dies at the first request on Python 3.12 (the GPU machine's); on
3.11 the race does no visible harm, so ``scripts/test.sh`` runs this file again under 3.12. The stub's embedded
interpreter ignores ``PYTHON*`` variables, so ``PYTHONMALLOC=debug`` cannot expose it there.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from app.embedded_triton import EmbeddedTriton
from tts_backends.cosyvoice2 import vocab

pytestmark = [pytest.mark.cosyvoice, pytest.mark.triton]

TOKENS = 12
LOG_BURST = 300

LLM_MODEL = """
import triton_python_backend_utils as pb_utils

from tts_backends.cosyvoice2 import tensors


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "request_output_len").as_numpy().reshape(-1)[0])
            sender = request.get_response_sender()
            for token in range(count):
                outputs = tensors.llm_outputs([FIRST_ID + token])
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

ORCHESTRATOR_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

from tts_backends.cosyvoice2.pipeline import LLMRequest
from tts_backends.cosyvoice2.triton_stages import StageModels, TritonStages


class TritonPythonModel:
    def initialize(self, args):
        self.stages = TritonStages(StageModels(llm="llm", audio_tokenizer="", speaker_embedding="", token2wav=""))

    def execute(self, requests):
        responses = []
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "tokens").as_numpy()[0])
            llm_request = LLMRequest(
                input_ids=[1, 2, 3], max_new_tokens=count, min_new_tokens=0, end_id=None, temperature=1.0,
                top_p=1.0, top_k=0, repetition_penalty=1.0, seed=None, streaming=True,
            )
            ids = []
            for piece in self.stages.generate(llm_request, request.is_cancelled):
                ids.extend(piece)
                if len(ids) == count:
                    for index in range(LOG_BURST):
                        pb_utils.Logger.log_info(f"burst {index}")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("ids", np.asarray(ids, dtype=np.int32))]))
        return responses
"""

LLM_CONFIG = """backend: "python"
max_batch_size: 1
model_transaction_policy { decoupled: true }
input [
  { name: "input_ids", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "input_lengths", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "request_output_len", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "streaming", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "runtime_top_k", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "runtime_top_p", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "temperature", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "repetition_penalty", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "min_length", data_type: TYPE_INT32, dims: [ 1 ], optional: true }
]
output [
  { name: "output_ids", data_type: TYPE_INT32, dims: [ -1, -1 ] },
  { name: "sequence_length", data_type: TYPE_INT32, dims: [ -1 ] }
]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""

ORCHESTRATOR_CONFIG = """backend: "python"
max_batch_size: 0
input [ { name: "tokens", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "ids", data_type: TYPE_INT32, dims: [ -1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    root = tmp_path_factory.mktemp("stage_streams")
    models = {
        "llm": (LLM_MODEL.replace("FIRST_ID", str(vocab.SPEECH_TOKEN_OFFSET)), LLM_CONFIG),
        "orchestrator": (ORCHESTRATOR_MODEL.replace("LOG_BURST", str(LOG_BURST)), ORCHESTRATOR_CONFIG),
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


def test_finished_llm_streams_are_freed_by_the_orchestrator(triton: EmbeddedTriton) -> None:
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        for _ in range(5):
            tokens = grpcclient.InferInput("tokens", [1], "INT32")
            tokens.set_data_from_numpy(np.array([TOKENS], dtype=np.int32))
            result = client.infer("orchestrator", [tokens], client_timeout=60.0)
            ids = result.as_numpy("ids")
            assert ids is not None
            assert ids.tolist() == list(range(vocab.SPEECH_TOKEN_OFFSET, vocab.SPEECH_TOKEN_OFFSET + TOKENS))
    finally:
        client.close()
    log = Path(triton.log_path).read_text(encoding="utf-8", errors="replace")
    assert "Fatal Python error" not in log
    assert "not healthy" not in log
