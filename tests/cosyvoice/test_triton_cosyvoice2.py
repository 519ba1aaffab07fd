"""End to end on a real tritonserver: the cosyvoice2-cpu profile over a tiny random-weight checkpoint.

Six models in their own Python backend processes (orchestrator twice, audio tokenizer,
speaker embedding, token2wav, PyTorch LLM) talk through BLS (the LLM's tokens over the
server's gRPC endpoint) exactly as on a GPU server; only the weights are tiny. With random
weights the audio is noise, so the checks are structural: 24 kHz, one token = 960 samples,
chunk sizes and order, determinism under a seed, isolation between concurrent streams, and
that a cancelled stream stops working.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
import tritonclient.grpc as grpcclient
from numpy.typing import NDArray
from transformers import AutoTokenizer
from tritonclient.utils import InferenceServerException

from tests.conftest import CosyVoiceServer
from tts_gateway.models import contract
from tts_gateway.paths import REFERENCE_VOICES

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.cosyvoice, pytest.mark.triton]

SAMPLES_PER_TOKEN = 960  # 2 mel frames of 480 samples at 24 kHz
FIRST_CHUNK_SAMPLES = 15 * SAMPLES_PER_TOKEN - 8 * 480  # first hop minus the withheld cross-fade tail
SHORT_TEXT = "The quick brown fox jumps over the lazy dog near the river bank today."
LONG_TEXT = " ".join([SHORT_TEXT] * 12)
# Two text tokens of the tiny tokenizer: at most 40 speech tokens, too few for a second hop (15 + 25 + 3).
TWO_CHUNK_TEXT = "Hello world"


@dataclass(frozen=True)
class Voice:
    wav: NDArray[np.float32]
    text: str


@pytest.fixture(scope="module")
def server(cosyvoice_server: CosyVoiceServer) -> CosyVoiceServer:
    return cosyvoice_server


@pytest.fixture(scope="module")
def voices() -> tuple[Voice, Voice]:
    loaded = []
    for name in ("harbor", "lumen"):
        audio, rate = sf.read(REFERENCE_VOICES / f"{name}.wav", dtype="float32", always_2d=True)
        wav = soxr.resample(audio.mean(axis=1), rate, contract.REFERENCE_SAMPLE_RATE).astype(np.float32)
        text = (REFERENCE_VOICES / f"{name}.txt").read_text(encoding="utf-8").strip()
        loaded.append(Voice(wav[: 6 * contract.REFERENCE_SAMPLE_RATE], text))
    return loaded[0], loaded[1]


def _inputs(text: str, voice: Voice, seed: int, speed: float | None = None) -> list[grpcclient.InferInput]:
    arrays: dict[str, np.ndarray] = {
        contract.TARGET_TEXT: np.array([text.encode()], dtype=np.object_),
        contract.REFERENCE_WAV: voice.wav,
        contract.REFERENCE_WAV_LEN: np.array([voice.wav.size], dtype=np.int32),
        contract.REFERENCE_TEXT: np.array([voice.text.encode()], dtype=np.object_),
        contract.SEED: np.array([seed], dtype=np.int64),
    }
    if speed is not None:
        arrays[contract.SPEED] = np.array([speed], dtype=np.float32)
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), contract.INPUT_DTYPES[name])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _offline(
    server: CosyVoiceServer, text: str, voice: Voice, seed: int, speed: float | None = None
) -> NDArray[np.float32]:
    client = grpcclient.InferenceServerClient(server.triton.grpc_url)
    try:
        result = client.infer("cosyvoice2", _inputs(text, voice, seed, speed))
    finally:
        client.close()
    return result.as_numpy(contract.WAVEFORM)


class Stream:
    """One decoupled request on its own gRPC stream; chunks arrive on a queue."""

    def __init__(self, server: CosyVoiceServer) -> None:
        self.chunks: queue.Queue[NDArray[np.float32] | BaseException | None] = queue.Queue()
        self._client = grpcclient.InferenceServerClient(server.triton.grpc_url)
        self._client.start_stream(callback=self._on_response)

    def _on_response(self, result: grpcclient.InferResult | None, error: InferenceServerException | None) -> None:
        if error is not None:
            self.chunks.put(error)
            return
        assert result is not None
        response = result.get_response()
        if response.parameters["triton_final_response"].bool_param:
            self.chunks.put(None)
            return
        self.chunks.put(result.as_numpy(contract.WAVEFORM))

    def send(self, text: str, voice: Voice, seed: int) -> None:
        self._client.async_stream_infer(
            contract.stream_model_name("cosyvoice2"),
            _inputs(text, voice, seed),
            enable_empty_final_response=True,
        )

    def next(self, timeout: float = 120.0) -> NDArray[np.float32] | None:
        item = self.chunks.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    def collect(self) -> list[NDArray[np.float32]]:
        chunks = []
        while (chunk := self.next()) is not None:
            chunks.append(chunk)
        return chunks

    def close(self, *, cancel: bool = False) -> None:
        self._client.stop_stream(cancel_requests=cancel)
        self._client.close()


def _stream(server: CosyVoiceServer, text: str, voice: Voice, seed: int) -> list[NDArray[np.float32]]:
    stream = Stream(server)
    try:
        stream.send(text, voice, seed)
        return stream.collect()
    finally:
        stream.close()


def _token_bounds(server: CosyVoiceServer, text: str) -> tuple[int, int]:
    tokens = len(AutoTokenizer.from_pretrained(server.tiny.llm_dir).encode(text))
    return 2 * tokens, 20 * tokens


def _executions(server: CosyVoiceServer, model: str) -> int:
    client = grpcclient.InferenceServerClient(server.triton.grpc_url)
    try:
        stats = client.get_inference_statistics(model, as_json=True)
    finally:
        client.close()
    return int(stats["model_stats"][0]["inference_stats"]["success"].get("count", 0))


def test_models_declare_the_contract_capabilities(server: CosyVoiceServer) -> None:
    client = grpcclient.InferenceServerClient(server.triton.grpc_url)
    try:
        for name in ("cosyvoice2", "cosyvoice2_stream"):
            params = client.get_model_config(name, as_json=True)["config"]["parameters"]
            assert params[contract.PARAM_SAMPLE_RATE]["string_value"] == "24000"
            assert params[contract.PARAM_SUPPORTS_CLONING]["string_value"] == "true"
    finally:
        client.close()


def test_offline_request_returns_whole_tokens_of_24khz_audio(
    server: CosyVoiceServer, voices: tuple[Voice, Voice]
) -> None:
    wav = _offline(server, SHORT_TEXT, voices[0], seed=11)
    low, high = _token_bounds(server, SHORT_TEXT)
    assert wav.dtype == np.float32 and wav.ndim == 1
    assert wav.size % SAMPLES_PER_TOKEN == 0
    assert low * SAMPLES_PER_TOKEN <= wav.size <= high * SAMPLES_PER_TOKEN
    assert np.isfinite(wav).all() and float(np.std(wav)) > 0.0
    # Same seed, same audio: the LLM, the flow noise and the vocoder are all seeded.
    assert np.array_equal(wav, _offline(server, SHORT_TEXT, voices[0], seed=11))


def test_speed_changes_the_duration(server: CosyVoiceServer, voices: tuple[Voice, Voice]) -> None:
    normal = _offline(server, SHORT_TEXT, voices[0], seed=5)
    fast = _offline(server, SHORT_TEXT, voices[0], seed=5, speed=2.0)
    assert abs(fast.size - normal.size / 2) <= 480


def test_stream_chunks_arrive_in_order_and_add_up(server: CosyVoiceServer, voices: tuple[Voice, Voice]) -> None:
    chunks = _stream(server, SHORT_TEXT, voices[0], seed=11)
    offline = _offline(server, SHORT_TEXT, voices[0], seed=11)

    assert len(chunks) >= 2
    assert chunks[0].size == FIRST_CHUNK_SAMPLES
    # Chunk 2 converts a hop of the schedule's ladder (25, 50 or 100 tokens: as many as arrived
    # while the first was converted) when those and 3 look-ahead tokens exist; or, once the LLM
    # has finished, it is the final chunk: the remaining tokens plus the withheld tail.
    tokens = offline.size // SAMPLES_PER_TOKEN
    tail = 8 * 480
    hops = {hop * SAMPLES_PER_TOKEN for hop in (25, 50, 100) if 15 + hop + 3 <= tokens}
    assert chunks[1].size in hops | {(tokens - 15) * SAMPLES_PER_TOKEN + tail}
    # Seeded generation yields the same tokens streamed or not: the same amount of audio.
    assert sum(chunk.size for chunk in chunks) == offline.size


def test_concurrent_streams_with_different_voices_do_not_share_state(
    server: CosyVoiceServer, voices: tuple[Voice, Voice]
) -> None:
    # Where a stream's later chunks are cut depends on how many tokens arrived meanwhile (catch-up),
    # and the cuts shape the audio at the joins. TWO_CHUNK_TEXT's 40 tokens make a first chunk and
    # a final one whatever the timing, so concurrent and solo streams must match exactly.
    solo_chunks = [_stream(server, TWO_CHUNK_TEXT, voice, seed=21 + i) for i, voice in enumerate(voices)]
    assert [len(chunks) for chunks in solo_chunks] == [2, 2]
    solo = [np.concatenate(chunks) for chunks in solo_chunks]

    results: list[list[NDArray[np.float32]] | None] = [None, None]

    def run(index: int) -> None:
        results[index] = _stream(server, TWO_CHUNK_TEXT, voices[index], seed=21 + index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    together = [np.concatenate(chunks) for chunks in results if chunks is not None]

    assert len(together) == 2
    assert not np.array_equal(solo[0][: solo[1].size], solo[1][: solo[0].size])
    for alone, concurrent in zip(solo, together, strict=True):
        np.testing.assert_allclose(concurrent, alone, atol=1e-5)


def test_cancelled_stream_stops_converting(server: CosyVoiceServer, voices: tuple[Voice, Voice]) -> None:
    before = _executions(server, "token2wav")
    stream = Stream(server)
    stream.send(LONG_TEXT, voices[1], seed=3)
    first = stream.next()
    assert first is not None and first.size == FIRST_CHUNK_SAMPLES
    stream.close(cancel=True)

    time.sleep(3.0)
    settled = _executions(server, "token2wav")
    time.sleep(3.0)
    assert _executions(server, "token2wav") == settled
    # The long text needs at least 2 * its tokens, i.e. seven or more chunks; the cancelled
    # stream ran the first (and at most the one under way) plus the session release.
    low, _ = _token_bounds(server, LONG_TEXT)
    assert low >= 400
    assert settled - before <= 3

    # The server is free again: a new request completes.
    assert _offline(server, SHORT_TEXT, voices[0], seed=1).size > 0


def _llm_ids(server: CosyVoiceServer, *, streaming: bool) -> list[list[int]]:
    """The ids of each response of the ``llm`` model to one seeded request (its TensorRT-LLM tensors)."""
    from tts_gateway.models.cosyvoice2 import tensors
    from tts_gateway.models.cosyvoice2.model import vocab
    from tts_gateway.models.cosyvoice2.orchestrator.pipeline import LLMRequest

    request = LLMRequest(
        input_ids=[vocab.SOS_ID, 300, 301, 302, vocab.TASK_ID_ID],
        max_new_tokens=40,
        min_new_tokens=40,
        end_id=None,
        temperature=0.8,
        top_p=0.95,
        top_k=50,
        repetition_penalty=1.1,
        seed=11,
        streaming=streaming,
    )
    responses: queue.Queue[grpcclient.InferResult | InferenceServerException] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.triton.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put(error or result))
    try:
        inputs = []
        for name, array in tensors.llm_inputs(request).items():
            tensor = grpcclient.InferInput(name, list(array.shape), tensors.LLM_INPUT_DTYPES[name])
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
        ids = []
        while True:
            item = responses.get(timeout=120)
            if isinstance(item, InferenceServerException):
                raise item
            if item.get_response().parameters["triton_final_response"].bool_param:
                return ids
            ids.append(tensors.parse_llm_outputs(item.as_numpy("output_ids"), item.as_numpy("sequence_length")))
    finally:
        client.stop_stream()
        client.close()


def test_the_llm_streams_its_tokens_in_order_each_response_carrying_new_ones(server: CosyVoiceServer) -> None:
    """What the orchestrator reads: streamed, a response per token (several share one when the lane is behind)."""
    whole = _llm_ids(server, streaming=False)
    streamed = _llm_ids(server, streaming=True)
    assert len(whole) == 1 and len(whole[0]) == 40
    assert all(streamed)
    assert [token for response in streamed for token in response] == whole[0]


def test_token2wav_answers_each_call_of_a_batch_on_its_own(server: CosyVoiceServer) -> None:
    """Calls sent together: the good ones get their audio, the one out of step its own error."""
    from tts_gateway.models.cosyvoice2 import tensors
    from tts_gateway.models.cosyvoice2.model.frontend import VoicePrompt
    from tts_gateway.models.cosyvoice2.orchestrator.pipeline import Token2WavRequest

    rng = np.random.default_rng(0)
    prompt = VoicePrompt(
        speech_tokens=rng.integers(0, 6561, 10),
        feats=rng.standard_normal((20, 80)).astype(np.float32),
        embedding=rng.standard_normal(192).astype(np.float32),
    )
    requests = {
        "offline": Token2WavRequest("batch-offline", rng.integers(0, 6561, 40), prompt, None, True, 1.0),
        "first": Token2WavRequest("batch-first", rng.integers(0, 6561, 18), prompt, 0, True, 1.0),
        "unknown": Token2WavRequest("batch-unknown", rng.integers(0, 6561, 30), prompt, 12, False, 1.0),
    }
    results: queue.Queue[tuple[str, grpcclient.InferResult | None, InferenceServerException | None]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.triton.grpc_url)
    try:
        for name, request in requests.items():
            inputs = []
            for key, array in tensors.token2wav_inputs(request).items():
                tensor = grpcclient.InferInput(key, list(array.shape), tensors.TOKEN2WAV_INPUT_DTYPES[key])
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            client.async_infer("token2wav", inputs, lambda result, error, name=name: results.put((name, result, error)))
        answers = {name: (result, error) for name, result, error in (results.get(timeout=120) for _ in requests)}
    finally:
        client.close()
    for name, tokens in (("offline", 40), ("first", 18)):
        result, error = answers[name]
        assert error is None and result is not None, error
        assert result.as_numpy(tensors.WAVEFORM_OUTPUT).size == tokens * SAMPLES_PER_TOKEN
    _, error = answers["unknown"]
    assert error is not None and "no streaming state" in error.message()


def test_the_models_write_their_load_phases_to_the_server_log(server: CosyVoiceServer) -> None:
    """The backends' log records reach Triton's log, named by model; the benchmark reads the start from them."""
    from benchmarks.server_startup import load_timeline

    log = Path(server.triton.log_path).read_text(encoding="utf-8", errors="replace")
    assert (
        "token2wav: tts_gateway.models.cosyvoice2.engines.token2wav: flow and HiFT weights loaded onto cpu in " in log
    )
    assert "llm: tts_gateway.models.cosyvoice2.engines.llm: LLM weights loaded onto cpu in " in log
    timeline = load_timeline(log)
    weights = next(i for i, event in enumerate(timeline) if "token2wav: flow and HiFT weights loaded" in event)
    loaded = timeline.index(next(event for event in timeline if event.endswith(" token2wav: loaded")))
    assert weights < loaded
    assert all(event.startswith("+") for event in timeline)
