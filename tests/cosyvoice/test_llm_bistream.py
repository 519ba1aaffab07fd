"""Text streams ("bistream") on the tiny CosyVoice2 LLM, against upstream's ``Qwen2LM.inference_bistream``.

Upstream's ``Qwen2LM`` is built from the reference package (var/reference) around the same HF weights:
its ``llm_embedding`` rows are ``<|sos|>`` and ``<|task_id|>``, its ``speech_embedding`` and
``llm_decoder`` the speech rows and the three after them (the inverse of upstream's HF conversion).
Both decode greedily; upstream is fed the text one token at a time, as its frontend does.

A random model rarely draws the fill token on its own, and upstream waits for that first fill before it
forces one after every 15 speech tokens. The fill row's bias is therefore raised (``FILL_BIAS``) until
the tiny model ends its first round by itself after a few tokens; the tests check that it did.

Two stand-ins keep upstream's module importable and runnable here: ``cosyvoice.utils.file_utils``
(it imports torchaudio, for audio loading this path never uses; a module with the standard logger
stands in) and a transformers cache that still answers ``cache[0][0]`` (upstream reads the cache
length that way; current transformers caches are not indexable).
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, Qwen2ForCausalLM

from tests.cosyvoice.test_llm_engine import FailsOnToken, Recorder
from tts_gateway.models.cosyvoice2.checkpoints import tiny_frontend
from tts_gateway.models.cosyvoice2.engines import llm_engine
from tts_gateway.models.cosyvoice2.engines.llm import SamplingParams, TorchSpeechLLM
from tts_gateway.models.cosyvoice2.engines.llm_bistream import FILL_ID, SPEECH_PER_ROUND
from tts_gateway.models.cosyvoice2.engines.llm_engine import TextStreamHandle
from tts_gateway.models.cosyvoice2.model import vocab

pytestmark = [pytest.mark.cosyvoice, pytest.mark.usefixtures("one_torch_thread")]

GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0)
FILL_BIAS = 1.99
TOKENS = 120
PROMPT_TEXT = [1000 + 7 * k for k in range(6)]
PROMPT_SPEECH = [(37 * k + 11) % vocab.SPEECH_TOKEN_SIZE for k in range(20)]
TEXT = [2000 + 13 * k for k in range(41)]


class _IndexableCache(DynamicCache):
    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer].keys, self.layers[layer].values


def write_llm_that_fills(directory: Path) -> Path:
    """The tiny LLM with the fill row's bias raised: it ends its first round by itself (see above)."""
    tiny_frontend.write_tiny_llm(directory)
    weights = load_file(directory / "model.safetensors")
    weights["lm_head.bias"][FILL_ID] = FILL_BIAS
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llm_that_fills(tmp_path_factory.mktemp("llm") / "cosyvoice2_llm")


@pytest.fixture(scope="module", params=["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def llm(llm_dir: Path, request: pytest.FixtureRequest) -> Iterator[TorchSpeechLLM]:
    """On a GPU host also on CUDA, where extend passes and decode steps replay recorded graphs."""
    model = TorchSpeechLLM(llm_dir, device=request.param, max_slots=2, max_seq_len=512)
    yield model
    model.close()


@pytest.fixture(scope="module")
def upstream(llm_dir: Path, reference_dir: Path) -> Any:
    stand_in = types.ModuleType("cosyvoice.utils.file_utils")
    stand_in.logging = logging  # type: ignore[attr-defined]
    added = "cosyvoice.utils.file_utils" not in sys.modules
    sys.modules.setdefault("cosyvoice.utils.file_utils", stand_in)
    try:
        from cosyvoice.llm.llm import Qwen2Encoder, Qwen2LM
    finally:
        if added:
            del sys.modules["cosyvoice.utils.file_utils"]

    class Encoder(Qwen2Encoder):  # type: ignore[misc]
        def __init__(self, model: Qwen2ForCausalLM) -> None:
            torch.nn.Module.__init__(self)
            self.model = model

        def forward_one_step(self, xs: Any, masks: Any, cache: Any = None) -> Any:
            return super().forward_one_step(xs, masks, _IndexableCache() if cache is None else cache)

    hf = Qwen2ForCausalLM.from_pretrained(llm_dir, dtype=torch.float32).eval()
    weights = load_file(llm_dir / "model.safetensors")
    hidden = hf.config.hidden_size
    model = Qwen2LM(hidden, hidden, vocab.SPEECH_TOKEN_SIZE, Encoder(hf), sampling=None)

    def greedy(scores: torch.Tensor, *_: Any) -> torch.Tensor:
        undrawable = [2] if model.final_stage else [0, 1]
        return scores.index_fill(0, torch.tensor(undrawable) + vocab.SPEECH_TOKEN_SIZE, float("-inf")).argmax()

    model.sampling = greedy
    rows = slice(vocab.SPEECH_TOKEN_OFFSET, vocab.SPEECH_TOKEN_OFFSET + vocab.SPEECH_TOKEN_SIZE + 3)
    embed = weights["model.embed_tokens.weight"].float()
    with torch.no_grad():
        model.llm_embedding.weight.copy_(embed[[vocab.SOS_ID, vocab.TASK_ID_ID]])
        model.speech_embedding.weight.copy_(embed[rows])
        model.llm_decoder.weight.copy_(weights["lm_head.weight"].float()[rows])
        model.llm_decoder.bias.copy_(weights["lm_head.bias"].float()[rows])
    return model.eval()


def upstream_tokens(model: Any, prompt_text: list[int], prompt_speech: list[int], text: list[int]) -> list[int]:
    def pieces() -> Iterator[torch.Tensor]:
        for token in text:
            yield torch.tensor([[token]])
        model.final_stage = True

    model.final_stage = False
    speech = torch.tensor([prompt_speech], dtype=torch.int64)
    stream = model.inference_bistream(
        text=pieces(),
        prompt_text=torch.tensor([prompt_text], dtype=torch.int64),
        prompt_text_len=torch.tensor([len(prompt_text)]),
        prompt_speech_token=speech,
        prompt_speech_token_len=torch.tensor([len(prompt_speech)]),
        embedding=torch.zeros(1, 0),
    )
    return [vocab.speech_token_to_id(int(t)) for t in itertools.islice(stream, TOKENS)]


def open_stream(
    llm: TorchSpeechLLM,
    prompt_text: list[int],
    prompt_speech: list[int],
    params: SamplingParams = GREEDY,
    max_new_tokens: int = TOKENS,
) -> tuple[Recorder, TextStreamHandle]:
    recorder = Recorder()
    handle = llm.open_stream(
        prompt_text,
        vocab.speech_tokens_to_ids(prompt_speech),
        params,
        max_new_tokens=max_new_tokens,
        stop_ids=vocab.STOP_IDS,
        sink=recorder,
    )
    return recorder, handle


def whole_text_tokens(llm: TorchSpeechLLM, params: SamplingParams = GREEDY, max_new_tokens: int = TOKENS) -> list[int]:
    """The tokens of a stream (the test voice) given all its text at once, to its end."""
    recorder, handle = open_stream(llm, PROMPT_TEXT, PROMPT_SPEECH, params, max_new_tokens)
    handle.add_text(TEXT)
    handle.end_text()
    assert recorder.done.wait(60)
    assert recorder.error is None
    return recorder.tokens


def assert_both_slots_serve(llm: TorchSpeechLLM) -> None:
    """Two streams at once (the engine's two slots) each generate to their end."""
    again = [open_stream(llm, [], []) for _ in range(2)]
    for other, other_handle in again:
        other_handle.add_text(TEXT[:10])
        other_handle.end_text()
        assert other.done.wait(60) and other.error is None
        assert len(other.tokens) == TOKENS


def count_rows_per_pass(engine: Any, method: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The streams each call of the engine's pass ``method`` (``_round_logits``, ``_prompt_logits``) takes,
    in order, from now on."""
    rows_per_pass: list[int] = []
    run = getattr(engine, method)

    def counted(first: int, handles: list[TextStreamHandle]) -> torch.Tensor:
        rows_per_pass.append(len(handles))
        return run(first, handles)

    monkeypatch.setattr(engine, method, counted)
    return rows_per_pass


def wait_idle(recorder: Recorder, seconds: float = 0.3) -> int:
    """Tokens so far, once none came for ``seconds`` (the stream waits for text)."""
    count = -1
    while count != len(recorder.tokens) and not recorder.done.is_set():
        count = len(recorder.tokens)
        time.sleep(seconds)
    return len(recorder.tokens)


@pytest.mark.parametrize(
    ("prompt_text", "prompt_speech"),
    [(PROMPT_TEXT, PROMPT_SPEECH), ([], []), (PROMPT_TEXT[:2], PROMPT_SPEECH[:45])],
    ids=["voice", "no-voice", "long-speech-prompt"],
)
def test_pieces_give_upstreams_token_sequence(
    llm: TorchSpeechLLM, upstream: Any, prompt_text: list[int], prompt_speech: list[int]
) -> None:
    expected = upstream_tokens(upstream, prompt_text, prompt_speech, TEXT)
    recorder, handle = open_stream(llm, prompt_text, prompt_speech)
    progress = []
    for start in range(0, len(TEXT), 4):
        handle.add_text(TEXT[start : start + 4])
        progress.append(wait_idle(recorder))
    handle.end_text()
    assert recorder.done.wait(60)
    assert recorder.error is None
    assert recorder.tokens == expected
    # Speech came while the text was incomplete, and the stream waited for more of it in between.
    assert 0 < progress[-1] < len(expected)
    assert len(set(progress)) > 2


def test_text_given_at_once_gives_the_same_sequence(llm: TorchSpeechLLM, upstream: Any) -> None:
    expected = upstream_tokens(upstream, PROMPT_TEXT, PROMPT_SPEECH, TEXT)
    assert whole_text_tokens(llm) == expected


def test_rounds_whose_text_is_there_continue_in_their_row(
    llm: TorchSpeechLLM, upstream: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the text ahead, every round (the first, ended by a drawn fill, and the later ones, by the
    # 15th speech id) is fed by decode steps in the stream's row: no extend pass, no leaving the row.
    engine = llm.engine
    left: list[int] = []
    in_place: list[bool] = []
    park, feed = engine._park, engine._feed_in_place

    def counted_park(handle: TextStreamHandle) -> None:
        left.append(handle.since_input)
        park(handle)

    def counted_feed(handle: TextStreamHandle, token_id: int, *, in_flight: bool) -> bool:
        in_place.append(feed(handle, token_id, in_flight=in_flight))
        return in_place[-1]

    monkeypatch.setattr(engine, "_park", counted_park)
    monkeypatch.setattr(engine, "_feed_in_place", counted_feed)
    monkeypatch.setattr(engine, "_round_logits", lambda *_: pytest.fail("an extend pass ran"))
    expected = upstream_tokens(upstream, PROMPT_TEXT, PROMPT_SPEECH, TEXT)
    assert whole_text_tokens(llm) == expected
    assert left == []
    # Every round after the first and the final stage.
    assert len(in_place) >= len(TEXT) // 5 and all(in_place)


def test_a_round_fed_in_place_samples_as_one_fed_by_an_extend_pass(
    llm: TorchSpeechLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sampled with a seed and a repetition penalty: the dropped draws of the steps that feed a round's
    # input must neither advance the row's random stream nor count as seen, or the sequences part.
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.5, seed=1234)

    in_place = whole_text_tokens(llm, params)
    monkeypatch.setattr(llm.engine, "_feed_in_place", lambda *_, **__: False)
    extended = whole_text_tokens(llm, params)
    assert len(in_place) > 30
    assert in_place == extended


class EveryNthStepGate:
    """Yields the GPU before every ``every``-th step: the engine then hands out the steps in flight before
    it launches the next, so a round can end with no step of its row in flight."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.asked = 0
        self.waits = 0

    def busy(self, produced: Sequence[int]) -> bool:
        self.asked += 1
        return self.asked % self.every == 0

    def wait(self, stop: Callable[[], bool]) -> float:
        self.waits += 1
        return 0.0


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
@pytest.mark.parametrize("every", [1, 3])
def test_rounds_fed_in_place_while_the_engine_yields_give_upstreams_sequence(
    llm_dir: Path, upstream: Any, every: int, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = upstream_tokens(upstream, PROMPT_TEXT, PROMPT_SPEECH, TEXT)
    gate = EveryNthStepGate(every)
    model = TorchSpeechLLM(llm_dir, device=device, max_slots=2, max_seq_len=512, gate=gate)
    engine = model.engine
    started: list[bool] = []
    feed = engine._feed_in_place

    def counted_feed(handle: TextStreamHandle, token_id: int, *, in_flight: bool) -> bool:
        fed = feed(handle, token_id, in_flight=in_flight)
        if fed:
            started.append(in_flight)
        return fed

    monkeypatch.setattr(engine, "_feed_in_place", counted_feed)
    try:
        assert whole_text_tokens(model) == expected
    finally:
        model.close()
    assert gate.waits > 0
    # Rounds started in place with no step of the row in flight (and, yielding every third step, with one).
    assert False in started and (every == 1 or True in started)


def test_a_round_too_long_to_feed_in_place_comes_back_through_an_extend_pass(
    llm: TorchSpeechLLM, upstream: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every round's input is then longer than the engine feeds in place: the stream leaves its row with
    # the input it already took from its layout, and the extend pass feeds that input.
    monkeypatch.setattr(llm_engine, "EXTEND_WIDTH", 4)
    engine = llm.engine
    taken: list[int] = []
    park = engine._park

    def counted_park(handle: TextStreamHandle) -> None:
        taken.append(len(handle.feed))
        park(handle)

    monkeypatch.setattr(engine, "_park", counted_park)
    expected = upstream_tokens(upstream, PROMPT_TEXT, PROMPT_SPEECH, TEXT)
    assert whole_text_tokens(llm) == expected
    assert len(taken) >= 5 and all(length > 4 for length in taken)


def test_a_stream_whose_limit_falls_on_a_rounds_end_stops_there(
    llm: TorchSpeechLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.engine
    round_ends: list[int] = []
    feed = engine._feed_in_place

    def counted_feed(handle: TextStreamHandle, token_id: int, *, in_flight: bool) -> bool:
        round_ends.append(handle.produced)
        return feed(handle, token_id, in_flight=in_flight)

    monkeypatch.setattr(engine, "_feed_in_place", counted_feed)
    tokens = whole_text_tokens(llm)
    # Early rounds end on a drawn fill; once one has, the fill is forced after every 15th speech id. A
    # limit set on such an id ends the stream with it instead of starting another round.
    limit = next(end for before, end in itertools.pairwise(round_ends) if end - before == SPEECH_PER_ROUND)
    assert whole_text_tokens(llm, max_new_tokens=limit) == tokens[:limit]


def test_a_stream_keeps_when_its_tokens_came_and_when_it_waited_for_text(llm: TorchSpeechLLM) -> None:
    # What the stage trace reads: the times of the first tokens, and each wait out of the row for text.
    recorder, handle = open_stream(llm, PROMPT_TEXT, PROMPT_SPEECH)
    handle.add_text(TEXT[:10])
    before = wait_idle(recorder)
    assert 0 < before < TOKENS
    time.sleep(0.2)
    text_at = time.monotonic()
    handle.add_text(TEXT[10:])
    handle.end_text()
    assert recorder.done.wait(60) and recorder.error is None
    times = handle.token_times
    assert len(times) == min(len(recorder.tokens), llm_engine.TRACED_TOKENS) and times == sorted(times)
    assert times[0] == handle.first_token
    # It left its row after its last token of the text it had, and came back once the rest was there.
    left, back = next((left, back) for left, back in handle.waits if left < text_at <= back)
    assert times[before - 1] <= left and back - left >= 0.2
    assert back <= times[before]


def test_waiting_streams_leave_their_slots_to_other_requests(llm: TorchSpeechLLM) -> None:
    # Two slots, two streams waiting for text: a plain request still runs to its end meanwhile.
    streams = [open_stream(llm, PROMPT_TEXT, PROMPT_SPEECH) for _ in range(2)]
    for _, handle in streams:
        handle.add_text(TEXT[:4])
    waited = [wait_idle(recorder) for recorder, _ in streams]
    assert all(0 < count < TOKENS for count in waited)
    prompt = [vocab.SOS_ID, 100, vocab.TASK_ID_ID, *vocab.speech_tokens_to_ids([5, 6])]
    assert len(list(llm.generate(prompt, GREEDY, max_new_tokens=10, stop_ids=()))) == 10
    for recorder, handle in streams:
        handle.add_text(TEXT[4:])
        handle.end_text()
        assert recorder.done.wait(60)
        assert recorder.error is None
        assert len(recorder.tokens) == TOKENS


def test_streams_ready_together_are_extended_in_one_pass(
    llm: TorchSpeechLLM, upstream: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rounds of many streams start between the same two steps: fed one pass each, they would queue
    # behind each other on the engine's thread. Different prompts: the rows start at different cache
    # positions and their inputs differ in length, and each still gets upstream's sequence.
    prompts = [(PROMPT_TEXT, PROMPT_SPEECH), (PROMPT_TEXT[:2], PROMPT_SPEECH[:45])]
    expected = [upstream_tokens(upstream, text, speech, TEXT) for text, speech in prompts]
    engine = llm.engine
    rows_per_pass = count_rows_per_pass(engine, "_round_logits", monkeypatch)
    streams = [open_stream(llm, text, speech) for text, speech in prompts]
    for _, handle in streams:
        handle.add_text(TEXT[:16])
    assert all(0 < wait_idle(recorder) < TOKENS for recorder, _ in streams)
    # Both streams' text lands between two steps of the engine (its lock is reentrant).
    with engine._wake:
        for _, handle in streams:
            handle.add_text(TEXT[16:])
            handle.end_text()
    for (recorder, _), tokens in zip(streams, expected, strict=True):
        assert recorder.done.wait(60)
        assert recorder.error is None
        assert recorder.tokens == tokens
    assert max(rows_per_pass) == 2


def test_streams_starting_together_are_prefilled_a_step_apart(
    llm: TorchSpeechLLM, upstream: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Starting streams count against the prompts prefilled between two steps: taken all at once, many
    # sockets opened together would hold every live row's next step until the last prompt was done.
    engine = llm.engine
    monkeypatch.setattr(engine, "_max_prefill_rows", 1)
    prompts_per_pass = count_rows_per_pass(engine, "_prompt_logits", monkeypatch)
    expected = upstream_tokens(upstream, PROMPT_TEXT, PROMPT_SPEECH, TEXT)
    streams = [open_stream(llm, PROMPT_TEXT, PROMPT_SPEECH) for _ in range(2)]
    with engine._wake:
        for _, handle in streams:
            handle.add_text(TEXT)
            handle.end_text()
    for recorder, _ in streams:
        assert recorder.done.wait(60)
        assert recorder.error is None
        assert recorder.tokens == expected
    assert prompts_per_pass == [1, 1]


def test_cancelling_a_waiting_stream_ends_it_at_once(llm: TorchSpeechLLM) -> None:
    recorder, handle = open_stream(llm, PROMPT_TEXT, PROMPT_SPEECH)
    handle.add_text(TEXT[:4])
    produced = wait_idle(recorder)
    handle.cancel()
    assert recorder.done.wait(5)
    assert recorder.error is None
    assert len(recorder.tokens) == produced


def test_cancelling_a_generating_stream_frees_its_slot(llm: TorchSpeechLLM) -> None:
    recorder, handle = open_stream(llm, [], [])
    handle.add_text(TEXT)
    handle.end_text()
    while not recorder.tokens:
        time.sleep(0.001)
    handle.cancel()
    assert recorder.done.wait(5)
    assert len(recorder.tokens) < TOKENS
    assert_both_slots_serve(llm)


def test_a_stream_whose_sink_fails_ends_and_frees_its_slot(llm: TorchSpeechLLM) -> None:
    broken = FailsOnToken(3)
    handle = llm.open_stream([], [], GREEDY, max_new_tokens=TOKENS, stop_ids=vocab.STOP_IDS, sink=broken)
    handle.add_text(TEXT)
    handle.end_text()
    assert broken.done.wait(30)
    assert broken.error is None and 3 <= len(broken.tokens) < TOKENS
    assert_both_slots_serve(llm)


def test_a_stream_closed_while_it_waits_never_comes_back(llm: TorchSpeechLLM) -> None:
    # The engine closes the streams of a pass that failed; one of them may have parked again by then.
    engine = llm.engine
    recorder, handle = open_stream(llm, PROMPT_TEXT, PROMPT_SPEECH)
    handle.add_text(TEXT[:4])
    produced = wait_idle(recorder)
    with engine._wake:
        open_before = engine._streams_open
        engine._close_stream(handle, RuntimeError("the pass failed"))
    handle.add_text(TEXT[4:])
    handle.end_text()
    time.sleep(0.5)
    assert isinstance(recorder.error, RuntimeError)
    assert len(recorder.tokens) == produced
    assert handle not in engine._live
    assert engine._streams_open == open_before - 1


def test_text_after_its_end_is_refused(llm: TorchSpeechLLM) -> None:
    recorder, handle = open_stream(llm, [], [])
    handle.end_text()
    with pytest.raises(ValueError, match="after its end"):
        handle.add_text([5])
    handle.cancel()
    assert recorder.done.wait(60)
