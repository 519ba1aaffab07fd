"""token2wav's queue: which calls go together next, first chunks ahead of a busy worker, every call answered once."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

from tts_gateway.models.cosyvoice2.engines.flow_graphs import FlowSolverGraphs
from tts_gateway.models.cosyvoice2.engines.playback_guard import PlaybackGuard
from tts_gateway.models.cosyvoice2.engines.token2wav import Audio, Conversion, Token2Wav
from tts_gateway.models.cosyvoice2.engines.token2wav_queue import (
    ConversionQueue,
    Converted,
    GroupFailed,
    QueueClosed,
    Queued,
    take_group,
)
from tts_gateway.models.cosyvoice2.model.frontend import VoicePrompt

VOICE = VoicePrompt(
    speech_tokens=np.arange(10),
    feats=np.zeros((20, 80), dtype=np.float32),
    embedding=np.zeros(192, dtype=np.float32),
)


LONG_VOICE = VoicePrompt(
    speech_tokens=np.arange(200),
    feats=np.zeros((400, 80), dtype=np.float32),
    embedding=np.zeros(192, dtype=np.float32),
)


def call(name: str, tokens: int, offset: int | None = None, voice: VoicePrompt = VOICE) -> Conversion:
    return Conversion(name, np.arange(tokens), voice, offset, offset is None)


def queued(*calls: Conversion) -> list[Queued]:
    """``calls`` queued one second apart, from 0."""
    return [Queued(c, lambda result, group: None, queued_at=float(index)) for index, c in enumerate(calls)]


def names(items: list[Queued]) -> list[str]:
    return [item.call.session_id for item in items]


def test_first_chunks_go_first_then_the_calls_near_the_oldest_calls_length() -> None:
    pending = queued(
        call("long-later", 300, offset=40),
        call("short-later", 60, offset=15),
        call("first-a", 18, offset=0),
        call("offline-long", 290),
        call("first-b", 18, offset=0),
        call("first-c", 200, offset=0),
    )
    # Calls of about one length per group (one flow pass): the long first chunk goes on its own, still before the rest.
    assert names(take_group(pending, max_rows=8)) == ["first-a", "first-b"]
    assert names(take_group(pending, max_rows=8)) == ["first-c"]
    # 310 and 300 tokens (prompt included) share a pass; the short call (70) waits its turn.
    assert names(take_group(pending, max_rows=8)) == ["long-later", "offline-long"]
    assert names(take_group(pending, max_rows=8)) == ["short-later"]
    assert pending == []


def test_first_chunks_a_few_tokens_apart_share_a_group_across_a_multiple_of_the_span() -> None:
    # 10 prompt tokens: 124 and 128 tokens in all, which fixed steps of 128 used to split; 200 is too far.
    pending = queued(call("a", 114, offset=0), call("b", 118, offset=0), call("far", 190, offset=0))
    assert names(take_group(pending, max_rows=8)) == ["a", "b"]
    assert names(take_group(pending, max_rows=8)) == ["far"]


def test_a_later_chunk_whose_audio_runs_out_goes_before_first_chunks_with_its_class() -> None:
    pending = queued(
        call("first-a", 18, offset=0),
        call("ample", 60, offset=15),
        call("running-dry", 62, offset=15),
        call("drier", 300, offset=40),
        call("offline-short", 50),
    )
    runs_out = {"ample": 9.0, "running-dry": 4.5, "drier": 4.0}
    # Before 5.0 two streams run dry: the one that runs out first leads, with the later chunks and
    # offline calls near its length (310 tokens with the prompt, the others 60-72: alone).
    assert names(take_group(pending, max_rows=8, runs_out=runs_out, guard_until=5.0)) == ["drier"]
    assert names(take_group(pending, max_rows=8, runs_out=runs_out, guard_until=5.0)) == [
        "running-dry",
        "ample",
        "offline-short",
    ]
    assert names(take_group(pending, max_rows=8, runs_out=runs_out, guard_until=5.0)) == ["first-a"]


def test_streams_with_audio_in_hand_leave_first_chunks_first() -> None:
    pending = queued(call("later", 60, offset=15), call("first", 18, offset=0), call("unknown", 60, offset=30))
    # "unknown" is a stream whose playback the queue did not follow: it is not promoted.
    assert names(take_group(pending, max_rows=8, runs_out={"later": 9.0}, guard_until=5.0)) == ["first"]


def test_later_chunks_go_in_the_order_their_streams_run_dry_offline_calls_as_they_came() -> None:
    def pending(offline_queued_at: float) -> list[Queued]:
        return [
            Queued(call("long-a", 60, offset=40), lambda result, group: None, queued_at=1.0),
            Queued(call("long-b", 60, offset=40), lambda result, group: None, queued_at=2.0),
            Queued(call("offline", 50), lambda result, group: None, queued_at=offline_queued_at),
            Queued(call("short-last", 58, offset=15), lambda result, group: None, queued_at=3.0),
        ]

    runs_out = {"long-a": 8.0, "long-b": 6.0, "short-last": 4.0}
    # Queued last of the streams, the short stream's chunk leads: its audio runs out first. The
    # offline call came after the streams' oldest chunk, so the streams' chunks go first.
    assert names(take_group(pending(5.0), max_rows=8, runs_out=runs_out)) == [
        "short-last",
        "long-b",
        "long-a",
        "offline",
    ]
    assert names(take_group(pending(5.0), max_rows=1, runs_out=runs_out)) == ["short-last"]
    # An offline call that came before every waiting later chunk goes first, as in order of arrival.
    assert names(take_group(pending(0.5), max_rows=8, runs_out=runs_out)) == [
        "offline",
        "short-last",
        "long-b",
        "long-a",
    ]
    # A stream whose playback is not followed is due when its chunk was queued.
    assert names(take_group(pending(5.0), max_rows=8, runs_out={})) == ["long-a", "long-b", "short-last", "offline"]


class Recorder:
    """Stands in for Token2Wav where the order of groups is what is tested: answers each call with its
    length in samples; the first group blocks until released, so that others queue behind it."""

    def __init__(self, fail_on: str = "", *, lend_after_release: bool = False) -> None:
        self.groups: list[list[str]] = []
        self.lent: list[bool] = []
        self.lend_after_release = lend_after_release
        self.started = threading.Event()
        self.release = threading.Event()
        self.fail_on = fail_on

    def convert(
        self,
        calls: Sequence[Conversion],
        on_result: Callable[[int, Audio | Exception], None] | None = None,
        *,
        between_segments: Callable[[], None] | None = None,
    ) -> list[Audio | Exception]:
        self.groups.append([c.session_id for c in calls])
        self.lent.append(between_segments is not None)
        if len(self.groups) == 1:
            self.started.set()
            assert self.release.wait(10)
            # Halfway through the flow solve, as FlowSolverGraphs calls it between its segments.
            if self.lend_after_release and between_segments is not None:
                between_segments()
        results: list[Audio | Exception] = []
        for index, c in enumerate(calls):
            if c.session_id == self.fail_on:
                raise RuntimeError("the GPU fell over")
            audio = np.zeros(int(np.size(c.tokens)), dtype=np.float32)
            results.append(audio)
            assert on_result is not None
            on_result(index, audio)
        return results


class Answers:
    def __init__(self) -> None:
        self.got: dict[str, list[Audio | Exception]] = {}
        self.groups: dict[str, Converted] = {}
        self.all_in = threading.Event()
        self.expected = 0
        self._lock = threading.Lock()

    def __call__(self, name: str) -> Callable[[Audio | Exception, Converted], None]:
        def answer(result: Audio | Exception, group: Converted) -> None:
            with self._lock:
                self.got.setdefault(name, []).append(result)
                self.groups[name] = group
                if sum(map(len, self.got.values())) >= self.expected:
                    self.all_in.set()

        return answer


def test_a_first_chunk_that_arrives_while_a_group_converts_goes_before_the_calls_queued_earlier() -> None:
    recorder, answers = Recorder(), Answers()
    held: list[int] = []

    @contextmanager
    def hold() -> Iterator[None]:
        held.append(len(recorder.groups))
        yield

    queue = ConversionQueue(recorder, max_rows=4, first_chunks_hold=hold)
    try:
        answers.expected = 4
        queue.submit(call("running", 300, offset=40), answers("running"))
        assert recorder.started.wait(10)
        queue.submit(call("later", 60, offset=15), answers("later"))
        queue.submit(call("offline", 40), answers("offline"))
        queue.submit(call("first", 18, offset=0), answers("first"))
        recorder.release.set()
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    assert recorder.groups == [["running"], ["first"], ["later", "offline"]]
    assert {name: [np.size(r) for r in got] for name, got in answers.got.items()} == {
        "running": [300],
        "first": [18],
        "later": [60],
        "offline": [40],
    }
    assert answers.groups["later"].rows == 2 and answers.groups["first"].rows == 1
    assert answers.groups["first"].started < answers.groups["later"].started
    # The GPU turn is asked for once: for the first chunk's group, the second to convert.
    assert held == [1]


def test_first_chunks_waiting_are_converted_between_the_halves_of_a_later_groups_solve() -> None:
    recorder, answers = Recorder(lend_after_release=True), Answers()
    queue = ConversionQueue(recorder, max_rows=4)
    try:
        answers.expected = 5
        queue.submit(call("running", 300, offset=40), answers("running"))
        assert recorder.started.wait(10)
        queue.submit(call("later", 60, offset=15), answers("later"))
        queue.submit(call("first-a", 18, offset=0), answers("first-a"))
        queue.submit(call("first-b", 18, offset=0), answers("first-b"))
        # Another voice's much longer prompt puts this one in a flow pass of its own.
        queue.submit(call("first-c", 18, offset=0, voice=LONG_VOICE), answers("first-c"))
        recorder.release.set()
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    # The first chunks ran inside the later group's conversion, a group at a time (answered before it),
    # and were not asked to lend the GPU themselves; the later chunk waited for the next group.
    assert recorder.groups == [["running"], ["first-a", "first-b"], ["first-c"], ["later"]]
    assert recorder.lent == [True, False, False, True]
    assert list(answers.got) == ["first-a", "first-b", "first-c", "running", "later"]


def test_only_first_chunks_are_converted_meanwhile_and_their_failure_is_their_own() -> None:
    recorder, answers = Recorder(fail_on="first-b", lend_after_release=True), Answers()
    errors: list[str] = []
    queue = ConversionQueue(recorder, max_rows=4, log_error=errors.append)
    try:
        answers.expected = 2
        queue.submit(call("running", 300, offset=40), answers("running"))
        assert recorder.started.wait(10)
        queue.submit(call("later", 60, offset=15), answers("later"))
        recorder.release.set()
        assert answers.all_in.wait(10)
        # Only a later chunk waited while "running" lent the GPU: it was left for the next group.
        assert recorder.groups == [["running"], ["later"]]
        assert list(answers.got) == ["running", "later"] and recorder.lent == [True, True]
        recorder.groups.clear()
        recorder.started.clear()
        recorder.release.clear()
        answers.all_in.clear()
        answers.expected = 5
        queue.submit(call("running-2", 300, offset=40), answers("running-2"))
        assert recorder.started.wait(10)
        queue.submit(call("first-a", 18, offset=0), answers("first-a"))
        queue.submit(call("first-b", 18, offset=0), answers("first-b"))
        recorder.release.set()
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    # The first chunks' group failed inside running-2's conversion: its own calls got the error,
    # running-2 was still answered with its audio.
    assert recorder.groups == [["running-2"], ["first-a", "first-b"]]
    assert np.size(answers.got["first-a"][0]) == 18
    assert [type(r) for r in answers.got["first-b"]] == [GroupFailed]
    assert np.size(answers.got["running-2"][0]) == 300
    assert len(errors) == 1 and "first-b" not in errors[0] and "2 calls" in errors[0]


def test_a_failing_group_answers_its_calls_with_the_error_and_the_queue_goes_on() -> None:
    recorder, answers = Recorder(fail_on="b"), Answers()
    errors: list[str] = []
    queue = ConversionQueue(recorder, max_rows=4, log_error=errors.append)
    try:
        answers.expected = 4
        queue.submit(call("running", 300), answers("running"))
        assert recorder.started.wait(10)
        for name, tokens, offset in (("a", 20, 0), ("b", 20, 0), ("c", 300, None)):
            queue.submit(call(name, tokens, offset), answers(name))
        recorder.release.set()
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    assert recorder.groups == [["running"], ["a", "b"], ["c"]]
    assert np.size(answers.got["a"][0]) == 20  # answered before its group failed
    # Failed as a group (an internal error), whatever the exception was: not the call's own fault.
    assert [type(r) for r in answers.got["b"]] == [GroupFailed]
    assert "the GPU fell over" in str(answers.got["b"][0])
    assert np.size(answers.got["c"][0]) == 300
    assert len(errors) == 1 and "the GPU fell over" in errors[0]


def test_an_answer_that_raises_keeps_no_other_call_from_its_own() -> None:
    recorder, answers = Recorder(fail_on="c"), Answers()
    errors: list[str] = []
    queue = ConversionQueue(recorder, max_rows=4, log_error=errors.append)

    def broken(result: Audio | Exception, group: Converted) -> None:
        raise OSError("the trace file is gone")

    try:
        answers.expected = 4
        queue.submit(call("running", 300), answers("running"))
        assert recorder.started.wait(10)
        queue.submit(call("a", 20, offset=0), broken)
        queue.submit(call("b", 20, offset=0), answers("b"))
        queue.submit(call("c", 20, offset=0), answers("c"))
        queue.submit(call("later", 300, offset=40), answers("later"))
        recorder.release.set()
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    # a's answer raised inside the conversion: b was still converted and answered, c's group failure
    # reached c, and the queue went on to the next group.
    assert np.size(answers.got["b"][0]) == 20
    assert [type(r) for r in answers.got["c"]] == [GroupFailed]
    assert np.size(answers.got["later"][0]) == 300
    assert any("the trace file is gone" in e for e in errors)


def test_closing_answers_what_waits_and_refuses_new_calls() -> None:
    recorder, answers = Recorder(), Answers()
    queue = ConversionQueue(recorder, max_rows=4)
    answers.expected = 3
    queue.submit(call("running", 30, offset=0), answers("running"))
    assert recorder.started.wait(10)
    queue.submit(call("waiting", 30, offset=0), answers("waiting"))
    closing = threading.Thread(target=queue.close)
    closing.start()
    recorder.release.set()
    closing.join(10)
    assert not closing.is_alive()
    assert np.size(answers.got["running"][0]) == 30  # the running group is finished, not dropped
    assert [type(r) for r in answers.got["waiting"]] == [QueueClosed]
    with pytest.raises(QueueClosed):
        queue.submit(call("late", 30, offset=0), answers("late"))
    assert recorder.groups == [["running"]]


@pytest.mark.cosyvoice
def test_streams_converted_through_the_queue_sound_as_converted_alone(token2wav_dir: Path) -> None:
    t2w = Token2Wav.from_model_dir(token2wav_dir, device="cpu", dtype=torch.float32)
    rng = np.random.default_rng(3)
    streams = {f"s{i}": rng.integers(0, 6561, 40) for i in range(3)}
    alone: dict[str, list[NDArray[np.float32]]] = {}
    for name, tokens in streams.items():
        alone[name] = [
            t2w.stream_chunk(f"alone-{name}", tokens[:18], VOICE, 0, False),
            t2w.stream_chunk(f"alone-{name}", tokens, VOICE, 15, True),
        ]
    queue = ConversionQueue(t2w, max_rows=8)
    got: dict[str, list[NDArray[np.float32]]] = {name: [] for name in streams}

    def run(name: str) -> None:
        for tokens, offset, final in ((streams[name][:18], 0, False), (streams[name], 15, True)):
            done = threading.Event()

            def answer(result: Audio | Exception, group: Converted, done: threading.Event = done) -> None:
                assert not isinstance(result, Exception), result
                got[name].append(result)
                done.set()

            queue.submit(Conversion(f"queued-{name}", tokens, VOICE, offset, final), answer)
            assert done.wait(60)

    threads = [threading.Thread(target=run, args=(name,)) for name in streams]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        queue.close()
    for name in streams:
        assert len(got[name]) == 2
        for mine, reference in zip(got[name], alone[name], strict=True):
            np.testing.assert_allclose(mine, reference, atol=1e-4)


def test_a_first_chunk_converted_between_the_halves_of_a_later_solve_sounds_as_converted_alone(
    token2wav_dir: Path,
) -> None:
    t2w = Token2Wav.from_model_dir(token2wav_dir, device="cpu", dtype=torch.float32)
    # The solver the GPU replays from CUDA graphs, here run eagerly over its static buffers.
    t2w.solver = FlowSolverGraphs(
        t2w.flow.decoder,
        n_timesteps=t2w.n_timesteps,
        mel_bins=80,
        max_rows=4,
        max_frames=256,
        frame_step=64,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 6561, 60), rng.integers(0, 6561, 30)
    alone_a = [t2w.stream_chunk("alone-a", a[:18], VOICE, 0, False), t2w.stream_chunk("alone-a", a, VOICE, 15, False)]
    alone_b = t2w.stream_chunk("alone-b", b[:18], VOICE, 0, False)

    first_a = t2w.stream_chunk("a", a[:18], VOICE, 0, False)
    meanwhile: list[Audio | Exception] = []

    def first_chunk_of_b() -> None:
        meanwhile.extend(t2w.convert([Conversion("b", b[:18], VOICE, 0, False)]))
        time.sleep(0.3)

    started = time.monotonic()
    asked_to_lend: list[bool] = []
    solver = t2w.solver

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        asked_to_lend.append(args[6] is not None)
        return solver(*args, **kwargs)

    t2w.solver = spy
    later_a = t2w.convert([Conversion("a", a, VOICE, 15, False)], between_segments=first_chunk_of_b)
    wall = time.monotonic() - started
    assert len(meanwhile) == 1  # the later chunk's solve fit a bucket and lent the GPU once
    # The time lent is not the later chunk's flow time.
    assert t2w.last_timing["flow_s"] <= wall - 0.3
    # Only a conversion given something to do meanwhile asks its solve to lend (b's nested one is not).
    assert asked_to_lend == [True, False]
    for mine, reference in ((first_a, alone_a[0]), (later_a[0], alone_a[1]), (meanwhile[0], alone_b)):
        assert not isinstance(mine, Exception), mine
        np.testing.assert_allclose(mine, reference, atol=1e-5)


@contextmanager
def _worker_busy(queue: ConversionQueue, recorder: Recorder, answers: Answers, busy_call: Conversion) -> Iterator[None]:
    """Holds the queue's worker in ``busy_call``'s group while the body queues calls behind it."""
    busy, gate = threading.Event(), threading.Event()
    original = recorder.convert

    def blocking(calls: Sequence[Conversion], *args: Any, **kwargs: Any) -> list[Audio | Exception]:
        if calls[0].session_id == busy_call.session_id:
            busy.set()
            assert gate.wait(10)
        return original(calls, *args, **kwargs)

    recorder.convert = blocking  # type: ignore[method-assign]
    queue.submit(busy_call, answers(busy_call.session_id))
    assert busy.wait(10)
    try:
        yield
    finally:
        gate.set()


def _playing_stream_then_a_first_chunk(guard: PlaybackGuard, sample_rate: int) -> list[list[str]]:
    """Stream "playing" gets its first chunk (18 samples), then, while another group converts, its next
    chunk and a new stream's first chunk queue: the order they are converted in."""
    recorder, answers = Recorder(), Answers()
    queue = ConversionQueue(recorder, max_rows=4, playback_guard=guard, sample_rate=sample_rate)
    try:
        answers.expected = 1
        queue.submit(call("playing", 18, offset=0), answers("playing"))
        assert recorder.started.wait(10)
        recorder.release.set()
        assert answers.all_in.wait(10)
        answers.expected, answers.all_in = 4, threading.Event()
        with _worker_busy(queue, recorder, answers, call("busy", 300, offset=40)):
            queue.submit(call("playing", 60, offset=15), answers("playing"))
            queue.submit(call("newcomer", 18, offset=0), answers("newcomer"))
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    return recorder.groups


def test_the_stream_with_the_least_audio_in_hand_gets_its_next_chunk_first() -> None:
    """Two streams get their first chunks, 10 s and 0.18 s of audio (samples at 100 Hz); while another
    group converts, the long stream's next chunk queues before the short one's: the short one goes first."""
    recorder, answers = Recorder(), Answers()
    queue = ConversionQueue(recorder, max_rows=1, sample_rate=100)
    try:
        answers.expected = 2
        queue.submit(call("long", 1000, offset=0), answers("long"))
        assert recorder.started.wait(10)
        queue.submit(call("short", 18, offset=0), answers("short"))
        recorder.release.set()
        assert answers.all_in.wait(10)
        answers.expected, answers.all_in = 5, threading.Event()
        with _worker_busy(queue, recorder, answers, call("busy", 40)):
            queue.submit(call("long", 1040, offset=1000), answers("long"))
            queue.submit(call("short", 58, offset=15), answers("short"))
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    assert recorder.groups == [["long"], ["short"], ["busy"], ["short"], ["long"]]


def test_a_stream_about_to_run_dry_goes_before_a_new_streams_first_chunk() -> None:
    # 18 samples at 100 Hz: 0.18 s of audio, run out before the 1 s guard ends.
    groups = _playing_stream_then_a_first_chunk(PlaybackGuard(1.0), sample_rate=100)
    assert groups[-2:] == [["playing"], ["newcomer"]]


def test_an_adaptive_guard_puts_the_stream_first_once_its_groups_took_long_enough() -> None:
    learnt = PlaybackGuard(adaptive=True)
    learnt.record(0.5, later_chunks=False)
    learnt.record(0.5, later_chunks=True)
    assert _playing_stream_then_a_first_chunk(learnt, sample_rate=100)[-2:] == [["playing"], ["newcomer"]]


def test_a_stream_with_audio_to_spare_or_no_guard_leaves_the_first_chunk_first() -> None:
    # 18 samples at 1 Hz: 18 s of audio in hand.
    assert _playing_stream_then_a_first_chunk(PlaybackGuard(1.0), sample_rate=1)[-2:] == [["newcomer"], ["playing"]]
    assert _playing_stream_then_a_first_chunk(PlaybackGuard(), sample_rate=100)[-2:] == [["newcomer"], ["playing"]]


class Lending:
    """Stands in for Token2Wav where lending the GPU is tested: a group that may lend stops halfway
    (``halfway``) until ``go_on``, then converts the first chunks waiting; every call gets its length in
    samples, and ``order`` lists the groups as they finish. A group of first chunks takes ``first_s``, a
    later group ``later_s`` of its own (half before lending, half after)."""

    def __init__(self, first_s: float = 0.0, later_s: float = 0.0) -> None:
        self.order: list[str] = []
        self.halfway, self.go_on = threading.Event(), threading.Event()
        self.first_s, self.later_s = first_s, later_s

    def convert(
        self,
        calls: Sequence[Conversion],
        on_result: Callable[[int, Audio | Exception], None] | None = None,
        *,
        between_segments: Callable[[], None] | None = None,
    ) -> list[Audio | Exception]:
        names = "+".join(c.session_id for c in calls)
        if between_segments is None:
            time.sleep(self.first_s)
        else:
            self.halfway.set()
            time.sleep(self.later_s / 2)
            assert self.go_on.wait(10)
            between_segments()
            time.sleep(self.later_s / 2)
        self.order.append(names)
        results: list[Audio | Exception] = [np.zeros(int(np.size(c.tokens)), dtype=np.float32) for c in calls]
        assert on_result is not None
        for index, result in enumerate(results):
            on_result(index, result)
        return results


def test_a_later_group_with_a_stream_about_to_run_dry_stops_lending_the_gpu() -> None:
    """Stream "playing" has 0.18 s of audio (18 samples at 100 Hz) and a 1 s guard: its next chunk's group
    converts the first chunks waiting between its halves only while none of its streams would run dry."""
    lending = Lending()
    order, halfway, go_on = lending.order, lending.halfway, lending.go_on

    answers = Answers()
    queue = ConversionQueue(lending, max_rows=4, playback_guard=PlaybackGuard(1.0), sample_rate=100)
    try:
        answers.expected = 5
        queue.submit(call("playing", 18, offset=0), answers("playing"))
        queue.submit(call("unfollowed", 60, offset=15), answers("unfollowed"))
        assert halfway.wait(10)
        queue.submit(call("newcomer", 18, offset=0), answers("newcomer"))
        go_on.set()
        deadline = time.monotonic() + 10
        while "unfollowed" not in order:
            assert time.monotonic() < deadline, order
            time.sleep(0.001)
        # A stream the queue did not see start lends as before: the newcomer went in between.
        assert order == ["playing", "newcomer", "unfollowed"]
        halfway.clear()
        go_on.clear()
        queue.submit(call("playing", 60, offset=15), answers("playing"))
        assert halfway.wait(10)
        queue.submit(call("second-newcomer", 18, offset=0), answers("second-newcomer"))
        go_on.set()
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    assert order[3:] == ["playing", "second-newcomer"]


def _lends_with(guard: PlaybackGuard, audio_samples: int) -> list[str]:
    """Stream "dry" gets a first chunk of ``audio_samples`` samples at 100 Hz; while the later group of
    "roomy" (a stream the queue did not see start: nothing to guard) is halfway, "dry"'s next chunk and
    a newcomer's first chunk wait. Returns the order the groups finish in (nested ones first)."""
    lending, answers = Lending(), Answers()
    queue = ConversionQueue(lending, max_rows=4, playback_guard=guard, sample_rate=100)
    try:
        answers.expected = 4
        queue.submit(call("dry", audio_samples, offset=0), answers("dry"))
        queue.submit(call("roomy", 300, offset=40), answers("roomy"))
        assert lending.halfway.wait(10)
        queue.submit(call("dry", audio_samples + 60, offset=15), answers("dry"))
        queue.submit(call("newcomer", 18, offset=0), answers("newcomer"))
        lending.go_on.set()
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    return lending.order


def test_a_later_group_stops_lending_the_gpu_when_another_streams_next_chunk_would_wait_too_long() -> None:
    # "dry" has 0.18 s of audio: "roomy" lent nothing; "dry"'s next chunk went first, the newcomer after it.
    assert _lends_with(PlaybackGuard(1.0), audio_samples=18) == ["dry", "roomy", "dry", "newcomer"]


class Spy(PlaybackGuard):
    def __init__(self) -> None:
        super().__init__(adaptive=True)
        self.recorded: list[tuple[bool, float]] = []

    def record(self, seconds: float, *, later_chunks: bool) -> None:
        self.recorded.append((later_chunks, seconds))
        super().record(seconds, later_chunks=later_chunks)


def test_the_queue_tells_the_guard_each_groups_own_time_without_what_it_lent() -> None:
    lending, guard, answers = Lending(first_s=0.2, later_s=0.05), Spy(), Answers()
    queue = ConversionQueue(lending, max_rows=4, playback_guard=guard)
    try:
        answers.expected = 2
        queue.submit(call("lender", 60, offset=15), answers("lender"))
        assert lending.halfway.wait(10)
        queue.submit(call("newcomer", 18, offset=0), answers("newcomer"))
        lending.go_on.set()
        assert answers.all_in.wait(10)
        # Then a later group with nothing to lend to, and an offline call.
        answers.expected, answers.all_in = 3, threading.Event()
        queue.submit(call("lender", 100, offset=60), answers("lender"))
        assert answers.all_in.wait(10)
        answers.expected, answers.all_in = 4, threading.Event()
        queue.submit(call("offline", 40), answers("offline"))
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    # The newcomer's group ran inside the lender's; the later groups count their own 0.05 s only, and the
    # offline call is not the guard's business.
    kinds = [later for later, _ in guard.recorded]
    assert kinds == [False, True, True]
    (_, first_s), (_, lender_s), (_, alone_s) = guard.recorded
    assert first_s >= 0.2
    assert all(0.05 <= seconds < 0.2 for seconds in (lender_s, alone_s))
    assert guard.horizon_s() == first_s + max(lender_s, alone_s)


def test_a_group_that_fails_tells_the_guard_nothing() -> None:
    recorder, guard, answers = Recorder(fail_on="broken"), Spy(), Answers()
    recorder.release.set()
    queue = ConversionQueue(recorder, max_rows=4, playback_guard=guard)
    try:
        answers.expected = 1
        queue.submit(call("broken", 60, offset=15), answers("broken"))
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    assert isinstance(answers.got["broken"][0], GroupFailed)
    assert guard.recorded == []


def _submit_every(queue: ConversionQueue, answers: Answers, names: list[str], interval_s: float) -> float:
    """Submits a first chunk per name, ``interval_s`` apart; returns when the first was submitted."""
    started = time.monotonic()
    for index, name in enumerate(names):
        time.sleep(max(0.0, started + index * interval_s - time.monotonic()))
        queue.submit(call(name, 18, offset=0), answers(name))
    return started


def test_calls_arriving_together_at_an_idle_queue_are_gathered_into_one_group() -> None:
    recorder, answers = Recorder(), Answers()
    recorder.release.set()
    # A burst 10 ms apart, well inside the quiet time (a quarter of 0.8 s); then a lone call.
    queue = ConversionQueue(recorder, max_rows=8, gather_s=0.8)
    try:
        answers.expected = 3
        _submit_every(queue, answers, ["a", "b", "c"], 0.01)
        assert answers.all_in.wait(10)
        answers.expected, answers.all_in = 4, threading.Event()
        lone = time.monotonic()
        queue.submit(call("lone", 18, offset=0), answers("lone"))
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    assert recorder.groups == [["a", "b", "c"], ["lone"]]
    # The lone call waited for the quiet time only, not for the whole gathering time.
    assert 0.2 <= answers.groups["lone"].started - lone < 0.6


def test_gathering_ends_when_the_group_is_full_or_its_time_is_up() -> None:
    recorder, answers = Recorder(), Answers()
    recorder.release.set()
    queue = ConversionQueue(recorder, max_rows=3, gather_s=0.8)
    try:
        answers.expected = 4
        started = _submit_every(queue, answers, ["a", "b", "c", "d"], 0.0)
        assert answers.all_in.wait(10)
        # A full group goes at once.
        assert recorder.groups[0] == ["a", "b", "c"]
        assert answers.groups["a"].started - started < 0.15
    finally:
        queue.close()
    recorder, answers = Recorder(), Answers()
    recorder.release.set()
    queue = ConversionQueue(recorder, max_rows=64, gather_s=0.4)
    try:
        # Calls keep coming, 50 ms apart, for 1.5 s: the first group still goes after 0.4 s.
        names = [f"call-{index}" for index in range(30)]
        answers.expected = len(names)
        started = _submit_every(queue, answers, names, 0.05)
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    assert 0.4 <= answers.groups["call-0"].started - started < 0.8
    assert 3 <= len(recorder.groups[0]) < len(names)


def test_without_gathering_the_first_call_of_a_burst_goes_alone() -> None:
    recorder, answers = Recorder(), Answers()
    queue = ConversionQueue(recorder, max_rows=8)
    try:
        answers.expected = 3
        queue.submit(call("a", 18, offset=0), answers("a"))
        assert recorder.started.wait(10)
        queue.submit(call("b", 18, offset=0), answers("b"))
        queue.submit(call("c", 18, offset=0), answers("c"))
        recorder.release.set()
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    assert recorder.groups == [["a"], ["b", "c"]]


def test_a_call_that_arrives_while_a_group_converts_is_not_held_back_afterwards() -> None:
    recorder, answers = Recorder(), Answers()
    queue = ConversionQueue(recorder, max_rows=8, gather_s=0.8)
    try:
        answers.expected = 2
        queue.submit(call("a", 18, offset=0), answers("a"))
        assert recorder.started.wait(10)
        queue.submit(call("b", 18, offset=0), answers("b"))
        released = time.monotonic()
        recorder.release.set()
        assert answers.all_in.wait(10)
    finally:
        queue.close()
    # The queue was busy, not idle, when "b" came: its group follows at once, not after a quiet time (0.2 s).
    assert answers.groups["b"].started - released < 0.15


@pytest.mark.parametrize("gather_s", [-0.001, math.inf, math.nan])
def test_a_gathering_time_that_is_negative_or_not_finite_is_refused(gather_s: float) -> None:
    with pytest.raises(ValueError, match="gather_s"):
        ConversionQueue(Recorder(), max_rows=4, gather_s=gather_s)


class Releases:
    """Counts the idle releases; ``fail`` makes the next one raise."""

    def __init__(self) -> None:
        self.count = 0
        self.fail = False
        self.happened = threading.Event()

    def __call__(self) -> None:
        self.count += 1
        self.happened.set()
        if self.fail:
            self.fail = False
            raise OSError("no heap to trim")


def _convert_one(queue: ConversionQueue, answers: Answers, name: str) -> None:
    answers.expected += 1
    answers.all_in = threading.Event()
    queue.submit(call(name, 18, offset=0), answers(name))
    assert answers.all_in.wait(10)


def test_memory_goes_back_once_after_the_queue_falls_idle_and_again_after_more_work() -> None:
    recorder, answers, releases = Recorder(), Answers(), Releases()
    recorder.release.set()
    queue = ConversionQueue(recorder, max_rows=4, idle_release=releases, idle_release_s=0.05)
    try:
        # Nothing converted yet: nothing to give back.
        time.sleep(0.3)
        assert releases.count == 0
        _convert_one(queue, answers, "a")
        assert releases.happened.wait(10)
        # Once per idle spell, however long it lasts.
        time.sleep(0.3)
        assert releases.count == 1
        releases.happened.clear()
        _convert_one(queue, answers, "b")
        assert releases.happened.wait(10)
        time.sleep(0.2)
        assert releases.count == 2
    finally:
        queue.close()
    assert recorder.groups == [["a"], ["b"]]


def test_no_memory_goes_back_while_calls_keep_the_queue_busy() -> None:
    recorder, answers, releases = Recorder(), Answers(), Releases()
    recorder.release.set()
    queue = ConversionQueue(recorder, max_rows=4, idle_release=releases, idle_release_s=2.0)
    try:
        # Ten calls 50 ms apart: the queue never stands empty for 2 s.
        for index in range(10):
            _convert_one(queue, answers, f"call-{index}")
            time.sleep(0.05)
        assert releases.count == 0
    finally:
        queue.close()
    assert len(recorder.groups) == 10


def test_a_failing_idle_release_is_logged_and_the_queue_goes_on() -> None:
    recorder, answers, releases = Recorder(), Answers(), Releases()
    recorder.release.set()
    releases.fail = True
    errors: list[str] = []
    queue = ConversionQueue(recorder, max_rows=4, log_error=errors.append, idle_release=releases, idle_release_s=0.05)
    try:
        _convert_one(queue, answers, "a")
        assert releases.happened.wait(10)
        _convert_one(queue, answers, "b")
    finally:
        queue.close()
    assert [np.size(result) for result in answers.got["b"]] == [18]
    assert len(errors) == 1 and "no heap to trim" in errors[0]


@pytest.mark.parametrize("idle_release_s", [0.0, -1.0, math.inf, math.nan])
def test_an_idle_release_time_that_is_not_a_positive_finite_number_is_refused(idle_release_s: float) -> None:
    with pytest.raises(ValueError, match="idle_release_s"):
        ConversionQueue(Recorder(), max_rows=4, idle_release=Releases(), idle_release_s=idle_release_s)
