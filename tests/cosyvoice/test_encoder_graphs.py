"""EncoderGraphs: token rows padded into (rows, tokens) buckets and encoded over static buffers give the mu,
and so the mel, that the eager encoder gives.

On the CPU each bucket's recorded encode runs eagerly over the same static buffers that CUDA graphs replay,
so what is checked here is the bookkeeping: padding, buffers that still hold an earlier batch, results that
are copies; that the recorded graphs replay what they recorded is the GPU check's
(``python -m benchmarks.gpu_flow_compile --encoder-graphs``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.cosyvoice.test_flow_graphs import item
from tests.cosyvoice.test_token2wav_batching import two_streams_in_step, voice
from tts_gateway.models.cosyvoice2.checkpoints.config_writer import tiny_config
from tts_gateway.models.cosyvoice2.engines.encoder_graphs import EncoderGraphs
from tts_gateway.models.cosyvoice2.engines.token2wav import Token2Wav
from tts_gateway.models.cosyvoice2.model.flow import CausalFlow, FlowItem

pytestmark = pytest.mark.cosyvoice


@pytest.fixture(scope="module")
def flow() -> CausalFlow:
    torch.manual_seed(0)
    return CausalFlow(tiny_config().flow).eval()


class CountingGraphs(EncoderGraphs):
    """Counts the batches the buckets encoded (the others are left to the eager encoder)."""

    encoded = 0

    def __call__(
        self, tokens: torch.Tensor, lengths: torch.Tensor, has_context: torch.Tensor, streaming: torch.Tensor
    ) -> torch.Tensor | None:
        mu = super().__call__(tokens, lengths, has_context, streaming)
        self.encoded += mu is not None
        return mu


def test_buckets_are_the_flow_graphs_rows_by_steps_of_tokens(flow: CausalFlow) -> None:
    graphs = EncoderGraphs(flow, max_rows=12, max_tokens=96, token_step=32)
    assert graphs.buckets == [(rows, tokens) for rows in (1, 2, 4, 8, 12) for tokens in (32, 64, 96)]


def test_bad_settings_are_refused(flow: CausalFlow) -> None:
    for settings in ({"max_rows": 0}, {"token_step": 0}, {"max_tokens": 16}):
        with pytest.raises(ValueError, match="encoder graphs need"):
            EncoderGraphs(flow, **{"max_rows": 4, "max_tokens": 64, "token_step": 32, **settings})


def _solved(flow: CausalFlow, batch: list[FlowItem], encoder: EncoderGraphs | None) -> list[torch.Tensor]:
    return flow.inference_batch(batch, n_timesteps=2, encoder=encoder)


def test_batches_padded_into_buckets_give_the_eager_encoders_mel(flow: CausalFlow) -> None:
    graphs = CountingGraphs(flow, max_rows=12, max_tokens=128, token_step=32)
    # 9 rows of every kind (streaming chunks with look-ahead, final and offline ones) and of different lengths
    # pad into the 12-row bucket; then fewer, shorter rows run over buffers that still hold the larger batch.
    batches = [
        [item(seed, 10 + 7 * seed, streaming=seed % 2 == 0) for seed in range(9)],
        [item(20, 12, streaming=True), item(21, 30, streaming=False)],
        [item(22, 5, streaming=True)],
    ]
    for batch in batches:
        for expected, encoded in zip(_solved(flow, batch, None), _solved(flow, batch, graphs), strict=True):
            assert encoded.shape == expected.shape
            torch.testing.assert_close(encoded, expected, rtol=1e-5, atol=1e-5)
    assert graphs.encoded == len(batches)


def test_a_batch_longer_than_every_bucket_is_encoded_eagerly(flow: CausalFlow) -> None:
    graphs = CountingGraphs(flow, max_rows=2, max_tokens=64, token_step=32)
    too_long = [item(9, 40, streaming=False), item(10, 10, streaming=True)]  # 40 prompt tokens + 40: past 64
    for expected, encoded in zip(_solved(flow, too_long, None), _solved(flow, too_long, graphs), strict=True):
        torch.testing.assert_close(encoded, expected, rtol=1e-5, atol=1e-5)
    assert graphs.encoded == 0


def test_more_rows_than_the_largest_bucket_are_encoded_in_slices_of_its_rows(flow: CausalFlow) -> None:
    graphs = CountingGraphs(flow, max_rows=2, max_tokens=64, token_step=32)
    # Five rows of different lengths and kinds: slices of 2, 2 and 1 rows, each padded to the batch's width.
    batch = [item(seed, 4 + 5 * seed, streaming=seed != 3) for seed in range(5)]
    for expected, encoded in zip(_solved(flow, batch, None), _solved(flow, batch, graphs), strict=True):
        assert encoded.shape == expected.shape
        torch.testing.assert_close(encoded, expected, rtol=1e-5, atol=1e-5)
    assert graphs.encoded == 1


def test_the_result_is_a_copy_that_a_later_batch_leaves_alone(flow: CausalFlow) -> None:
    graphs = EncoderGraphs(flow, max_rows=2, max_tokens=64, token_step=32)
    generator = torch.Generator().manual_seed(0)
    first, second = (torch.randint(0, 6561, (1, 33), generator=generator) for _ in range(2))
    lengths, yes = torch.tensor([30]), torch.tensor([True])
    mu = graphs(first, lengths, yes, yes)
    assert mu is not None
    kept = mu.clone()
    graphs(second, lengths, yes, yes)
    torch.testing.assert_close(mu, kept, rtol=0, atol=0)
    torch.testing.assert_close(mu, flow.encode(first, lengths, yes, yes), rtol=1e-5, atol=1e-5)


def test_streams_through_token2wav_with_the_graphs_sound_as_without(token2wav_dir: Path) -> None:
    """Two streams in step (first hop 15, then 25, then the final chunk), and an offline call: the same audio."""
    eager = Token2Wav.from_model_dir(token2wav_dir, device="cpu", dtype=torch.float32, n_timesteps=2)
    graphs = CountingGraphs(eager.flow, max_rows=4, max_tokens=128, token_step=32)
    graphed = Token2Wav(eager.flow, eager.hift, n_timesteps=2, encoder_graphs=graphs)
    prompt = voice(0, 12)
    tokens = np.random.default_rng(0).integers(0, 6561, 60)
    audio: dict[str, list[np.ndarray]] = {}
    for name, t2w in (("eager", eager), ("graphs", graphed)):
        chunks = two_streams_in_step(t2w, name, prompt, tokens)
        chunks.append(t2w.offline(tokens[:30], prompt))
        audio[name] = chunks
    assert graphs.encoded == 4  # each chunk's batch and the offline call
    for expected, actual in zip(audio["eager"], audio["graphs"], strict=True):
        assert actual.shape == expected.shape
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
