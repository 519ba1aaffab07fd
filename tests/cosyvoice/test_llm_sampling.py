"""The batched sampler: per-row parameters, counter-based randomness, the right distribution."""

from __future__ import annotations

import pytest
import torch

from tts_gateway.models.cosyvoice2.engines.llm_sampling import (
    SamplingRows,
    hash32,
    sample,
    seed_keys,
    uniforms,
    unit_interval,
)

pytestmark = pytest.mark.cosyvoice

COLUMNS = 8


def rows(count: int, **values: object) -> SamplingRows:
    def vector(name: str, default: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((count,), values.get(name, default), dtype=dtype)  # type: ignore[arg-type]

    def matrix(name: str, default: bool) -> torch.Tensor:
        given = values.get(name)
        return given if isinstance(given, torch.Tensor) else torch.full((count, COLUMNS), default)

    return SamplingRows(
        temperature=vector("temperature", 1.0, torch.float32),
        top_k=vector("top_k", 0, torch.int64),
        top_p=vector("top_p", 1.0, torch.float32),
        penalty=vector("penalty", 1.0, torch.float32),
        keys=seed_keys(torch.arange(count, dtype=torch.int64) + int(values.get("seed", 0))),  # type: ignore[call-overload]
        steps=vector("steps", 0, torch.int64),
        min_new=vector("min_new", 0, torch.int64),
        allowed=matrix("allowed", True),
        stops=matrix("stops", False),
        seen=matrix("seen", False),
    )


def test_hash_is_a_deterministic_32_bit_mix_even_where_int64_products_overflow() -> None:
    values = torch.tensor([0, 1, 2, 0xFFFFFFFF, 0x7FEB352D], dtype=torch.int64)
    hashed = hash32(values)
    assert torch.equal(hashed, hash32(values.clone()))
    assert bool(((hashed >= 0) & (hashed < 2**32)).all())
    assert len(set(hashed.tolist())) == len(values)
    # Negative seeds (uint64 seeds above 2**63 arrive as negative int64) fold like any other.
    assert 0 <= int(seed_keys(torch.tensor([-1]))[0]) < 2**32


def test_uniforms_lie_in_the_open_interval_and_depend_on_key_step_and_column() -> None:
    keys = seed_keys(torch.tensor([1, 2]))
    a = uniforms(keys, torch.tensor([0, 0]), 1000)
    assert bool(((a > 0) & (a < 1)).all())
    assert abs(float(a.mean()) - 0.5) < 0.05
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(a, uniforms(keys, torch.tensor([1, 1]), 1000))
    assert torch.equal(a, uniforms(keys, torch.tensor([0, 0]), 1000))


def test_draws_follow_the_softmax() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2, 1e-9, 1e-9, 1e-9, 1e-9, 1e-9])).repeat(4000, 1)
    drawn = sample(logits, rows(4000))
    frequencies = torch.bincount(drawn, minlength=COLUMNS).float() / 4000
    assert torch.allclose(frequencies[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_each_row_uses_its_own_parameters() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, 0.1, 0.0, -1.0, -2.0]]).repeat(3, 1)
    greedy_rows = rows(3, temperature=0.0)
    assert sample(logits, greedy_rows).tolist() == [1, 1, 1]
    top1 = rows(3)
    top1.top_k = torch.tensor([1, 1, 1])
    assert sample(logits, top1).tolist() == [1, 1, 1]
    tiny_p = rows(3)
    tiny_p.top_p = torch.tensor([1e-6, 1e-6, 1e-6])
    assert sample(logits, tiny_p).tolist() == [1, 1, 1]


def test_stops_open_only_after_min_new_and_disallowed_columns_never_come() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 50.0]]).repeat(2, 1)
    stops = torch.zeros(2, COLUMNS, dtype=torch.bool)
    stops[:, 7] = True
    early = rows(2, temperature=0.0, stops=stops, min_new=3)
    early.steps = torch.tensor([2, 3])
    assert sample(logits, early).tolist()[1] == 7
    assert sample(logits, early).tolist()[0] != 7
    allowed = torch.ones(2, COLUMNS, dtype=torch.bool)
    allowed[:, 7] = False
    assert 7 not in sample(logits, rows(2, allowed=allowed)).tolist()


def test_repetition_penalty_applies_to_seen_columns_only() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    seen = torch.zeros(1, COLUMNS, dtype=torch.bool)
    seen[0, 0] = True
    assert sample(logits, rows(1, temperature=0.0, penalty=1.5, seen=seen)).tolist() == [1]
    assert sample(logits, rows(1, temperature=0.0, penalty=1.5)).tolist() == [0]


def test_unit_interval_never_reaches_zero_or_one() -> None:
    extremes = unit_interval(torch.tensor([0, 1, 2**32 - 129, 2**32 - 1], dtype=torch.int64))
    assert bool((extremes > 0).all() and (extremes < 1).all())
    assert bool(torch.isfinite(-torch.log(-torch.log(extremes))).all())


def test_a_dropped_column_never_wins_whatever_its_noise() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]).repeat(2000, 1)
    top2 = rows(2000, seed=7)
    top2.top_k = torch.full((2000,), 2)
    assert set(sample(logits, top2).tolist()) <= {0, 1}
