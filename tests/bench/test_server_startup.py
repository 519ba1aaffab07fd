"""The server's start read from its log (the GPU benchmark's report shows it)."""

from __future__ import annotations

from benchmarks.server_startup import load_timeline

LOG = (
    """I1125 23:59:58.354058 668 model_lifecycle.cc:472] "loading: token2wav:1"
I1125 23:59:59.100000 668 pb_stub.cc:300] "token2wav: tts_gateway.models.cosyvoice2.engine: weights loaded in 2.5 s"
W1125 23:59:59.200000 668 pb_stub.cc:300] "llm: tts_gateway.models.cosyvoice2.engines.llm_engine: a warning"
I1126 00:00:01.000000 668 pb_stub.cc:300] "token2wav: something else: not ours"
"""
    + (
        # Another process's progress bar, written without a newline, runs on into a record.
        "Loading weights:   0%|          | 0/28 [00:00<?, ?it/s]"
        'I1126 00:00:02.000000 668 pb_stub.cc:300] "llm: tts_gateway.models.cosyvoice2.engines.llm: loaded"\n'
    )
    + """  a continuation line
I1126 00:01:30.480537 668 model_lifecycle.cc:839] "successfully loaded 'token2wav'"
"""
)


def test_the_timeline_lists_the_backends_records_and_the_loads_timed_from_the_first_line() -> None:
    assert load_timeline(LOG) == [
        "+1 s token2wav: weights loaded in 2.5 s",
        "+1 s llm: a warning",
        "+4 s llm: loaded",
        "+92 s token2wav: loaded",
    ]


def test_a_log_without_triton_lines_has_no_timeline() -> None:
    assert load_timeline("starting\n") == []
