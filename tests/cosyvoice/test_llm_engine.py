"""Continuous batching on the tiny CosyVoice2 LLM: requests decoded together equal requests decoded alone."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tts_gateway.models.cosyvoice2.checkpoints import tiny_frontend
from tts_gateway.models.cosyvoice2.engines.llm import SamplingParams, TorchSpeechLLM
from tts_gateway.models.cosyvoice2.engines.llm_engine import Generation, GenerationHandle
from tts_gateway.models.cosyvoice2.model import vocab
from tts_gateway.models.cosyvoice2.stage_models.llm_responses import CancellationWatch, Outbox, TokenStream

pytestmark = [pytest.mark.cosyvoice, pytest.mark.usefixtures("one_torch_thread")]

SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, repetition_penalty=1.1)
GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0)


def prompt(index: int) -> list[int]:
    speech = vocab.speech_tokens_to_ids([(7 * index + k) % vocab.SPEECH_TOKEN_SIZE for k in range(4 + index % 5)])
    return [vocab.SOS_ID, 100 + index, 200 + 3 * index, vocab.TASK_ID_ID, *speech]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchSpeechLLM]:
    directory = tiny_frontend.write_tiny_llm(tmp_path_factory.mktemp("llm") / "cosyvoice2_llm")
    model = TorchSpeechLLM(directory, max_slots=4, max_seq_len=128)
    yield model
    model.close()


class Recorder:
    """A sink that keeps what the engine hands it."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self.done = threading.Event()

    def token(self, token_id: int) -> None:
        self.tokens.append(token_id)

    def finished(self, error: BaseException | None) -> None:
        self.error = error
        self.done.set()


class FailsOnToken(Recorder):
    """A sink that raises when it is handed its ``count``-th token."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count

    def token(self, token_id: int) -> None:
        super().token(token_id)
        if len(self.tokens) == self.count:
            raise RuntimeError("a broken sink")


def alone(llm: TorchSpeechLLM, index: int, params: SamplingParams, tokens: int = 20) -> list[int]:
    seeded = SamplingParams(**{**vars(params), "seed": 1000 + index})
    return list(llm.generate(prompt(index), seeded, max_new_tokens=tokens, stop_ids=vocab.STOP_IDS))


def submit(
    llm: TorchSpeechLLM, index: int, params: SamplingParams, tokens: int = 20
) -> tuple[Recorder, GenerationHandle]:
    seeded = SamplingParams(**{**vars(params), "seed": 1000 + index})
    recorder = Recorder()
    request = llm.request(prompt(index), seeded, max_new_tokens=tokens, stop_ids=vocab.STOP_IDS)
    return recorder, llm.submit(request, recorder)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_requests_decoded_together_equal_requests_decoded_alone(llm: TorchSpeechLLM, params: SamplingParams) -> None:
    expected = [alone(llm, index, params) for index in range(7)]
    # Seven requests on four slots: three wait, then join as others leave.
    runs = [submit(llm, index, params) for index in range(7)]
    for recorder, _ in runs:
        assert recorder.done.wait(60)
        assert recorder.error is None
    assert [recorder.tokens for recorder, _ in runs] == expected
    # Different prompts (and seeds) take different paths, so a mix-up between rows would show.
    assert len({tuple(tokens) for tokens in expected}) >= 3


def test_a_request_joining_mid_stream_does_not_disturb_the_others(llm: TorchSpeechLLM) -> None:
    expected = [alone(llm, index, SAMPLED, tokens=60) for index in (1, 2)]
    first, _ = submit(llm, 1, SAMPLED, tokens=60)
    while len(first.tokens) < 10:
        time.sleep(0.001)
    second, _ = submit(llm, 2, SAMPLED, tokens=60)
    assert first.done.wait(60) and second.done.wait(60)
    assert [first.tokens, second.tokens] == expected


def test_requests_ending_on_one_step_leave_the_others_their_tokens(tmp_path: Path) -> None:
    """Four of six requests end on the same step, from rows 0, 1, 3 and 5: the two left move into freed
    rows and go on drawing what they draw alone."""
    lengths = [12, 12, 30, 12, 30, 12]
    directory = tiny_frontend.write_tiny_llm(tmp_path / "cosyvoice2_llm")
    model = TorchSpeechLLM(directory, max_slots=6, max_seq_len=128)
    try:
        expected = [alone(model, index, SAMPLED, tokens=length) for index, length in enumerate(lengths)]
        with model.engine._wake:  # all six admitted by one prefill, so that they step together
            runs = [submit(model, index, SAMPLED, tokens=length) for index, length in enumerate(lengths)]
        for recorder, _ in runs:
            assert recorder.done.wait(60) and recorder.error is None
        assert [recorder.tokens for recorder, _ in runs] == expected
        assert [len(tokens) for tokens in expected] == lengths
        assert len({handle.admitted for _, handle in runs}) == 1
    finally:
        model.close()


def test_a_request_may_fill_its_slot_and_counts_its_decode_steps(llm: TorchSpeechLLM) -> None:
    # Steps are pipelined: the engine runs one step past a request's last token, also when prompt and
    # tokens fill the whole slot (that step feeds the last position; positions past it would be clamped).
    ids = prompt(6)
    room = 128 - len(ids)
    recorder = Recorder()
    request = llm.request(ids, GREEDY, max_new_tokens=room, min_new_tokens=room, stop_ids=vocab.STOP_IDS)
    handle = llm.submit(request, recorder)
    assert recorder.done.wait(60)
    assert recorder.error is None
    assert len(recorder.tokens) == room
    # The prefill draws the first token, one decode step each of the others; the extra step is not counted.
    assert handle.steps == room - 1
    assert handle.step_s > 0
    # Each step was followed by the next one's launch (the last by the step whose id is dropped).
    assert handle.periods == handle.steps and handle.period_s >= handle.step_s
    assert handle.first_token <= handle.last_token


def test_cancel_stops_a_request_at_the_next_step_and_frees_its_slot(llm: TorchSpeechLLM) -> None:
    recorder, handle = submit(llm, 3, SAMPLED, tokens=100)
    while not recorder.tokens:
        time.sleep(0.001)
    handle.cancel()
    assert recorder.done.wait(10)
    assert recorder.error is None
    assert len(recorder.tokens) < 100
    # All four slots serve again.
    runs = [submit(llm, index, GREEDY, tokens=5) for index in range(4)]
    assert all(r.done.wait(30) and len(r.tokens) == 5 for r, _ in runs)


def test_only_speech_tokens_are_handed_out(llm: TorchSpeechLLM) -> None:
    tokens = alone(llm, 4, SamplingParams(temperature=2.0, top_p=1.0, top_k=0, repetition_penalty=1.0), tokens=50)
    assert len(tokens) == 50
    assert all(vocab.id_to_speech_token(token) is not None for token in tokens)


def test_a_request_longer_than_a_slot_is_refused(llm: TorchSpeechLLM) -> None:
    request = llm.request(prompt(0), GREEDY, max_new_tokens=200, stop_ids=vocab.STOP_IDS)
    with pytest.raises(ValueError, match="max_seq_len"):
        llm.submit(request, Recorder())


def test_stop_ids_outside_the_sampled_columns_are_refused(llm: TorchSpeechLLM) -> None:
    with pytest.raises(ValueError, match="stop ids"):
        llm.request(prompt(0), GREEDY, max_new_tokens=5, stop_ids=[100])


def test_a_stopped_engine_ends_requests_with_an_error(tmp_path: Path) -> None:
    directory = tiny_frontend.write_tiny_llm(tmp_path / "cosyvoice2_llm")
    model = TorchSpeechLLM(directory, max_slots=1, max_seq_len=4096)
    running, _ = submit(model, 0, SAMPLED, tokens=4000)
    waiting, _ = submit(model, 1, SAMPLED, tokens=5)
    while not running.tokens:
        time.sleep(0.001)
    model.close()
    assert running.done.is_set() and isinstance(running.error, RuntimeError)
    assert waiting.done.is_set() and isinstance(waiting.error, RuntimeError)
    with pytest.raises(RuntimeError):
        model.submit(model.request(prompt(0), GREEDY, max_new_tokens=5, stop_ids=vocab.STOP_IDS), Recorder())


def test_a_sink_that_fails_does_not_stop_the_engine(llm: TorchSpeechLLM) -> None:
    class Failing(Recorder):
        def finished(self, error: BaseException | None) -> None:
            super().finished(error)
            raise RuntimeError("a broken sink")

    broken = Failing()
    llm.submit(llm.request(prompt(5), GREEDY, max_new_tokens=3, stop_ids=vocab.STOP_IDS), broken)
    assert broken.done.wait(30)
    assert alone(llm, 6, GREEDY, tokens=4) == alone(llm, 6, GREEDY, tokens=4)


def test_a_sink_that_fails_on_a_token_ends_only_its_own_request(llm: TorchSpeechLLM) -> None:
    expected = alone(llm, 3, SAMPLED, tokens=40)
    with llm.engine._wake:  # admitted together, so that the failure happens while both are live
        broken = FailsOnToken(2)
        llm.submit(llm.request(prompt(5), GREEDY, max_new_tokens=40, stop_ids=vocab.STOP_IDS), broken)
        healthy, _ = submit(llm, 3, SAMPLED, tokens=40)
    assert broken.done.wait(30) and healthy.done.wait(30)
    assert broken.error is None and 2 <= len(broken.tokens) < 40  # cancelled: it ends within a step or two
    assert healthy.error is None and healthy.tokens == expected


def test_outbox_keeps_each_requests_order_while_another_request_waits() -> None:
    outbox = Outbox("test", lanes=4)
    lanes = [outbox.next_lane() for _ in range(8)]  # eight requests, two to a lane
    assert sorted(lanes) == [0, 0, 1, 1, 2, 2, 3, 3]
    blocked, release = threading.Event(), threading.Event()
    sent: list[list[int]] = [[] for _ in lanes]

    def stall() -> None:
        blocked.set()
        release.wait(10)

    outbox.put(lanes[0], stall)
    assert blocked.wait(5)
    for index in range(50):
        for request, lane in enumerate(lanes):
            outbox.put(lane, lambda log=sent[request], index=index: log.append(index))
    stalled = {request for request, lane in enumerate(lanes) if lane == lanes[0]}
    moving = [request for request in range(len(lanes)) if request not in stalled]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(len(sent[request]) < 50 for request in moving):
        time.sleep(0.001)
    # The other lanes went on while one send waited on the server; the requests of the stalled lane waited.
    assert all(sent[request] == list(range(50)) for request in moving)
    assert all(sent[request] == [] for request in stalled)
    release.set()
    outbox.close()
    assert all(log == list(range(50)) for log in sent)


def test_a_token_stream_sends_a_response_per_token_while_its_lane_keeps_up() -> None:
    outbox = Outbox("test", lanes=1)
    sent: list[list[int]] = []
    stream = TokenStream(outbox, 0, sent.append)
    for token in range(5):
        stream.push(token)
        deadline = time.monotonic() + 5
        while len(sent) <= token and time.monotonic() < deadline:
            time.sleep(0.001)
    outbox.close()
    assert sent == [[0], [1], [2], [3], [4]]


def test_tokens_that_queue_behind_a_busy_lane_leave_in_one_response_before_the_final_one() -> None:
    outbox = Outbox("test", lanes=1)
    sent: list[object] = []
    stream = TokenStream(outbox, 0, sent.append)
    blocked, release = threading.Event(), threading.Event()
    outbox.put(0, lambda: (blocked.set(), release.wait(10)))
    assert blocked.wait(5)
    for token in range(50):
        stream.push(token)
    outbox.put(0, lambda: sent.append("final"))
    release.set()
    stream_after = threading.Event()
    outbox.put(0, stream_after.set)
    assert stream_after.wait(5)
    stream.push(50)
    outbox.close()
    assert sent == [list(range(50)), "final", [50]]


def test_a_token_stream_keeps_every_token_in_order_under_load() -> None:
    outbox = Outbox("test", lanes=2)
    logs: list[list[list[int]]] = [[], []]

    def slow(log: list[list[int]]) -> Callable[[list[int]], None]:
        return lambda tokens: (log.append(tokens), time.sleep(0.0002))

    streams = [TokenStream(outbox, lane, slow(log)) for lane, log in enumerate(logs)]
    for token in range(3000):
        for stream in streams:
            stream.push(token)
    outbox.close()
    for log in logs:
        assert [token for tokens in log for token in tokens] == list(range(3000))
        assert all(log)
        assert len(log) < 3000  # the lane fell behind and caught up with shared responses


def _handle() -> GenerationHandle:
    return GenerationHandle(Generation((1,), 1, 0, frozenset(), 1.0, 1.0, 0, 1.0), Recorder())


def _asks(log: list[str], name: str, answer: bool) -> Callable[[], bool]:
    """An ``is_cancelled`` that notes each ask in ``log`` under ``name``."""

    def is_cancelled() -> bool:
        log.append(name)
        return answer

    return is_cancelled


def test_a_forgotten_request_is_never_asked_about_again() -> None:
    # Asking Triton about a request whose final response was sent reads freed memory in the server:
    # forget() must wait for a check under way and no check may follow it.
    watch = CancellationWatch("test", min_interval_s=0.001)
    asking, answer = threading.Event(), threading.Event()
    asked_after_forget: list[bool] = []
    forgotten = threading.Event()

    def is_cancelled() -> bool:
        asked_after_forget.append(forgotten.is_set())
        asking.set()
        answer.wait(5)
        return False

    handle = _handle()
    watch.watch(handle, is_cancelled)
    assert asking.wait(5)
    forgetting = threading.Thread(target=lambda: (watch.forget(handle), forgotten.set()))
    forgetting.start()
    time.sleep(0.05)
    assert not forgotten.is_set()  # the check under way holds it
    answer.set()
    forgetting.join(5)
    assert forgotten.is_set()
    time.sleep(0.05)
    watch.close()
    assert asked_after_forget and not any(asked_after_forget)


def test_the_watch_asks_within_its_budget_however_many_requests_are_in_flight() -> None:
    # Every ask takes the interpreter lock from the engine's thread: 20 requests asked every 1 ms
    # would be 20,000 asks a second; the budget keeps it at 100 and still reaches every request.
    started = time.monotonic()
    watch = CancellationWatch("test", min_interval_s=0.001, checks_per_s=100)
    asked: list[str] = []
    for index in range(20):
        watch.watch(_handle(), _asks(asked, str(index), answer=False))
    time.sleep(1.0)
    watch.close()
    # One pass of all 20 at once, then 100 a second for as long as the watch ran (a slow machine may
    # oversleep, and then rightly asks more).
    assert len(asked) <= 20 + 100 * (time.monotonic() - started) * 1.25
    assert set(asked) == {str(index) for index in range(20)}


def test_the_watch_cancels_a_request_triton_cancelled_and_asks_no_more_about_it() -> None:
    watch = CancellationWatch("test", min_interval_s=0.001)
    kept, dropped = _handle(), _handle()
    asked: list[str] = []
    watch.watch(kept, _asks(asked, "kept", answer=False))
    watch.watch(dropped, _asks(asked, "dropped", answer=True))
    deadline = time.monotonic() + 5
    while asked.count("kept") < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.close()
    assert dropped.cancelled and not kept.cancelled
    assert asked.count("dropped") == 1 and asked.count("kept") >= 10


def test_a_gate_holding_the_engine_back_delays_tokens_but_does_not_change_them(tmp_path: Path) -> None:
    class Gate:
        def __init__(self) -> None:
            self.asked: list[int] = []
            self.waits = 0

        def busy(self, produced: Sequence[int]) -> bool:
            self.asked.append(len(produced))
            return len(self.asked) % 3 == 0

        def wait(self, stop: Callable[[], bool]) -> float:
            self.waits += 1
            time.sleep(0.002)
            return 0.002

    gate = Gate()
    directory = tiny_frontend.write_tiny_llm(tmp_path / "cosyvoice2_llm")
    model = TorchSpeechLLM(directory, max_slots=4, max_seq_len=128, gate=gate)
    try:
        runs = [submit(model, index, SAMPLED) for index in range(3)]
        for recorder, _ in runs:
            assert recorder.done.wait(60) and recorder.error is None
        gated = [recorder.tokens for recorder, _ in runs]
    finally:
        model.close()
    ungated = TorchSpeechLLM(directory, max_slots=4, max_seq_len=128)
    try:
        assert gated == [alone(ungated, index, SAMPLED) for index in range(3)]
    finally:
        ungated.close()
    assert gate.waits > 0 and set(gate.asked) <= {1, 2, 3}


def test_a_request_that_arrives_while_the_engine_yields_is_admitted_at_once(tmp_path: Path) -> None:
    class Gate:
        """Holds the engine back for up to 30 s once a request made 5 tokens, unless told to stop."""

        def __init__(self) -> None:
            self.waited: list[float] = []

        def busy(self, produced: Sequence[int]) -> bool:
            return min(produced) >= 5

        def wait(self, stop: Callable[[], bool]) -> float:
            started = time.monotonic()
            while not stop() and time.monotonic() - started < 30:
                time.sleep(0.001)
            self.waited.append(time.monotonic() - started)
            return self.waited[-1]

    gate = Gate()
    directory = tiny_frontend.write_tiny_llm(tmp_path / "cosyvoice2_llm")
    model = TorchSpeechLLM(directory, max_slots=4, max_seq_len=128, gate=gate)
    try:
        first, _ = submit(model, 0, GREEDY, tokens=40)
        deadline = time.monotonic() + 30
        while len(first.tokens) < 5 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(first.tokens) >= 5 and not gate.waited  # the engine is waiting now
        second, _ = submit(model, 1, GREEDY, tokens=3)
        assert second.done.wait(20) and second.error is None and len(second.tokens) == 3
        assert gate.waited and gate.waited[0] < 20
    finally:
        model.close()


class _Replay:
    """Stands in for a recorded prefill graph on the CPU: replaying runs the pass it would have recorded."""

    def __init__(self, run: Callable[[], None], replays: list[int], rows: int) -> None:
        self._run, self._replays, self._rows = run, replays, rows

    def replay(self) -> None:
        self._replays.append(self._rows)
        self._run()


def test_prompts_admitted_together_are_prefilled_in_one_recorded_pass(tmp_path: Path) -> None:
    """The recorded prefill pass takes several prompts of different lengths at once, each into its own
    slot after the live row's, padded to a bucket of four rows, and they draw what eager prefills draw;
    the live row goes on undisturbed."""
    directory = tiny_frontend.write_tiny_llm(tmp_path / "cosyvoice2_llm")
    model = TorchSpeechLLM(directory, max_slots=4, max_seq_len=128)
    engine = model.engine
    try:
        expected = [alone(model, index, SAMPLED, tokens=60 if index == 0 else 20) for index in range(4)]
        replays: list[int] = []
        engine._prefill_graphs = {
            (rows, width): _Replay(functools.partial(engine._prefill_pass, rows, width), replays, rows)
            for rows in engine._prefill_rows_buckets
            for width in engine._prefill_widths
        }
        live, _ = submit(model, 0, SAMPLED, tokens=60)
        while len(live.tokens) < 5:
            time.sleep(0.001)
        with engine._wake:  # three admitted between the same two steps, into rows 1-3 (the bucket's fourth row spare)
            runs = [submit(model, index, SAMPLED) for index in range(1, 4)]
        for recorder in [live, *(recorder for recorder, _ in runs)]:
            assert recorder.done.wait(60) and recorder.error is None
        assert [live.tokens, *(recorder.tokens for recorder, _ in runs)] == expected
        assert len({len(prompt(index)) for index in range(1, 4)}) == 3
        assert replays == [1, 4], "the first prompt alone, then three in one pass of the four-row bucket"
    finally:
        model.close()
