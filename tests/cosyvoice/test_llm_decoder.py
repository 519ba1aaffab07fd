"""The slot decoder's extend pass, as the engine records it: the cache and logits of a prefill of the whole input.

The engine pads an extend pass to a bucket of rows (the extra rows name the staging slot) and each row's
ids to a fixed width; neither may leave a trace in the rows' slots. Also: the projections the decoder
joins into one product compute what they did, on the model's own weights, held once.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import Qwen2ForCausalLM

from tts_gateway.models.cosyvoice2.checkpoints import tiny_frontend
from tts_gateway.models.cosyvoice2.engines.llm_decoder import SlotDecoder
from tts_gateway.models.cosyvoice2.engines.llm_engine import COLUMN_IDS
from tts_gateway.models.cosyvoice2.model.joined_linear import joined

pytestmark = [pytest.mark.cosyvoice, pytest.mark.usefixtures("one_torch_thread")]

SLOTS = 4
MAX_LEN = 64
WIDTH = 8
SPAN = 32


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> SlotDecoder:
    directory = tiny_frontend.write_tiny_llm(tmp_path_factory.mktemp("llm") / "cosyvoice2_llm")
    model = Qwen2ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    columns = torch.tensor(COLUMN_IDS)
    return SlotDecoder(model, slots=SLOTS, max_len=MAX_LEN, columns=columns, spans=(SPAN,))


def sequence(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 6000, (length,), generator=generator).tolist()


def prefill(decoder: SlotDecoder, ids: list[list[int]]) -> torch.Tensor:
    """Each row's ids into its slot, one prefill each (a padded batch writes keys past the shorter rows)."""
    logits = [
        decoder.prefill(torch.tensor([row_ids]), torch.tensor([len(row_ids)]), first_slot=row)
        for row, row_ids in enumerate(ids)
    ]
    return torch.cat(logits)


def test_an_extend_pass_leaves_what_a_prefill_of_the_whole_input_leaves(decoder: SlotDecoder) -> None:
    # Rows cached to different lengths, extended by inputs of different lengths (one as wide as the pass).
    cached = [sequence(1, 9), sequence(2, 17), sequence(3, 4)]
    added = [sequence(4, 5), sequence(5, WIDTH), sequence(6, 1)]
    whole = [c + a for c, a in zip(cached, added, strict=True)]
    expected = prefill(decoder, whole)
    expected_cache = [decoder.cache[:, :, row, :, : len(ids)].clone() for row, ids in enumerate(whole)]

    decoder.cache.zero_()
    prefill(decoder, cached)
    staging = decoder.staging_slot
    # Four rows: the three streams and a row that pads the pass to its bucket.
    ids = torch.zeros(4, WIDTH, dtype=torch.int64)
    for row, row_ids in enumerate(added):
        ids[row, : len(row_ids)] = torch.tensor(row_ids)
    starts = torch.tensor([len(c) for c in cached] + [0])
    lengths = torch.tensor([len(a) for a in added] + [1])
    slots = torch.tensor([0, 1, 2, staging])
    logits = decoder.extend(ids, starts, lengths, slots, SPAN)

    torch.testing.assert_close(logits[:3], expected, rtol=1e-4, atol=1e-4)
    for row, ids_of_row in enumerate(whole):
        torch.testing.assert_close(decoder.cache[:, :, row, :, : len(ids_of_row)], expected_cache[row])
        # Nothing written past a row's input: the padding columns went to the staging slot.
        assert not decoder.cache[:, :, row, :, len(ids_of_row) :].any()
    assert not decoder.cache[:, :, SLOTS - 1].any()


def test_padding_rows_change_no_row_they_pad(decoder: SlotDecoder) -> None:
    ids = torch.tensor([sequence(7, WIDTH)])
    decoder.cache.zero_()
    alone = decoder.extend(ids, torch.tensor([0]), torch.tensor([WIDTH]), torch.tensor([0]), SPAN)
    cached = decoder.cache[:, :, 0].clone()
    staging = decoder.staging_slot
    padded = decoder.extend(
        torch.cat([ids, torch.zeros(3, WIDTH, dtype=torch.int64)]),
        torch.tensor([0, 0, 0, 0]),
        torch.tensor([WIDTH, 1, 1, 1]),
        torch.tensor([0, staging, staging, staging]),
        SPAN,
    )
    torch.testing.assert_close(padded[:1], alone)
    torch.testing.assert_close(decoder.cache[:, :, 0], cached)


@pytest.mark.parametrize("bias", [True, False])
def test_joined_projections_compute_what_they_did_on_the_same_weights(bias: bool) -> None:
    torch.manual_seed(0)
    query, key, value = nn.Linear(8, 6, bias=bias), nn.Linear(8, 2, bias=bias), nn.Linear(8, 2, bias=bias)
    inputs = torch.randn(3, 5, 8)
    separate = torch.cat([query(inputs), key(inputs), value(inputs)], dim=-1)

    layer = joined(query, key, value)

    torch.testing.assert_close(layer(inputs), separate)
    torch.testing.assert_close(torch.cat([query(inputs), key(inputs), value(inputs)], dim=-1), separate)
    # The model's layers are views of the joined weights: nothing is held twice.
    storage = layer.weight.untyped_storage().data_ptr()
    assert {linear.weight.untyped_storage().data_ptr() for linear in (query, key, value)} == {storage}
    assert value.weight.data_ptr() == layer.weight[8:].data_ptr()
    if bias:
        assert layer.bias is not None and value.bias is not None
        assert value.bias.data_ptr() == layer.bias[8:].data_ptr()
    else:
        assert layer.bias is None


def test_the_decoder_holds_each_weight_of_the_model_once(tmp_path: Path) -> None:
    directory = tiny_frontend.write_tiny_llm(tmp_path / "cosyvoice2_llm")
    model = Qwen2ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    held = sum(p.numel() for p in model.parameters())

    decoder = SlotDecoder(model, slots=1, max_len=16, columns=torch.tensor(COLUMN_IDS), spans=(16,))

    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    for region in (*decoder._inputs, *decoder._outputs):
        storages.update({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in region.parameters()})
    assert sum(storages.values()) == held * 4


def test_joining_refuses_layers_of_which_only_some_have_a_bias() -> None:
    with pytest.raises(ValueError, match="all have a bias or all have none"):
        joined(nn.Linear(8, 4), nn.Linear(8, 4, bias=False))


def test_grouped_heads_keep_their_own_keys_and_values() -> None:
    """Two key/value heads for four query heads, with drawn q/k/v biases (the tiny checkpoint has one key/value
    head, where a key and value swapped between heads could not show): prefill, extend and decode give the
    model's own logits."""
    torch.manual_seed(0)
    config = tiny_frontend.qwen2_config(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_()
    reference = copy.deepcopy(model)
    columns = torch.tensor(COLUMN_IDS)
    decoder = SlotDecoder(model, slots=3, max_len=MAX_LEN, columns=columns, spans=(SPAN,))

    def expected(rows: list[list[int]]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.stack([reference(input_ids=torch.tensor([ids])).logits[0, -1, columns] for ids in rows])

    texts = [sequence(10 + row, 16) for row in range(3)]
    torch.testing.assert_close(prefill(decoder, [text[:5] for text in texts]), expected([t[:5] for t in texts]))
    # The rows then stand at different positions: extended by 1, 3 and 6 ids, then one token each.
    added = [1, 3, 6]
    ids = torch.zeros(3, WIDTH, dtype=torch.int64)
    for row, count in enumerate(added):
        ids[row, :count] = torch.tensor(texts[row][5 : 5 + count])
    extended = decoder.extend(ids, torch.full((3,), 5), torch.tensor(added), torch.arange(3), SPAN)
    torch.testing.assert_close(extended, expected([t[: 5 + n] for t, n in zip(texts, added, strict=True)]))
    tokens = torch.tensor([t[5 + n] for t, n in zip(texts, added, strict=True)])
    decoded = decoder.decode(tokens, torch.tensor([5 + n for n in added]), SPAN)
    torch.testing.assert_close(decoded, expected([t[: 6 + n] for t, n in zip(texts, added, strict=True)]))


def test_passes_shaped_by_their_input_keep_off_cudnn_attention(
    decoder: SlotDecoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuDNN's attention keeps a graph per new shape: a prefill's length and an extend pass's rows and width
    vary with the requests, so on a GPU it would grow the host memory with every new one."""
    attention = torch.nn.functional.scaled_dot_product_attention
    cudnn_allowed: list[bool] = []

    def watched(*args: object, **kwargs: object) -> torch.Tensor:
        cudnn_allowed.append(torch.backends.cuda.cudnn_sdp_enabled())
        return attention(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", watched)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    prefill(decoder, [sequence(7, 11)])
    staging = decoder.staging_slot
    ids = torch.tensor([sequence(8, WIDTH)])
    decoder.extend(ids, torch.tensor([11]), torch.tensor([WIDTH]), torch.tensor([0]), SPAN)
    decoder.extend(ids, torch.tensor([0]), torch.tensor([1]), torch.tensor([staging]), SPAN)
    assert cudnn_allowed and not any(cudnn_allowed)
    assert torch.backends.cuda.cudnn_sdp_enabled()
