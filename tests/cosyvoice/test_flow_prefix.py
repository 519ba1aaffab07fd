"""The voice prefix cache: streaming chunks solved after a recorded prompt prefix equal chunks solved whole."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

from tts_gateway.models.cosyvoice2.checkpoints.config_writer import tiny_config
from tts_gateway.models.cosyvoice2.engines.flow_graphs import FlowSolverGraphs
from tts_gateway.models.cosyvoice2.engines.token2wav import Conversion, Token2Wav
from tts_gateway.models.cosyvoice2.model.flow import CausalFlow, FlowItem
from tts_gateway.models.cosyvoice2.model.flow_prefix import (
    PrefixReplay,
    StackedPrefixes,
    VoicePrefix,
    VoicePrefixCache,
    chunk_alignment,
    frames_within,
    prefix_frames,
    prefix_nbytes,
    replay_rows,
    voice_key,
)
from tts_gateway.models.cosyvoice2.model.frontend import VoicePrompt

pytestmark = pytest.mark.cosyvoice

PROMPT_TOKENS = 80  # 160 prompt frames; the prefix is 150 (three 50-frame chunks, look-ahead inside the prompt)


@pytest.fixture(scope="module")
def flow() -> CausalFlow:
    torch.manual_seed(0)
    return CausalFlow(tiny_config().flow).eval()


def prompt(seed: int, tokens: int = PROMPT_TOKENS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 6561, (tokens,), generator=generator),
        torch.randn(2 * tokens, 80, generator=generator),
        torch.randn(192, generator=generator),
    )


def chunk(voice: tuple[torch.Tensor, torch.Tensor, torch.Tensor], tokens: int, seed: int) -> FlowItem:
    target = torch.randint(0, 6561, (tokens,), generator=torch.Generator().manual_seed(seed))
    return FlowItem(target, *voice, streaming=True, finalize=False)


def test_the_prefix_ends_on_a_chunk_boundary_its_look_ahead_does_not_cross() -> None:
    assert chunk_alignment(50, 25, 2) == 50
    assert chunk_alignment(50, 0, 2) == 50
    # 80 tokens: frames up to token 77 (154) are safe; the last whole chunk ends at 150.
    assert prefix_frames(80, lookahead=3, ratio=2, align=50, limit=10_000) == 150
    assert prefix_frames(78, lookahead=3, ratio=2, align=50, limit=10_000) == 150
    assert prefix_frames(77, lookahead=3, ratio=2, align=50, limit=10_000) == 100
    assert prefix_frames(80, lookahead=3, ratio=2, align=50, limit=120) == 100
    assert prefix_frames(20, lookahead=3, ratio=2, align=50, limit=10_000) == 0


def test_streaming_chunks_after_the_prefix_equal_chunks_solved_whole(flow: CausalFlow) -> None:
    voice = prompt(1)
    frames = flow.prefix_frames(PROMPT_TOKENS)
    assert frames == 150
    prefix = flow.record_prefix(*voice, frames)
    for tokens in (18, 43, 100):
        item = chunk(voice, tokens, tokens)
        whole = flow.inference_batch([item])[0]
        after = flow.inference_batch([item], prefixes=[prefix])[0]
        assert after.shape == whole.shape == (80, 2 * (tokens - 3))
        torch.testing.assert_close(after, whole, rtol=1e-5, atol=1e-5)


def test_rows_of_one_voice_share_the_prefix_in_one_batch(flow: CausalFlow) -> None:
    voice = prompt(2)
    prefix = flow.record_prefix(*voice, flow.prefix_frames(PROMPT_TOKENS))
    items = [chunk(voice, 20, 1), chunk(voice, 57, 2), chunk(voice, 31, 3)]
    after_prefix = flow.inference_batch(items, prefixes=[prefix] * 3)
    for whole, after in zip(flow.inference_batch(items), after_prefix, strict=True):
        torch.testing.assert_close(after, whole, rtol=1e-5, atol=1e-5)


def test_rows_of_several_voices_share_one_solve_each_after_its_own_prefix(flow: CausalFlow) -> None:
    """Voices with prefixes of 150 and 100 frames: each row's frames start after its own."""
    long_voice, short_voice = prompt(8), prompt(9, tokens=60)
    long_prefix, short_prefix = flow.record_prefix(*long_voice, 150), flow.record_prefix(*short_voice, 100)
    items = [chunk(long_voice, 20, 1), chunk(short_voice, 57, 2), chunk(long_voice, 31, 3), chunk(short_voice, 18, 4)]
    mixed = flow.inference_batch(items, prefixes=[long_prefix, short_prefix, long_prefix, short_prefix])
    for item, after in zip(items, mixed, strict=True):
        torch.testing.assert_close(after, flow.inference_batch([item])[0], rtol=1e-5, atol=1e-5)


def test_an_eager_solve_stacks_voices_only_as_it_takes_their_tensors(flow: CausalFlow) -> None:
    one, other = flow.record_prefix(*prompt(14), 150), flow.record_prefix(*prompt(15, tokens=60), 100)
    alone = StackedPrefixes([one], 150)
    assert len(alone) == len(one.tensors) and all(alone[i] is one.tensors[i] for i in range(len(one.tensors)))
    both = StackedPrefixes([one, other], 150)
    for index, recorded in enumerate(other.tensors):
        stacked = both[index]
        assert stacked.size(0) == 4
        torch.testing.assert_close(stacked[2:, :, : recorded.size(2)], recorded)
        if recorded.dim() == 4:
            assert stacked.size(2) == 150 and not stacked[2:, :, 100:].any()


def test_a_prefix_padded_into_a_larger_buffer_gives_the_same_frames(flow: CausalFlow) -> None:
    """What the CUDA graphs do: the prefix sits in a slot of fixed-size buffers, its unused frames masked."""
    voice = prompt(3)
    prefix = flow.record_prefix(*voice, 100)
    item = chunk(voice, 30, 4)
    expected = flow.inference_batch([item], prefixes=[prefix])[0]

    capacity = 250
    padded = []
    for tensor in prefix.tensors:
        # Slot 1 of two; the other slot and the unused frames hold garbage that must not count.
        shape = [4, *tensor.shape[1:]]
        if tensor.dim() == 4:  # keys and values [2, heads, frames, d]; the rest is convolutions' left context
            shape[2] = capacity
        buffer = torch.full(shape, 7.0)
        buffer[2:, :, : tensor.size(2)] = tensor
        padded.append(buffer)
    entries, visible = replay_rows([1], [prefix.frames], 1, capacity, torch.device("cpu"))
    assert entries.tolist() == [2, 3] and visible.sum(dim=1).tolist() == [prefix.frames] * 2

    def padded_solver(mu, mask, speaker, cond, streaming, given, between_segments=None, n_timesteps=None):  # type: ignore[no-untyped-def]
        assert list(given) == [prefix]
        return flow.decoder(
            mu,
            mask,
            speaker,
            cond,
            10,
            streaming,
            noise=flow.decoder.noise(prefix.frames, mu.size(2)),
            tape=PrefixReplay(padded, entries, visible),
        )

    got = flow.inference_batch([item], prefixes=[prefix], solver=padded_solver)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def cpu_graphs(flow: CausalFlow, *, max_rows: int = 2, prefix_voices: int = 4) -> FlowSolverGraphs:
    """Buckets of 1-2 rows and 128-256 frames, both families (prefix buffers of 200 frames), replayed eagerly."""
    return FlowSolverGraphs(
        flow.decoder,
        n_timesteps=10,
        mel_bins=80,
        max_rows=max_rows,
        max_frames=256,
        frame_step=128,
        device=torch.device("cpu"),
        dtype=torch.float32,
        prefix_frames=200,
        prefix_voices=prefix_voices,
    )


def test_the_graph_solver_replays_after_each_voice_prefix_as_the_eager_solve(flow: CausalFlow) -> None:
    """FlowSolverGraphs' buffers and buckets, solved eagerly on the CPU (on CUDA they are graph replays)."""
    graphs = cpu_graphs(flow)
    assert graphs.buckets == [(r, f, p) for r in (1, 2) for f in (128, 256) for p in (False, True)]
    # A longer prefix, then a shorter one whose unused buffer frames still hold the first voice's.
    for voice, frames in ((prompt(6), 150), (prompt(7, tokens=60), 100), (prompt(6), 150)):
        assert flow.prefix_frames(voice[0].numel()) == frames
        prefix = flow.record_prefix(*voice, frames)
        items = [chunk(voice, 20, 1), chunk(voice, 45, 2)]
        whole = flow.inference_batch(items)
        replayed = flow.inference_batch(items, solver=graphs, prefixes=[prefix, prefix])
        for want, got in zip(whole, replayed, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for want, got in zip(whole, flow.inference_batch(items, solver=graphs), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    too_long = VoicePrefix(250, prefix.steps, prefix.tensors)
    mu = torch.zeros(1, 80, 100)
    streaming = torch.ones(1, dtype=torch.bool)
    assert graphs(mu, torch.ones(1, 1, 100), torch.zeros(1, 80), mu, streaming, [too_long]) is None


def test_a_prefix_recorded_for_the_buffers_frames_fills_whole_slots_alike(flow: CausalFlow) -> None:
    """What token2wav records where CUDA graphs replay: keys and values for the buffers' 200 frames, zeros after
    the voice's 150, copied into a slot whole."""
    graphs = cpu_graphs(flow)
    voice = prompt(13)
    prefix = flow.record_prefix(*voice, 150, capacity=200)
    assert (prefix.frames, prefix.capacity) == (150, 200)
    assert all(t.size(2) == 200 and not t[:, :, 150:].any() for t in prefix.tensors if t.dim() == 4)
    items = [chunk(voice, 20, 1), chunk(voice, 45, 2)]
    for want, got in zip(
        flow.inference_batch(items), flow.inference_batch(items, solver=graphs, prefixes=[prefix] * 2), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_graph_solver_solves_rows_of_several_voices_in_one_replay_up_to_its_slots(flow: CausalFlow) -> None:
    graphs = cpu_graphs(flow, max_rows=4, prefix_voices=2)
    voices = [prompt(10), prompt(11, tokens=60), prompt(12)]
    recorded = [flow.record_prefix(*voice, flow.prefix_frames(voice[0].numel())) for voice in voices]
    items = [chunk(voices[1], 20, 1), chunk(voices[0], 45, 2), chunk(voices[1], 33, 3)]
    replayed = flow.inference_batch(items, solver=graphs, prefixes=[recorded[1], recorded[0], recorded[1]])
    for item, got in zip(items, replayed, strict=True):
        torch.testing.assert_close(got, flow.inference_batch([item])[0], rtol=1e-5, atol=1e-5)
    mu = torch.zeros(3, 80, 100)
    streaming = torch.ones(3, dtype=torch.bool)
    assert graphs(mu, torch.ones(3, 1, 100), torch.zeros(3, 80), mu, streaming, recorded) is None


def test_a_prefix_serves_only_streaming_chunks_of_a_long_enough_prompt(flow: CausalFlow) -> None:
    voice = prompt(4)
    prefix = flow.record_prefix(*voice, 100)
    offline = FlowItem(torch.arange(10), *voice, streaming=False, finalize=True)
    with pytest.raises(ValueError, match="streaming"):
        flow.inference_batch([offline], prefixes=[prefix])
    with pytest.raises(ValueError, match="not a recordable prefix"):
        flow.record_prefix(*voice, 200)
    with pytest.raises(ValueError, match="not a recordable prefix"):
        flow.record_prefix(*prompt(5, tokens=20), 50)


def test_voices_are_keyed_by_their_contents() -> None:
    rng = np.random.default_rng(0)
    tokens, feats, embedding = rng.integers(0, 6561, 40), rng.standard_normal((80, 80)), rng.standard_normal(192)
    assert voice_key(tokens, feats, embedding) == voice_key(tokens.copy(), feats.copy(), embedding.copy())
    changed = feats.copy()
    changed[3, 3] += 1e-3
    assert voice_key(tokens, changed, embedding) != voice_key(tokens, feats, embedding)


def _entry(megabytes: int) -> VoicePrefix:
    return VoicePrefix(50, 10, (torch.zeros(megabytes << 18),))  # float32: 4 bytes each


def test_the_cache_makes_room_only_by_dropping_idle_voices_least_recently_used_first() -> None:
    now = [0.0]
    cache = VoicePrefixCache(3 << 20, idle_s=60.0, clock=lambda: now[0])
    assert cache.put("a", _entry(1)) and cache.put("b", _entry(1))
    now[0] = 10.0
    assert cache.get("a") is not None  # a is used again: b is now the least recently used
    # Both in use: a third voice that does not fit is not admitted, and nobody is dropped for it.
    assert not cache.make_room(2 << 20)
    assert not cache.put("c", _entry(2))
    assert cache.get("c") is None and len(cache) == 2
    # Once b has been idle for a minute, it makes room; a (used at 10 s) is not idle yet.
    now[0] = 65.0
    assert cache.put("c", _entry(2))
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.nbytes == 3 << 20
    assert not cache.put("huge", _entry(4))  # larger than the whole budget
    assert len(cache) == 2


def test_the_size_of_a_prefix_is_known_before_it_is_recorded(flow: CausalFlow) -> None:
    estimator = flow.decoder.estimator
    prefix = flow.record_prefix(*prompt(6), 100, n_timesteps=4)
    assert prefix.nbytes == prefix_nbytes(estimator, 4, 100)
    assert frames_within(estimator, 4, prefix.nbytes) == 100
    assert frames_within(estimator, 4, prefix.nbytes - 1) == 99
    assert frames_within(estimator, 4, prefix_nbytes(estimator, 4, 0) - 1) == 0


def test_a_prefix_replays_only_with_the_steps_it_was_recorded_over(flow: CausalFlow) -> None:
    voice = prompt(7)
    prefix = flow.record_prefix(*voice, 100, n_timesteps=10)
    with pytest.raises(ValueError, match="recorded over 10 solver steps, not 5"):
        flow.inference_batch([chunk(voice, 20, 1)], n_timesteps=5, prefixes=[prefix])


# --- through Token2Wav ---------------------------------------------------------------------------


def voice(seed: int, tokens: int = PROMPT_TOKENS) -> VoicePrompt:
    rng = np.random.default_rng(seed)
    return VoicePrompt(
        speech_tokens=rng.integers(0, 6561, tokens),
        feats=rng.standard_normal((2 * tokens, 80)).astype(np.float32),
        embedding=rng.standard_normal(192).astype(np.float32),
    )


def stream(t2w: Token2Wav, session: str, speaker: VoicePrompt, hops: list[int]) -> list[NDArray[np.float32]]:
    """A whole stream: chunks ending at each of ``hops`` tokens (plus look-ahead), then the final chunk."""
    tokens = np.random.default_rng(len(session)).integers(0, 6561, hops[-1] + 10)
    pieces, offset = [], 0
    for hop in hops:
        pieces.append(t2w.stream_chunk(session, tokens[: hop + 3], speaker, offset, False))
        offset = hop
    pieces.append(t2w.stream_chunk(session, tokens, speaker, offset, True))
    return pieces


def test_a_stream_sounds_the_same_with_and_without_the_prefix_cache(token2wav_dir: Path) -> None:
    plain = Token2Wav.from_model_dir(token2wav_dir)
    cached = Token2Wav.from_model_dir(token2wav_dir, prefix_cache_mb=64)
    assert cached.prefix_cache is not None
    speakers = [voice(1), voice(2)]
    for index, speaker in enumerate(speakers * 2):
        hops = [15, 40, 90]
        expected = stream(plain, f"s{index}", speaker, hops)
        got = stream(cached, f"s{index}", speaker, hops)
        for want, have in zip(expected, got, strict=True):
            assert have.shape == want.shape
            np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-4)
    assert len(cached.prefix_cache) == 2  # one recorded prefix per voice, reused by its later streams


def test_voices_beyond_the_budget_run_without_a_prefix_instead_of_evicting_each_other(
    token2wav_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = Token2Wav.from_model_dir(token2wav_dir)
    cached = Token2Wav.from_model_dir(token2wav_dir, prefix_cache_mb=64)
    assert cached.prefix_cache is not None
    estimator = cached.flow.decoder.estimator
    frames = cached.flow.prefix_frames(PROMPT_TOKENS, cached.prefix_limit)
    # Room for one voice's prefix only.
    cached.prefix_cache.max_bytes = prefix_nbytes(estimator, cached.n_timesteps, frames)
    recorded: list[int] = []
    record = cached.flow.record_prefix
    monkeypatch.setattr(cached.flow, "record_prefix", lambda *a, **k: recorded.append(1) or record(*a, **k))
    speakers = [voice(1), voice(2)]
    for index, speaker in enumerate(speakers * 3):  # the two voices take turns
        expected, got = (stream(t2w, f"p{index}", speaker, [15, 40]) for t2w in (plain, cached))
        for want, have in zip(expected, got, strict=True):
            np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-4)
    assert len(recorded) == 1, "the first voice is recorded once and kept; the second is never recorded"
    assert len(cached.prefix_cache) == 1


def test_short_prompts_offline_calls_and_final_chunks_do_not_use_the_cache(token2wav_dir: Path) -> None:
    plain = Token2Wav.from_model_dir(token2wav_dir)
    cached = Token2Wav.from_model_dir(token2wav_dir, prefix_cache_mb=64)
    assert cached.prefix_cache is not None
    short = voice(3, tokens=20)
    for t2w in (plain, cached):
        t2w.convert([Conversion("short", np.arange(30), short, 0, False)])
    long = voice(4)
    offline = [t2w.offline(np.arange(40), long) for t2w in (plain, cached)]
    final = [t2w.stream_chunk("final", np.arange(40), long, 0, True) for t2w in (plain, cached)]
    assert len(cached.prefix_cache) == 0
    assert np.array_equal(offline[0], offline[1]) and np.array_equal(final[0], final[1])


def test_a_solve_after_a_prefix_lends_its_buffers_between_segments_and_gets_them_back(flow: CausalFlow) -> None:
    graphs = cpu_graphs(flow)
    voice, other_voice = prompt(6), prompt(7, tokens=60)
    prefix, other_prefix = flow.record_prefix(*voice, 150), flow.record_prefix(*other_voice, 100)
    items, others = [chunk(voice, 20, 1), chunk(voice, 45, 2)], [chunk(other_voice, 18, 3)]
    meanwhile: list[list[torch.Tensor]] = []

    def another_voice_meanwhile() -> None:
        # A shorter prefix: it leaves fewer of the buffers' frames visible, which the first solve must undo.
        meanwhile.append(flow.inference_batch(others, solver=graphs, prefixes=[other_prefix]))

    got = flow.inference_batch(items, solver=graphs, prefixes=[prefix] * 2, between_segments=another_voice_meanwhile)
    assert len(meanwhile) == 1
    for want, solved in zip(flow.inference_batch(items), got, strict=True):
        torch.testing.assert_close(solved, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(meanwhile[0][0], flow.inference_batch(others)[0], rtol=1e-5, atol=1e-5)


def test_a_prefix_recorded_over_other_steps_is_not_replayed(flow: CausalFlow) -> None:
    graphs = cpu_graphs(flow)
    voice = prompt(6)
    twenty_steps = flow.record_prefix(*voice, 150, n_timesteps=20)
    mu = torch.zeros(1, 80, 100)
    streaming = torch.ones(1, dtype=torch.bool)
    assert graphs(mu, torch.ones(1, 1, 100), torch.zeros(1, 80), mu, streaming, [twenty_steps]) is None


def test_chunks_after_a_prefix_equal_chunks_solved_whole_with_fused_kernels(flow: CausalFlow) -> None:
    fused = copy.deepcopy(flow)
    fused.decoder.estimator.fuse_kernels()
    voice = prompt(3)
    prefix = fused.record_prefix(*voice, fused.prefix_frames(PROMPT_TOKENS))
    items = [chunk(voice, 20, 1), chunk(voice, 57, 2)]
    for item, after in zip(items, fused.inference_batch(items, prefixes=[prefix] * 2), strict=True):
        torch.testing.assert_close(after, flow.inference_batch([item])[0], rtol=1e-5, atol=1e-5)
