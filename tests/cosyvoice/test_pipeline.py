"""The orchestration logic against in-process stages: prompts, lengths, chunking, sessions, cancel.

The stages here are scripted (the LLM replays a fixed id sequence, token2wav returns one
sample per token) so that every call the pipeline makes can be checked exactly; the real
models behind the same protocol are exercised in ``test_triton_cosyvoice2.py``. The pipeline
reads a stream's tokens on a thread of its own; the scripted LLM is paced against token2wav
(``first_ids``, ``ids_per_conversion``) so that what has arrived at each chunk is known.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from tts_gateway.models.cosyvoice2.model import vocab
from tts_gateway.models.cosyvoice2.model.frontend import VoicePrompt
from tts_gateway.models.cosyvoice2.orchestrator.pipeline import (
    CosyVoice2Pipeline,
    LLMRequest,
    PipelineSettings,
    SamplingDefaults,
    SynthesisError,
    Token2WavRequest,
)
from tts_gateway.models.cosyvoice2.orchestrator.streaming import HopPolicy, HopSchedule
from tts_gateway.models.request_parsing import ContractError, DependencyUnavailableError, SynthesisRequest
from tts_gateway.models.stage_trace import StageTrace, read_traces

pytestmark = pytest.mark.cosyvoice

PROMPT_TOKENS = np.array([5, 6, 7, 8], dtype=np.int64)
TIMEOUT_S = 10.0


class CodePointTokenizer:
    """One id per character: prompt ids and text lengths are easy to predict."""

    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]

    def get_added_vocab(self) -> dict[str, int]:
        return {}

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int]:
        raise NotImplementedError


@dataclass
class ScriptedStages:
    """Replays ``llm_ids`` one id per piece; token2wav returns its token count as samples.

    Unpaced (``first_ids`` None) the LLM is infinitely fast: each token2wav call returns once the
    pipeline's reader has taken the whole script. Paced, the LLM hands out ``first_ids`` ids, then
    ``ids_per_conversion`` more during each token2wav call, which returns once the reader has taken
    them: at every decision after the first chunk, exactly those ids have arrived. A paced LLM waits
    for its next allowance until ``is_cancelled`` (which the pipeline also sets when it stops
    reading) says to stop. At id ``fail_at`` the LLM fails.
    """

    llm_ids: list[int]
    first_ids: int | None = None
    ids_per_conversion: int = 0
    fail_at: int | None = None
    voice_prompts: list[NDArray[np.float32]] = field(default_factory=list)
    llm_requests: list[LLMRequest] = field(default_factory=list)
    token2wav_calls: list[Token2WavRequest] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    generator_closed: bool = False
    pieces_served: int = 0
    _allowed: float = 0.0
    _waiting_at: int | None = None
    _gate: threading.Condition = field(default_factory=threading.Condition)

    def voice_prompt(self, reference_wav: NDArray[np.float32]) -> VoicePrompt:
        self.voice_prompts.append(reference_wav)
        return VoicePrompt(
            speech_tokens=PROMPT_TOKENS,
            feats=np.zeros((2 * PROMPT_TOKENS.size, 80), dtype=np.float32),
            embedding=np.ones(192, dtype=np.float32),
        )

    def generate(self, request: LLMRequest, is_cancelled: Callable[[], bool]) -> Generator[Sequence[int], None, None]:
        self.llm_requests.append(request)
        with self._gate:
            self._allowed = math.inf if self.first_ids is None else self.first_ids
            self.generator_closed = False
        try:
            for index, llm_id in enumerate(self.llm_ids):
                if index == self.fail_at:
                    raise RuntimeError("the LLM went away")
                with self._gate:
                    self._waiting_at = index
                    self._gate.notify_all()
                    while index >= self._allowed:
                        if is_cancelled():
                            return
                        self._gate.wait(0.005)
                    self._waiting_at = None
                    self.pieces_served += 1
                yield [llm_id]
        finally:
            with self._gate:
                self.generator_closed = True
                self._gate.notify_all()

    def token2wav(self, request: Token2WavRequest) -> NDArray[np.float32]:
        self.token2wav_calls.append(request)
        with self._gate:
            self._allowed += self.ids_per_conversion
            self._gate.notify_all()
            # Wait until the reader has taken every id allowed: the generator then waits at the next.
            arrived = self._gate.wait_for(
                lambda: self.generator_closed or self._waiting_at == self._allowed, timeout=TIMEOUT_S
            )
            assert arrived, "the pipeline's reader stopped taking ids"
            ended = self.generator_closed
        if ended:
            # The script has ended: let the reader (named after the session) record that too.
            for thread in threading.enumerate():
                if thread.name == f"tokens-{request.session_id[:8]}":
                    thread.join(TIMEOUT_S)
        start = 0 if request.token_offset is None else request.token_offset
        return np.full(request.speech_tokens.size - start, 0.5, dtype=np.float32)

    def release(self, session_id: str) -> None:
        self.released.append(session_id)

    def wait_until_closed(self) -> bool:
        with self._gate:
            return self._gate.wait_for(lambda: self.generator_closed, timeout=TIMEOUT_S)


def speech_ids(count: int, *, start: int = 0) -> list[int]:
    return [vocab.speech_token_to_id((start + i) % vocab.SPEECH_TOKEN_SIZE) for i in range(count)]


def settings(**overrides: object) -> PipelineSettings:
    values: dict[str, object] = {
        "sampling": SamplingDefaults(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1),
        "hop_schedule": HopSchedule(first_hop=15, base_hop=25, policy=HopPolicy.EXPONENTIAL, max_hop=100),
        "min_token_text_ratio": 2.0,
        "max_token_text_ratio": 20.0,
        "max_output_tokens": 1000,
        "voice_cache_size": 4,
    }
    values.update(overrides)
    return PipelineSettings(**values)  # type: ignore[arg-type]


def request(**overrides: object) -> SynthesisRequest:
    values: dict[str, object] = {
        "target_text": "hello there",
        "reference_wav": np.linspace(-0.5, 0.5, 16_000, dtype=np.float32),
        "reference_text": "ref",
    }
    values.update(overrides)
    return SynthesisRequest(**values)  # type: ignore[arg-type]


def pipeline(stages: ScriptedStages, **setting_overrides: object) -> CosyVoice2Pipeline:
    return CosyVoice2Pipeline(stages, CodePointTokenizer(), settings(**setting_overrides))


def test_offline_converts_every_token_in_one_call() -> None:
    stages = ScriptedStages([*speech_ids(40), vocab.EOS1_ID, *speech_ids(5)])
    chunks = list(pipeline(stages).synthesize(request(speed=1.5), streaming=False))

    assert [chunk.size for chunk in chunks] == [40]
    (call,) = stages.token2wav_calls
    assert call.token_offset is None and call.finalize
    assert call.speed == 1.5
    assert call.speech_tokens.tolist() == list(range(40))
    assert call.prompt.speech_tokens is PROMPT_TOKENS
    assert stages.released == []


def test_llm_request_carries_prompt_lengths_and_sampling() -> None:
    stages = ScriptedStages(speech_ids(3))
    list(pipeline(stages).synthesize(request(seed=7, temperature=0.5, top_k=10), streaming=False))

    (llm,) = stages.llm_requests
    text_ids = [vocab.SOS_ID, *CodePointTokenizer().encode("ref" + "hello there"), vocab.TASK_ID_ID]
    assert llm.input_ids == text_ids + vocab.speech_tokens_to_ids(PROMPT_TOKENS)
    # 11 target characters: at least 2x, at most 20x the text tokens.
    assert (llm.min_new_tokens, llm.max_new_tokens) == (22, 220)
    assert llm.end_id == vocab.EOS1_ID
    assert (llm.seed, llm.temperature, llm.top_k) == (7, 0.5, 10)
    assert (llm.top_p, llm.repetition_penalty) == (0.95, 1.1)
    assert not llm.streaming


def test_output_length_is_capped_and_seeds_differ_when_not_given() -> None:
    stages = ScriptedStages(speech_ids(3))
    runner = pipeline(stages, max_output_tokens=50)
    for _ in range(2):
        list(runner.synthesize(request(), streaming=True))
    first, second = stages.llm_requests
    assert first.max_new_tokens == 50 and first.min_new_tokens == 22
    assert first.streaming
    assert first.seed is not None and second.seed is not None and first.seed != second.seed


def test_instructions_take_the_transcripts_place() -> None:
    stages = ScriptedStages(speech_ids(3))
    list(pipeline(stages).synthesize(request(instructions="calm"), streaming=False))
    (llm,) = stages.llm_requests
    tokenizer = CodePointTokenizer()
    assert llm.input_ids == [
        vocab.SOS_ID,
        *tokenizer.encode("calm"),
        vocab.ENDOFPROMPT_ID,
        *tokenizer.encode("hello there"),
        vocab.TASK_ID_ID,
    ]
    assert stages.token2wav_calls[0].prompt.speech_tokens is PROMPT_TOKENS


def test_without_transcript_the_llm_gets_no_voice_prefix() -> None:
    stages = ScriptedStages(speech_ids(3))
    list(pipeline(stages).synthesize(request(reference_text=None), streaming=False))
    (llm,) = stages.llm_requests
    assert llm.input_ids == [vocab.SOS_ID, *CodePointTokenizer().encode("hello there"), vocab.TASK_ID_ID]
    # The voice still shapes the audio through the flow prompt.
    assert stages.token2wav_calls[0].prompt.speech_tokens is PROMPT_TOKENS


def test_streaming_follows_the_hop_schedule_without_catching_up() -> None:
    stages = ScriptedStages([*speech_ids(100), vocab.EOS1_ID])
    no_catch_up = HopSchedule(first_hop=15, base_hop=25, policy=HopPolicy.EXPONENTIAL, max_hop=100, catch_up=False)
    chunks = list(pipeline(stages, hop_schedule=no_catch_up).synthesize(request(), streaming=True))

    calls = [(c.token_offset, c.speech_tokens.size, c.finalize) for c in stages.token2wav_calls]
    # Hops 15, 25, 50 (each needs 3 look-ahead tokens), then the rest on finalize.
    assert calls == [(0, 18, False), (15, 43, False), (40, 93, False), (90, 100, True)]
    assert len({c.session_id for c in stages.token2wav_calls}) == 1
    for call in stages.token2wav_calls:
        assert call.speech_tokens.tolist() == list(range(call.speech_tokens.size))
    assert [chunk.size for chunk in chunks] == [18, 28, 53, 10]
    assert stages.released == []


def test_once_the_llm_has_finished_the_next_chunk_is_the_last() -> None:
    # The LLM finishes while the first chunk is converted: the rest goes in one final chunk.
    stages = ScriptedStages([*speech_ids(100), vocab.EOS1_ID])
    chunks = list(pipeline(stages).synthesize(request(), streaming=True))

    calls = [(c.token_offset, c.speech_tokens.size, c.finalize) for c in stages.token2wav_calls]
    assert calls == [(0, 18, False), (15, 100, True)]
    assert stages.token2wav_calls[1].speech_tokens.tolist() == list(range(100))
    assert [chunk.size for chunk in chunks] == [18, 85]


def test_a_chunk_takes_the_largest_hop_that_arrived_tokens_cover() -> None:
    # 100 ids arrive during each conversion: chunk 2 jumps from its hop of 25 to the cap of 100.
    stages = ScriptedStages([*speech_ids(300), vocab.EOS1_ID], first_ids=18, ids_per_conversion=100)
    chunks = list(pipeline(stages).synthesize(request(), streaming=True))

    calls = [(c.token_offset, c.speech_tokens.size, c.finalize) for c in stages.token2wav_calls]
    assert calls == [(0, 18, False), (15, 118, False), (115, 218, False), (215, 300, True)]
    # The scripted token2wav answers a sample per token from the offset on, look-ahead included.
    assert [chunk.size for chunk in chunks] == [18, 103, 103, 85]


def test_a_chunk_stays_on_the_schedules_ladder() -> None:
    # 60 ids arrive during each conversion: hops 25 and 50 become 50 (100 is not covered yet).
    stages = ScriptedStages([*speech_ids(190), vocab.EOS1_ID], first_ids=18, ids_per_conversion=60)
    list(pipeline(stages).synthesize(request(), streaming=True))

    calls = [(c.token_offset, c.speech_tokens.size, c.finalize) for c in stages.token2wav_calls]
    assert calls == [(0, 18, False), (15, 68, False), (65, 118, False), (115, 190, True)]


@dataclass
class SlowSecondChunk(ScriptedStages):
    """A token2wav that takes ``delay_s`` for each stream's second chunk."""

    delay_s: float = 0.0

    def token2wav(self, request: Token2WavRequest) -> NDArray[np.float32]:
        if request.token_offset:
            time.sleep(self.delay_s)
        return super().token2wav(request)


def first_hops_of(stages: ScriptedStages, schedule: HopSchedule, streams: int) -> list[int]:
    """The first chunk's hop of each of ``streams`` streams of one pipeline, one after another."""
    synthesizer = pipeline(stages, hop_schedule=schedule)
    hops = []
    for _ in range(streams):
        stages.token2wav_calls.clear()
        list(synthesizer.synthesize(request(), streaming=True))
        hops.append(stages.token2wav_calls[1].token_offset)
    return hops


def test_the_first_hop_grows_after_streams_waited_longer_than_their_first_chunk_plays() -> None:
    # A first chunk of 15 tokens plays 0.6 - 0.16 = 0.44 s; the second chunks come 0.6 s after it.
    schedule = HopSchedule(first_hop=15, base_hop=25, max_hop=100, max_first_hop=30)
    stages = SlowSecondChunk([*speech_ids(100), vocab.EOS1_ID], delay_s=0.6)
    assert first_hops_of(stages, schedule, 3) == [15, 30, 30]


def test_the_first_hop_stays_while_second_chunks_come_in_time() -> None:
    schedule = HopSchedule(first_hop=15, base_hop=25, max_hop=100, max_first_hop=30)
    assert first_hops_of(ScriptedStages([*speech_ids(100), vocab.EOS1_ID]), schedule, 3) == [15, 15, 15]
    # Without max_first_hop the gaps do not matter.
    fixed = HopSchedule(first_hop=15, base_hop=25, max_hop=100)
    assert first_hops_of(SlowSecondChunk([*speech_ids(100), vocab.EOS1_ID], delay_s=0.6), fixed, 2) == [15, 15]


@dataclass
class BurstDuringFirstTokens(ScriptedStages):
    """Calls ``meanwhile`` just before the LLM hands out the id at index ``meanwhile_at``."""

    meanwhile: Callable[[], None] = lambda: None
    meanwhile_at: int = 0

    def generate(self, request: LLMRequest, is_cancelled: Callable[[], bool]) -> Generator[Sequence[int], None, None]:
        for index, piece in enumerate(super().generate(request, is_cancelled)):
            if index == self.meanwhile_at:
                self.meanwhile()
            yield piece


def test_a_first_chunk_waits_for_the_larger_hop_when_streams_start_meanwhile() -> None:
    schedule = HopSchedule(first_hop=15, base_hop=25, max_hop=100, max_first_hop=30)
    stages = BurstDuringFirstTokens([*speech_ids(100), vocab.EOS1_ID], meanwhile_at=17)
    synthesizer = pipeline(stages, hop_schedule=schedule)
    hops = synthesizer.adaptive_first_hop
    assert hops is not None
    hops.begin()
    hops.record(0.3)  # one stream in flight waited 0.3 s for its second chunk
    hops.end()

    def two_streams_start() -> None:
        # After this stream counted itself in (and chose 15 tokens), before its 18th token arrives.
        deadline = time.monotonic() + TIMEOUT_S
        while hops.in_flight < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        hops.begin()
        hops.begin()

    stages.meanwhile = two_streams_start
    list(synthesizer.synthesize(request(), streaming=True))

    # Three streams in flight: 0.3 x sqrt(3) = 0.52 s expected, past the 0.44 s that 15 tokens play.
    first = stages.token2wav_calls[0]
    assert (first.token_offset, first.speech_tokens.size, first.finalize) == (0, 33, False)
    assert hops.in_flight == 2, "the stream counted itself out when it ended"


@pytest.mark.parametrize("how", ["cancelled", "llm fails", "reader stops"])
def test_a_stream_that_ends_early_is_counted_out(how: str) -> None:
    schedule = HopSchedule(first_hop=15, base_hop=25, max_hop=100, max_first_hop=30)
    stages = ScriptedStages(
        speech_ids(200), first_ids=18, ids_per_conversion=100, fail_at=60 if how == "llm fails" else None
    )
    synthesizer = pipeline(stages, hop_schedule=schedule)
    cancelled = threading.Event()
    chunks = synthesizer.synthesize(request(), streaming=True, is_cancelled=cancelled.is_set)
    next(chunks)
    assert synthesizer.adaptive_first_hop is not None
    assert synthesizer.adaptive_first_hop.in_flight == 1
    if how == "cancelled":
        cancelled.set()
        assert list(chunks) == []
    elif how == "llm fails":
        with pytest.raises(RuntimeError, match="the LLM went away"):
            next(chunks)
    else:
        chunks.close()
    assert synthesizer.adaptive_first_hop.in_flight == 0


def test_an_llm_that_fails_mid_stream_fails_the_request_after_the_chunks_before() -> None:
    stages = ScriptedStages(speech_ids(200), first_ids=18, ids_per_conversion=100, fail_at=60)
    chunks = pipeline(stages).synthesize(request(), streaming=True)
    assert next(chunks).size == 18
    with pytest.raises(RuntimeError, match="the LLM went away"):
        next(chunks)
    assert len(stages.token2wav_calls) == 1
    assert stages.generator_closed
    assert stages.released == [stages.token2wav_calls[0].session_id]


def test_an_llm_that_goes_silent_fails_the_stream_as_unavailable_after_the_stall_time() -> None:
    # 10 ids, then nothing: the first hop (15) is never reached and the LLM never ends.
    stages = ScriptedStages(speech_ids(200), first_ids=10)
    chunks = pipeline(stages, llm_stall_s=0.3).synthesize(request(), streaming=True)
    started = time.monotonic()
    with pytest.raises(DependencyUnavailableError, match=r"the LLM sent nothing for 0\.3 s"):
        next(chunks)
    assert 0.25 <= time.monotonic() - started < 5.0
    assert stages.token2wav_calls == []
    # The reader was told to stop, and the LLM's stream was closed.
    assert stages.wait_until_closed()


def test_a_stream_with_a_tempo_change_is_converted_in_one_piece() -> None:
    stages = ScriptedStages(speech_ids(100))
    chunks = list(pipeline(stages).synthesize(request(speed=0.8), streaming=True))
    assert len(chunks) == 1
    (call,) = stages.token2wav_calls
    assert (call.token_offset, call.speed, call.speech_tokens.size) == (None, 0.8, 100)


def test_a_short_stream_is_one_final_chunk() -> None:
    stages = ScriptedStages(speech_ids(10))
    chunks = list(pipeline(stages).synthesize(request(), streaming=True))
    assert len(chunks) == 1
    (call,) = stages.token2wav_calls
    assert (call.token_offset, call.finalize, call.speech_tokens.size) == (0, True, 10)


def test_every_request_gets_its_own_session() -> None:
    stages = ScriptedStages(speech_ids(30))
    runner = pipeline(stages)
    list(runner.synthesize(request(), streaming=True))
    list(runner.synthesize(request(), streaming=True))
    sessions = [c.session_id for c in stages.token2wav_calls]
    assert len(sessions) == 4
    assert sessions[0] == sessions[1] != sessions[2] == sessions[3]


def test_a_non_speech_id_ends_the_utterance() -> None:
    stages = ScriptedStages([*speech_ids(5), 42, *speech_ids(5)])
    list(pipeline(stages).synthesize(request(), streaming=False))
    assert stages.token2wav_calls[0].speech_tokens.size == 5
    assert stages.generator_closed


def test_cancellation_stops_generation_and_releases_the_session() -> None:
    stages = ScriptedStages(speech_ids(500), first_ids=20, ids_per_conversion=5)
    cancelled = False
    chunks = pipeline(stages).synthesize(request(), streaming=True, is_cancelled=lambda: cancelled)

    first = next(chunks)
    cancelled = True
    assert list(chunks) == []

    assert first.size == 18
    assert len(stages.token2wav_calls) == 1
    assert stages.wait_until_closed()
    assert stages.pieces_served == 25
    assert stages.released == [stages.token2wav_calls[0].session_id]


def test_a_consumer_that_stops_reading_releases_the_session() -> None:
    stages = ScriptedStages(speech_ids(500), first_ids=20, ids_per_conversion=5)
    chunks = pipeline(stages).synthesize(request(), streaming=True)
    next(chunks)
    chunks.close()
    assert stages.wait_until_closed()
    assert stages.pieces_served == 25
    assert stages.released == [stages.token2wav_calls[0].session_id]


def test_cancelled_offline_request_never_reaches_token2wav() -> None:
    stages = ScriptedStages(speech_ids(50))
    out = list(pipeline(stages).synthesize(request(), streaming=False, is_cancelled=lambda: stages.pieces_served >= 10))
    assert out == []
    assert stages.token2wav_calls == []


def test_voice_prompts_are_cached_per_recording() -> None:
    stages = ScriptedStages(speech_ids(3))
    runner = pipeline(stages, voice_cache_size=1)
    wav_a = np.full(1600, 0.1, dtype=np.float32)
    wav_b = np.full(1600, 0.2, dtype=np.float32)
    for wav in (wav_a, wav_a.copy(), wav_b, wav_a):
        list(runner.synthesize(request(reference_wav=wav), streaming=False))
    # a (built), a (cached), b (built, evicts a), a (built again).
    assert len(stages.voice_prompts) == 3


def test_missing_reference_is_the_callers_error() -> None:
    stages = ScriptedStages(speech_ids(3))
    with pytest.raises(ContractError, match="reference_wav"):
        list(pipeline(stages).synthesize(request(reference_wav=None, reference_text=None), streaming=False))
    assert stages.llm_requests == []


@pytest.mark.parametrize("streaming", [False, True])
def test_no_speech_is_an_internal_error(streaming: bool) -> None:
    stages = ScriptedStages([vocab.EOS1_ID])
    with pytest.raises(SynthesisError):
        list(pipeline(stages).synthesize(request(), streaming=streaming))


def test_settings_from_parameters() -> None:
    params = {
        "temperature": "0.7",
        "top_p": "0.9",
        "top_k": "25",
        "repetition_penalty": "1.05",
        "first_hop_tokens": "10",
        "base_hop_tokens": "20",
        "hop_policy": "fixed",
        "max_hop_tokens": "0",
        "hop_catch_up": "false",
        "max_first_hop_tokens": "0",
        "min_token_text_ratio": "2",
        "max_token_text_ratio": "20",
        "max_output_tokens": "750",
        "voice_cache_size": "8",
        "llm_stall_timeout_s": "45",
    }
    parsed = PipelineSettings.from_parameters(params)
    assert parsed.sampling == SamplingDefaults(0.7, 0.9, 25, 1.05)
    assert parsed.hop_schedule == HopSchedule(
        first_hop=10, base_hop=20, policy=HopPolicy.FIXED, max_hop=None, catch_up=False
    )
    assert parsed.max_output_tokens == 750
    assert parsed.llm_stall_s == 45.0
    grown = PipelineSettings.from_parameters({**params, "max_first_hop_tokens": "40"})
    assert grown.hop_schedule.max_first_hop == 40
    with pytest.raises(ValueError, match="top_k"):
        PipelineSettings.from_parameters({k: v for k, v in params.items() if k != "top_k"})
    with pytest.raises(ValueError):
        PipelineSettings.from_parameters({**params, "hop_policy": "sometimes"})
    with pytest.raises(ValueError, match="not a boolean"):
        PipelineSettings.from_parameters({**params, "hop_catch_up": "often"})


@pytest.mark.parametrize("text_stream", [False, True])
def test_a_traced_stream_records_when_it_reached_each_stage(tmp_path: Path, text_stream: bool) -> None:
    """The benchmarks break first chunks down by stage from these records (benchmarks/gpu_stages.py)."""
    stages = ScriptedStages([*speech_ids(60), vocab.EOS1_ID])
    traced = CosyVoice2Pipeline(stages, CodePointTokenizer(), settings(), StageTrace("orchestrator", tmp_path))
    synthesis = request(request_id="triton-7")
    if text_stream:
        chunks = list(traced.synthesize_text_stream(synthesis, "stream-1"))
    else:
        chunks = list(traced.synthesize(synthesis, streaming=True))
    assert len(chunks) > 1
    (event,) = read_traces(tmp_path)
    assert event["key"] == stages.llm_requests[0].request_id == stages.token2wav_calls[0].session_id
    assert event["request"] == "triton-7"
    names = ("started", "prompt_ready", "first_token", "first_hop", "first_chunk")
    times = [float(str(event[name])) for name in names]
    assert times == sorted(times) and times[0] > 0
    assert event["first_hop_tokens"] == 15
    assert (event.get("text_stream") == 1) is text_stream
