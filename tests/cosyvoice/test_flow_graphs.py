"""FlowSolverGraphs: batches padded into row and frame buckets, solved a segment of steps at a time, equal
the eager solve.

On the CPU each bucket's recorded segment runs eagerly over the same static buffers that CUDA graphs replay,
so what is checked here is the bookkeeping: padding, the segments' times, the state carried between segments.
"""

from __future__ import annotations

import pytest
import torch

from tts_gateway.models.cosyvoice2.checkpoints.config_writer import tiny_config
from tts_gateway.models.cosyvoice2.engines.flow_graphs import FlowSolverGraphs, row_buckets, segment_steps
from tts_gateway.models.cosyvoice2.model.flow import CausalFlow, FlowItem

pytestmark = pytest.mark.cosyvoice


@pytest.fixture(scope="module")
def flow() -> CausalFlow:
    torch.manual_seed(0)
    return CausalFlow(tiny_config().flow).eval()


def item(seed: int, tokens: int, *, streaming: bool) -> FlowItem:
    generator = torch.Generator().manual_seed(seed)
    return FlowItem(
        torch.randint(0, 6561, (tokens,), generator=generator),
        torch.randint(0, 6561, (40,), generator=generator),
        torch.randn(80, 80, generator=generator),
        torch.randn(192, generator=generator),
        streaming=streaming,
        finalize=not streaming,
    )


def cpu_graphs(flow: CausalFlow, *, max_rows: int, other_timesteps: list[int] | None = None) -> FlowSolverGraphs:
    """Buckets up to ``max_rows`` rows and 256 frames in steps of 64, replayed eagerly on the CPU."""
    return FlowSolverGraphs(
        flow.decoder,
        n_timesteps=10,
        mel_bins=80,
        max_rows=max_rows,
        max_frames=256,
        frame_step=64,
        device=torch.device("cpu"),
        dtype=torch.float32,
        other_timesteps=other_timesteps or [],
    )


def test_row_buckets_are_powers_of_two_with_the_sizes_between_from_eight_rows() -> None:
    assert row_buckets(32) == [1, 2, 4, 8, 12, 16, 24, 32]
    assert row_buckets(64) == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
    assert row_buckets(20) == [1, 2, 4, 8, 12, 16, 20]
    assert row_buckets(6) == [1, 2, 4, 6]
    assert row_buckets(1) == [1]


def test_a_solve_is_recorded_in_segments_of_equal_steps() -> None:
    assert [segment_steps(n) for n in (10, 4, 7, 2, 1)] == [5, 2, 1, 1, 1]


def test_a_batch_padded_into_a_bucket_and_solved_in_segments_equals_the_eager_solve(flow: CausalFlow) -> None:
    graphs = cpu_graphs(flow, max_rows=12)
    assert graphs.buckets == [(r, f, False) for r in (1, 2, 4, 8, 12) for f in (64, 128, 192, 256)]
    # 9 rows of mixed lengths and kinds pad into the 12-row bucket; then fewer, shorter rows reuse the
    # buffers that still hold the larger batch's values (masked, and the state restarts from noise).
    batches = [
        [item(seed, 10 + 7 * seed, streaming=seed % 2 == 0) for seed in range(9)],
        [item(20, 12, streaming=True), item(21, 30, streaming=False)],
    ]
    solved_by_graphs = []

    def solver(*args, **kwargs):  # type: ignore[no-untyped-def]
        mel = graphs(*args, **kwargs)
        solved_by_graphs.append(mel is not None)
        return mel

    for batch in batches:
        want = flow.inference_batch(batch)
        got = flow.inference_batch(batch, solver=solver)
        for expected, solved in zip(want, got, strict=True):
            torch.testing.assert_close(solved, expected, rtol=1e-5, atol=1e-5)
    assert solved_by_graphs == [True, True]
    mu = torch.zeros(13, 80, 100)
    assert graphs(mu, torch.ones(13, 1, 100), torch.zeros(13, 80), mu, torch.ones(13, dtype=torch.bool)) is None


def test_a_batch_solved_between_the_segments_of_another_leaves_both_as_if_solved_alone(flow: CausalFlow) -> None:
    graphs = cpu_graphs(flow, max_rows=4)
    later = [item(30 + seed, 40 + 10 * seed, streaming=True) for seed in range(3)]
    first = [item(40, 18, streaming=True)]
    between: list[list[torch.Tensor]] = []

    def first_chunks_meanwhile() -> None:
        # Another batch in smaller buckets, through the same static buffers; it asks for no nesting.
        between.append(flow.inference_batch(first, solver=graphs))

    got = flow.inference_batch(later, solver=graphs, between_segments=first_chunks_meanwhile)
    assert len(between) == 1  # two segments of 5 steps: called once, between them
    for expected, solved in zip(flow.inference_batch(later), got, strict=True):
        torch.testing.assert_close(solved, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(between[0][0], flow.inference_batch(first)[0], rtol=1e-5, atol=1e-5)


def test_a_solve_lends_only_once_its_first_segment_has_run(flow: CausalFlow) -> None:
    graphs = cpu_graphs(flow, max_rows=4)
    order: list[str] = []
    # On the CPU the wait is a no-op; on CUDA it synchronises the stream the replays went to.
    graphs._finished = lambda: order.append("first segment done")  # type: ignore[method-assign]
    flow.inference_batch([item(50, 20, streaming=True)], solver=graphs, between_segments=lambda: order.append("lent"))
    assert order == ["first segment done", "lent"]


def test_solves_that_fit_no_graph_are_reported_as_eager(flow: CausalFlow) -> None:
    graphs = cpu_graphs(flow, max_rows=4)
    eager: list[tuple[int, int]] = []
    flow.inference_batch([item(60, 20, streaming=True)], solver=graphs, eager_solves=eager)
    assert eager == []
    # 40 prompt + 120 target tokens, 2 mel frames a token: 320 frames, past the largest bucket (256).
    long_and_short = [item(61, 120, streaming=False), item(62, 30, streaming=False)]
    flow.inference_batch(long_and_short, solver=graphs, eager_solves=eager)
    assert eager == [(2, 320)]
    flow.inference_batch([item(63, 20, streaming=True)], eager_solves=eager)  # no solver: eager
    # A streaming chunk's last 3 tokens are look-ahead only: (40 + 20 - 3) tokens of 2 frames.
    assert eager == [(2, 320), (1, 114)]


def test_a_solve_of_fewer_steps_replays_the_same_segments_with_its_own_times(flow: CausalFlow) -> None:
    graphs = cpu_graphs(flow, max_rows=4, other_timesteps=[5])
    batch = [item(70 + seed, 18 + 5 * seed, streaming=True) for seed in range(3)]
    five = flow.inference_batch(batch, n_timesteps=5)
    ten = flow.inference_batch(batch)
    replayed: list[bool] = []

    def solver(*args, **kwargs):  # type: ignore[no-untyped-def]
        mel = graphs(*args, **kwargs)
        replayed.append(mel is not None)
        return mel

    for expected, solved, full in zip(
        five, flow.inference_batch(batch, n_timesteps=5, solver=solver), ten, strict=True
    ):
        torch.testing.assert_close(solved, expected, rtol=1e-5, atol=1e-5)
        assert (solved - full).abs().max() > 1e-3  # five steps are not ten
    # Counts the graphs were not made for run eagerly, and come out as such.
    for expected, solved in zip(
        flow.inference_batch(batch, n_timesteps=4),
        flow.inference_batch(batch, n_timesteps=4, solver=solver),
        strict=True,
    ):
        torch.testing.assert_close(solved, expected, rtol=1e-5, atol=1e-5)
    assert replayed == [True, False]


def test_step_counts_that_are_not_whole_segments_are_refused(flow: CausalFlow) -> None:
    with pytest.raises(ValueError, match="a solve of 4 steps is no whole number of the graphs' segments of 5"):
        cpu_graphs(flow, max_rows=1, other_timesteps=[4])
