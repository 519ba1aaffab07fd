"""Linear layers that read the same input computed as one matrix product (one kernel instead of several).

The LLM's decoder joins its query/key/value and gate/up projections, the flow estimator its attentions'
query/key/value projections.
"""

from __future__ import annotations

import torch
from torch import nn


def joined(*linears: nn.Linear) -> nn.Linear:
    """One linear layer computing what ``linears``, which read the same input, compute, their outputs side by side.

    The given layers' weights (and biases) become views of the joined ones, so the model still holds
    each weight once and its own modules compute what they did. The joined layer is not one of the
    model's modules: the model is on its device and in its dtype before it is joined, not moved after.
    """
    biases = [linear.bias for linear in linears]
    if len({b is None for b in biases}) > 1:
        raise ValueError("joined linear layers must all have a bias or all have none")
    weight = torch.cat([linear.weight.detach() for linear in linears])
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    start = 0
    for linear in linears:
        end = start + linear.out_features
        linear.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return layer
