"""The flow's token encoder: a conformer stack at the token rate, a x2 upsample, a second stack at the mel rate.

Mirrors upstream's ``UpsampleConformerEncoder`` as configured by CosyVoice2 (linear input layer,
ESPnet-style relative positional self-attention, pre-norm, no convolution module, no macaron
feed-forward) so that ``flow.pt``'s ``encoder.*`` parameters load unchanged. Upstream hard-codes three
things that this code derives instead: the look-ahead and upsample layers' width (512, which is the
encoder width in the official model), the look-ahead length (3, the flow's ``pre_lookahead_len``) and
the upsample stride (2, the ``token_mel_ratio``). The number of blocks after the upsample is fixed at
four upstream and is not in ``cosyvoice2.yaml``; it is :data:`UP_BLOCKS` here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tts_gateway.models.cosyvoice2.model.config import EncoderConfig

UP_BLOCKS = 4


def chunk_mask(length: int, chunk_size: int, device: torch.device) -> Tensor:
    """``[length, length]`` bool: position i may attend to every position of its own and earlier chunks."""
    position = torch.arange(length, device=device)
    visible_end = (torch.div(position, chunk_size, rounding_mode="trunc") + 1) * chunk_size
    return position.unsqueeze(0) < visible_end.unsqueeze(1)


def relative_positions(length: int, d_model: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Sinusoidal encodings of the relative offsets ``length-1, ..., 0, ..., -(length-1)``: ``[1, 2L-1, d]``."""
    offsets = torch.arange(length - 1, -length, -1, dtype=torch.float32, device=device).unsqueeze(1)
    frequencies = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / d_model)
    )
    encodings = torch.zeros(2 * length - 1, d_model, device=device)
    encodings[:, 0::2] = torch.sin(offsets * frequencies)
    encodings[:, 1::2] = torch.cos(offsets * frequencies)
    return encodings.unsqueeze(0).to(dtype)


class LinearInput(nn.Module):
    """Linear projection + LayerNorm, scaled by sqrt(d) as the relative-position scheme expects."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(input_size, output_size), nn.LayerNorm(output_size, eps=1e-5))
        self.scale = math.sqrt(output_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.scale


class RelativePositionSelfAttention(nn.Module):
    """Multi-head self-attention with Transformer-XL relative position terms (content bias u, position bias v)."""

    def __init__(self, heads: int, size: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = size // heads
        self.linear_q = nn.Linear(size, size)
        self.linear_k = nn.Linear(size, size)
        self.linear_v = nn.Linear(size, size)
        self.linear_out = nn.Linear(size, size)
        self.linear_pos = nn.Linear(size, size, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.head_dim))

    def _split_heads(self, x: Tensor) -> Tensor:
        return x.view(x.size(0), -1, self.heads, self.head_dim)

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor | None) -> Tensor:
        """x ``[B, T, size]``, positions ``[1, 2T-1, size]``, mask ``[B or 1, T, T]`` bool or None (all visible)."""
        batch, length, _ = x.shape
        query = self._split_heads(self.linear_q(x))
        key = self._split_heads(self.linear_k(x)).transpose(1, 2)
        value = self._split_heads(self.linear_v(x)).transpose(1, 2)
        position = self._split_heads(self.linear_pos(positions)).transpose(1, 2)

        content = torch.matmul((query + self.pos_bias_u).transpose(1, 2), key.transpose(-2, -1))
        by_offset = torch.matmul((query + self.pos_bias_v).transpose(1, 2), position.transpose(-2, -1))
        # by_offset[..., i, r] scores offset index r (offset length-1-r); key j sits at r = length-1-i+j.
        steps = torch.arange(length, device=x.device)
        offset_index = (length - 1 - steps.unsqueeze(1) + steps.unsqueeze(0)).expand(batch, self.heads, -1, -1)
        scores = (content + torch.gather(by_offset, -1, offset_index)) / math.sqrt(self.head_dim)

        if mask is None:
            weights = torch.softmax(scores, dim=-1)
        else:
            hidden = ~mask.unsqueeze(1)
            weights = torch.softmax(scores.masked_fill(hidden, -float("inf")), dim=-1).masked_fill(hidden, 0.0)
        context = torch.matmul(weights, value).transpose(1, 2).reshape(batch, length, -1)
        return self.linear_out(context)


class FeedForward(nn.Module):
    def __init__(self, size: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(size, hidden)
        self.w_2 = nn.Linear(hidden, size)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerBlock(nn.Module):
    """Pre-norm self-attention then feed-forward, each with a residual (CosyVoice2 uses no conv module)."""

    def __init__(self, size: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.self_attn = RelativePositionSelfAttention(heads, size)
        self.feed_forward = FeedForward(size, hidden)
        self.norm_mha = nn.LayerNorm(size, eps=1e-12)
        self.norm_ff = nn.LayerNorm(size, eps=1e-12)

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.norm_mha(x), positions, mask)
        return x + self.feed_forward(self.norm_ff(x))


class PreLookaheadLayer(nn.Module):
    """Lets each token see the next ``lookahead`` tokens (conv1), then the two before it (causal conv2)."""

    def __init__(self, channels: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3)

    def forward(self, x: Tensor, padded: Tensor) -> Tensor:
        """x ``[B, T, C]``; ``padded`` ``[B, T + lookahead, C]``: x's rows, each followed by what its
        tokens may look ahead to (the next tokens, or zeros at the end of an utterance)."""
        y = F.leaky_relu(self.conv1(padded.transpose(1, 2)))
        y = self.conv2(F.pad(y, (self.conv2.kernel_size[0] - 1, 0)))
        return y.transpose(1, 2) + x


class Upsample(nn.Module):
    """Nearest-neighbour repeat by ``stride`` then a causal convolution of width ``2*stride+1``."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, kernel_size=2 * stride + 1)

    def forward(self, x: Tensor) -> Tensor:
        """x ``[B, C, T]`` -> ``[B, C, stride*T]``."""
        y = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        return self.conv(F.pad(y, (2 * self.stride, 0)))


class UpsampleConformerEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig, lookahead: int, stride: int) -> None:
        super().__init__()
        size = cfg.output_size
        self.size = size
        self.stride = stride
        self.chunk_size = cfg.static_chunk_size
        self.embed = LinearInput(cfg.input_size, size)
        self.pre_lookahead_layer = PreLookaheadLayer(size, lookahead)
        self.encoders = nn.ModuleList(
            ConformerBlock(size, cfg.attention_heads, cfg.linear_units) for _ in range(cfg.num_blocks)
        )
        self.up_layer = Upsample(size, stride)
        self.up_embed = LinearInput(size, size)
        self.up_encoders = nn.ModuleList(
            ConformerBlock(size, cfg.attention_heads, cfg.linear_units) for _ in range(UP_BLOCKS)
        )
        self.after_norm = nn.LayerNorm(size, eps=1e-5)

    def _stack(self, blocks: nn.ModuleList, x: Tensor, chunk: int, lengths: Tensor, streaming: Tensor) -> Tensor:
        length = x.size(1)
        positions = relative_positions(length, self.size, x.device, x.dtype)
        steps = torch.arange(length, device=x.device)
        # [B, T, T]: real keys only (rows are right-padded), and within the chunk mask where streaming.
        mask = (steps.unsqueeze(0) < lengths.unsqueeze(1)).unsqueeze(1).expand(-1, length, -1)
        if chunk > 0:
            mask = mask & (chunk_mask(length, chunk, x.device).unsqueeze(0) | ~streaming.view(-1, 1, 1))
        for block in blocks:
            x = block(x, positions, mask)
        return x

    def forward(self, x: Tensor, lengths: Tensor, has_context: Tensor, streaming: Tensor) -> Tensor:
        """Token embeddings ``[B, T + lookahead, input_size]`` -> ``[B, stride*T, size]``.

        Row ``i`` holds ``lengths[i]`` tokens followed, where ``has_context[i]``, by the
        ``lookahead`` tokens after them (look-ahead only, no output of their own), then padding.
        Rows without context see zeros ahead of their last tokens, as at the end of an utterance.
        Where ``streaming[i]``, attention is restricted to chunks of ``static_chunk_size`` tokens
        (and ``stride`` times as many frames after the upsample), as during streaming training.
        Padded rows compute exactly what they would alone: padding is masked out of attention,
        and every convolution that looks ahead sees zeros there.
        """
        chunk = self.chunk_size
        lookahead = self.pre_lookahead_layer.lookahead
        steps = torch.arange(x.size(1), device=x.device).unsqueeze(0)
        reach = lengths + has_context.long() * lookahead
        x = self.embed(x) * (steps < reach.unsqueeze(1)).unsqueeze(2).to(x.dtype)
        x = self.pre_lookahead_layer(x[:, :-lookahead], x)
        x = self._stack(self.encoders, x, chunk, lengths, streaming)
        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)
        x = self._stack(self.up_encoders, self.up_embed(x), chunk * self.stride, lengths * self.stride, streaming)
        return self.after_norm(x)
