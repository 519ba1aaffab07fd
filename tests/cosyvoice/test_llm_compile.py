"""The LLM engine's decode step over attention spans and with its regions compiled: the same tokens.

The GPU profile compiles with inductor; here ``aot_eager`` runs the same dynamo and AOTAutograd
tracing with symbolic shapes on the CPU, without generating kernels.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from tests.cosyvoice.test_llm_bistream import (
    PROMPT_SPEECH,
    PROMPT_TEXT,
    TEXT,
    open_stream,
    wait_idle,
    write_llm_that_fills,
)
from tests.cosyvoice.test_llm_engine import GREEDY, SAMPLED, submit
from tts_gateway.models.cosyvoice2.checkpoints import tiny_frontend
from tts_gateway.models.cosyvoice2.engines.llm import SamplingParams, TorchSpeechLLM
from tts_gateway.models.cosyvoice2.engines.llm_engine import TextStreamHandle

pytestmark = [pytest.mark.cosyvoice, pytest.mark.usefixtures("one_torch_thread")]

SLOTS = 4
MAX_LEN = 128
SPANS = (16, 32, 64)
# Prompts of 8 to 12 ids and 90 new tokens: every request crosses the spans 16, 32 and 64.
TOKENS = 90


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_frontend.write_tiny_llm(tmp_path_factory.mktemp("llm") / "cosyvoice2_llm")


@pytest.fixture(scope="module")
def whole(llm_dir: Path) -> Iterator[TorchSpeechLLM]:
    """Every step attends to all positions of a slot."""
    model = TorchSpeechLLM(llm_dir, max_slots=SLOTS, max_seq_len=MAX_LEN, spans=())
    yield model
    model.close()


def together(llm: TorchSpeechLLM, params: SamplingParams, count: int = 6) -> list[list[int]]:
    """``count`` seeded requests submitted at once (more than the slots: some join later)."""
    runs = [submit(llm, index, params, tokens=TOKENS) for index in range(count)]
    for recorder, _ in runs:
        assert recorder.done.wait(120)
        assert recorder.error is None
    return [recorder.tokens for recorder, _ in runs]


def _compiled_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def test_spans_are_the_smallest_that_hold_a_position(llm_dir: Path) -> None:
    model = TorchSpeechLLM(llm_dir, max_slots=1, max_seq_len=MAX_LEN, spans=(*SPANS, 500))
    try:
        decoder = model.engine._decoder
        assert decoder.spans == (*SPANS, MAX_LEN)
        assert [decoder.span_for(end) for end in (1, 16, 17, 64, 65, 128)] == [16, 16, 32, 64, 128, 128]
        with pytest.raises(ValueError, match="past the cache"):
            decoder.span_for(129)
    finally:
        model.close()


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_steps_over_growing_spans_draw_what_steps_over_whole_slots_draw(
    llm_dir: Path, whole: TorchSpeechLLM, params: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    spanned = TorchSpeechLLM(llm_dir, max_slots=SLOTS, max_seq_len=MAX_LEN, spans=SPANS)
    decoder = spanned.engine._decoder
    used: set[int] = set()
    decode = decoder.decode

    def recording(tokens: Any, positions: Any, span: int) -> Any:
        # Every row's position lies within the span its step reads.
        assert int(positions.max()) < span
        used.add(span)
        return decode(tokens, positions, span)

    monkeypatch.setattr(decoder, "decode", recording)
    try:
        assert together(spanned, params) == together(whole, params)
    finally:
        spanned.close()
    assert used == {*SPANS, MAX_LEN}


def test_compiled_regions_draw_the_uncompiled_tokens_without_compiling_after_load(
    llm_dir: Path, whole: TorchSpeechLLM
) -> None:
    before = _compiled_graphs()
    compiled = TorchSpeechLLM(llm_dir, max_slots=SLOTS, max_seq_len=MAX_LEN, spans=SPANS, compile_backend="aot_eager")
    loaded = _compiled_graphs()
    try:
        # The layers' alike regions share their graphs: one per region kind and shape class
        # (one row or several; a decode step, a prompt or an extend pass), not one per layer.
        assert 0 < loaded - before <= 14
        for params in (GREEDY, SAMPLED):
            assert together(compiled, params) == together(whole, params)
        one = submit(compiled, 9, SAMPLED, tokens=5)[0]
        assert one.done.wait(60) and len(one.tokens) == 5
    finally:
        compiled.close()
    assert _compiled_graphs() == loaded


def test_logits_copied_out_of_a_recorded_prefill_compile_nothing_more(
    llm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA the engine's thread copies a recorded prefill's logits out of the graph's buffer; the sampler
    must take that copy as it took the logits it was compiled with."""
    compiled = TorchSpeechLLM(llm_dir, max_slots=SLOTS, max_seq_len=MAX_LEN, spans=SPANS, compile_backend="aot_eager")
    decoder = compiled.engine._decoder
    prefill = decoder.prefill
    monkeypatch.setattr(decoder, "prefill", lambda *args, **kwargs: prefill(*args, **kwargs).clone())
    loaded = _compiled_graphs()
    try:
        # Several prompts admitted at once, then one at a time as slots free up.
        assert all(together(compiled, SAMPLED))
    finally:
        compiled.close()
    assert _compiled_graphs() == loaded


def test_a_compile_that_fails_says_how_to_run_without(llm_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="empty compile_backend runs it uncompiled"):
        TorchSpeechLLM(llm_dir, max_slots=1, max_seq_len=MAX_LEN, compile_backend="no-such-backend")


def test_rounds_of_a_compiled_engine_compile_nothing_after_load(tmp_path: Path) -> None:
    # A round that comes back through an extend pass draws from logits copied out of the pass's buffer
    # (recorded on CUDA, the same buffer on the CPU), one fed in place from the decode steps' with rows
    # marked forced: a sampler compiled again for either would stall every round while serving.
    llm_dir = write_llm_that_fills(tmp_path / "cosyvoice2_llm")
    compiled = TorchSpeechLLM(llm_dir, max_slots=2, max_seq_len=512, compile_backend="aot_eager")
    loaded = _compiled_graphs()
    engine = compiled.engine
    rounds: list[int] = []
    in_place: list[bool] = []
    extend, feed = engine._round_logits, engine._feed_in_place

    def counted_extend(first: int, handles: Sequence[TextStreamHandle]) -> torch.Tensor:
        rounds.append(len(handles))
        return extend(first, handles)

    def counted_feed(handle: TextStreamHandle, token_id: int, *, in_flight: bool) -> bool:
        in_place.append(feed(handle, token_id, in_flight=in_flight))
        return in_place[-1]

    engine._round_logits = counted_extend  # type: ignore[method-assign]
    engine._feed_in_place = counted_feed  # type: ignore[method-assign]
    try:
        # One stream given its whole text (its rounds fed in place), one given pieces it waits for (its
        # rounds come back through extend passes).
        whole, whole_handle = open_stream(compiled, PROMPT_TEXT, PROMPT_SPEECH)
        whole_handle.add_text(TEXT)
        whole_handle.end_text()
        pieces, pieces_handle = open_stream(compiled, PROMPT_TEXT, PROMPT_SPEECH)
        for start in range(0, len(TEXT), 4):
            pieces_handle.add_text(TEXT[start : start + 4])
            wait_idle(pieces)
        pieces_handle.end_text()
        for recorder in (whole, pieces):
            assert recorder.done.wait(120)
            assert recorder.error is None
    finally:
        compiled.close()
    assert rounds and True in in_place
    assert _compiled_graphs() == loaded
