"""The GPU benchmark's playback stall: how long a listener playing a stream from its first chunk waits."""

from __future__ import annotations

import pytest

from benchmarks.gpu_cosyvoice2 import PassResult, RequestResult, _stalls, playback_stall_s


def test_chunks_that_arrive_before_the_audio_runs_out_do_not_stall() -> None:
    # 1 s, then 1 s arriving 0.9 s later, then 0.5 s arriving at 1.5 s: always audio in hand.
    assert playback_stall_s([(10.0, 100), (10.9, 100), (11.5, 50)], sample_rate=100) == 0.0


def test_a_late_chunk_stalls_by_its_lateness_and_playback_resumes_from_it() -> None:
    # 0.5 s of audio, the next 0.5 s arrives 0.8 s later (0.3 s late); the third is due at 11.3 s, comes at 11.4.
    stall = playback_stall_s([(10.0, 50), (10.8, 50), (11.4, 50)], sample_rate=100)
    assert stall == pytest.approx(0.4)


def test_a_stream_that_finishes_within_its_length_can_still_stall() -> None:
    result = RequestResult(prompt=0, voice="v", audio_s=2.0, first_chunk_ms=100.0, total_ms=1900.0, chunks=2)
    stalled = RequestResult(
        prompt=1, voice="v", audio_s=2.0, first_chunk_ms=100.0, total_ms=1900.0, chunks=2, stall_ms=300.0
    )
    summary = PassResult("direct", "stream", 2, 2.0, None, [result, stalled]).summary()
    assert (summary["behind_real_time"], summary["stalled"], summary["stall_ms_max"]) == (0, 1, 300.0)


def test_offline_passes_and_reports_from_before_the_figure_show_no_stalls() -> None:
    offline = PassResult("direct", "offline", 1, 1.0, None, [RequestResult(0, "v", 2.0, 900.0, 900.0, 1)]).summary()
    assert (offline["stalled"], offline["stall_ms_max"]) == (None, None)
    assert _stalls(offline) == "-"
    older = {"mode": "stream", "behind_real_time": 0}
    assert _stalls(older) == "-"
    assert _stalls({"mode": "stream", "stalled": 2, "stall_ms_max": 312.4}) == "2 (312)"
