"""Batched sampling of speech tokens on the device, one row per request, without host round trips.

Every row carries its own parameters as tensors (temperature, top-k, top-p, repetition penalty,
seed, step), so one call samples a whole decoding batch and the call can be recorded into a CUDA
graph. The order of the filters follows the single-request sampler this replaces: repetition
penalty, temperature, top-k, then top-p; a row with temperature 0 takes the argmax.

Randomness is counter-based: the uniform number of row ``r``, column ``c`` at step ``s`` is a
hash of (seed, s, c). A request therefore draws the same tokens whatever else shares its batch,
and no per-request ``torch.Generator`` (which cannot be batched) is needed. Sampling is the
Gumbel-max trick: ``argmax(scores + Gumbel noise)`` draws from ``softmax(scores)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
# Odd 32-bit multipliers of a well-mixing integer hash (lowbias32's constants).
_MIX1 = 0x7FEB352D
_MIX2 = 0x846CA68B
_STEP_SALT = 0x9E3779B9


def hash32(x: Tensor) -> Tensor:
    """A 32-bit integer hash of int64 values in [0, 2**32), computed in int64.

    Products may exceed int64's range; they wrap modulo 2**64, whose low 32 bits (all we keep)
    are the true product's, on CPU and CUDA alike.
    """
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * _MIX1) & _MASK32
    x = ((x ^ (x >> 15)) * _MIX2) & _MASK32
    return x ^ (x >> 16)


def seed_keys(seeds: Tensor) -> Tensor:
    """Fold unsigned 64-bit seeds (given as int64, any bit pattern) into 32-bit stream keys."""
    low = seeds & _MASK32
    high = (seeds >> 32) & _MASK32
    return hash32(hash32(low) ^ high)


def uniforms(keys: Tensor, steps: Tensor, columns: int) -> Tensor:
    """``[rows, columns]`` float32 in (0, 1): one independent draw per row, step and column."""
    row = hash32(keys ^ hash32(steps * _STEP_SALT))
    index = torch.arange(columns, device=keys.device, dtype=torch.int64)
    return unit_interval(hash32(row.unsqueeze(1) ^ hash32(index + 1).unsqueeze(0)))


def unit_interval(bits: Tensor) -> Tensor:
    """32-bit values as float32 in (0, 1): the top 23 bits, centred in their steps.

    Every result lies in [2**-24, 1 - 2**-24], exactly as float32 holds it; all 32 bits would round
    the top 128 values up to 1.0, whose Gumbel noise is infinite.
    """
    return (bits >> 9).to(torch.float32) * (1.0 / 8388608.0) + (1.0 / 16777216.0)


@dataclass
class SamplingRows:
    """Per-row sampling state, each tensor with one entry (or row) per request.

    ``allowed`` marks the columns a row may draw at all (speech tokens and its own stop ids);
    ``stops`` marks stop columns, which only open once ``steps >= min_new``; ``seen`` marks the
    columns the repetition penalty applies to (the prompt's ids, then every id drawn).
    """

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    penalty: Tensor
    keys: Tensor
    steps: Tensor
    min_new: Tensor
    allowed: Tensor
    stops: Tensor
    seen: Tensor


def sample(logits: Tensor, rows: SamplingRows) -> Tensor:
    """Draw one column per row of ``logits`` ``[rows, columns]``; returns int64 ``[rows]``.

    Pure tensor code with no host synchronisation, so it can run inside a CUDA graph.
    """
    scores = logits.float()
    penalty = rows.penalty.unsqueeze(1)
    penalised = torch.where(scores > 0, scores / penalty, scores * penalty)
    scores = torch.where(rows.seen, penalised, scores)
    open_stops = (rows.steps >= rows.min_new).unsqueeze(1)
    usable = rows.allowed & (~rows.stops | open_stops)
    scores = scores.masked_fill(~usable, float("-inf"))
    greedy = torch.argmax(scores, dim=1)

    hot = rows.temperature > 0
    scaled = scores / torch.where(hot, rows.temperature, torch.ones_like(rows.temperature)).unsqueeze(1)
    ordered, order = torch.sort(scaled, dim=1, descending=True)
    rank = torch.arange(scaled.shape[1], device=scaled.device).unsqueeze(0)
    top_k = torch.where(rows.top_k > 0, rows.top_k, torch.full_like(rows.top_k, scaled.shape[1]))
    drop = rank >= top_k.unsqueeze(1)
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=1)
    # Drop a column once the columns ranked above it already hold top_p of the mass.
    drop |= (torch.cumsum(probs, dim=1) - probs) >= rows.top_p.unsqueeze(1)
    drop[:, 0] = False
    noise = -torch.log(-torch.log(uniforms(rows.keys, rows.steps, scaled.shape[1])))
    # Masked after the noise is added: a dropped column stays -inf whatever its noise.
    perturbed = (ordered + torch.gather(noise, 1, order)).masked_fill(drop, float("-inf"))
    drawn = torch.gather(order, 1, torch.argmax(perturbed, dim=1, keepdim=True))
    return torch.where(hot, drawn.squeeze(1), greedy)
