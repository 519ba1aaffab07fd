"""The flow's mel decoder: conditional flow matching solved with Euler steps over a causal 1-D U-Net.

:class:`CausalConditionalDecoder` is the velocity estimator (upstream ``CausalConditionalDecoder`` with
Matcha-TTS/diffusers building blocks); :class:`CausalConditionalCFM` integrates it from fixed noise to
a mel spectrogram with classifier-free guidance. Module and parameter names follow upstream so that
``flow.pt``'s ``decoder.*`` entries load unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tts_gateway.models.cosyvoice2.model.config import DecoderConfig, EstimatorConfig
from tts_gateway.models.cosyvoice2.model.flow_encoder import chunk_mask
from tts_gateway.models.cosyvoice2.model.joined_linear import joined

NOISE_SEED = 0
NOISE_FRAMES = 50 * 300
"""Upstream draws one noise tensor of 300 s of mel frames with seed 0 and slices it for every call,
so recomputing a prefix gives the same mel: streaming chunks agree with each other."""

_MASK_BIAS = -1.0e10


class EstimatorTape(Protocol):
    """Left context for a solve over frames that follow a prefix solved before (see :mod:`.flow_prefix`).

    The estimator hands every causal convolution's input and every attention's keys and values
    to the tape, in a fixed order. A recording tape keeps the prefix's and returns them as they
    are; a replaying tape returns them with the prefix's in front, so frames after the prefix
    come out as if the prefix had been solved with them.
    """

    @property
    def visible(self) -> Tensor | None:
        """``[B, P]`` bool: which of each row's replayed prefix frames are real (None while recording)."""
        ...

    def level(self, count: int) -> EstimatorTape:
        """The tape a U-Net level takes its ``count`` tensors from (see :attr:`UNetLevel.tape_tensors`)."""
        ...

    def context(self, x: Tensor, width: int) -> Tensor:
        """``x`` ``[B, C, T]`` with ``width`` frames of left context in front."""
        ...

    def keys_values(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values ``[B, heads, T, d]``, with the prefix's in front when replaying."""
        ...


class CausalConv1d(nn.Conv1d):
    """A stride-1 convolution padded on the left only, so frame t never sees frames after t."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)
        self.left_pad = kernel_size - 1
        self.as_matmul = False

    def forward(self, x: Tensor, tape: EstimatorTape | None = None) -> Tensor:
        if not self.as_matmul:
            return super().forward(F.pad(x, (self.left_pad, 0)) if tape is None else tape.context(x, self.left_pad))
        frames = x.size(-1)
        if tape is None:
            rows = F.pad(x.transpose(1, 2), (0, 0, self.left_pad, 0))
        else:
            rows = tape.context(x, self.left_pad).transpose(1, 2)
        # [B, taps - 1 + T, taps x out]: every frame times every tap's weights in one product; a frame's
        # output is then the sum of its taps' products over the frames before it. As one product over each
        # frame's window of inputs instead, the kernel building the windows read each input, and computed
        # the activation that made it, once per tap: over 100 µs a call at 32 rows, a solve 6 % slower.
        out_channels = self.out_channels
        products = F.linear(rows, self.weight.permute(2, 0, 1).reshape(-1, self.in_channels))
        out = products[:, :frames, :out_channels]
        for tap in range(1, self.left_pad + 1):
            out = out + products[:, tap : tap + frames, tap * out_channels : (tap + 1) * out_channels]
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.transpose(1, 2)

    def to_matmul(self) -> None:
        """Compute as one matrix product over frames and taps (see :meth:`CausalConditionalDecoder.fuse_kernels`).

        The weight is stored tap by tap in memory (its shape unchanged), so the taps' matrices side by
        side are a view."""
        self.weight.data = self.weight.data.permute(2, 0, 1).contiguous().permute(1, 2, 0)
        self.as_matmul = True


class PointwiseConv1d(nn.Conv1d):
    """A 1x1 convolution, which :meth:`to_matmul` turns into the matrix product it is over frames."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(in_channels, out_channels, 1)
        self.as_matmul = False

    def forward(self, x: Tensor) -> Tensor:
        if not self.as_matmul:
            return super().forward(x)
        return F.linear(x.transpose(1, 2), self.weight[:, :, 0], self.bias).transpose(1, 2)

    def to_matmul(self) -> None:
        """Compute as the product over frames (see :meth:`CausalConditionalDecoder.fuse_kernels`)."""
        self.as_matmul = True


class _Transpose(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2)


class CausalBlock1D(nn.Module):
    """Causal conv -> LayerNorm over channels -> Mish, with the padding mask applied before and after."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3), _Transpose(), nn.LayerNorm(dim_out), _Transpose(), nn.Mish()
        )

    def forward(self, x: Tensor, mask: Tensor, tape: EstimatorTape | None = None) -> Tensor:
        conv, *rest = self.block
        h = cast(CausalConv1d, conv)(x * mask, tape)
        for layer in rest:
            h = layer(h)
        return h * mask


class CausalResnetBlock1D(nn.Module):
    """Two causal blocks with the time embedding added in between, plus a 1x1 residual projection."""

    def __init__(self, dim: int, dim_out: int, time_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = PointwiseConv1d(dim, dim_out)

    def forward(self, x: Tensor, mask: Tensor, time: Tensor, tape: EstimatorTape | None = None) -> Tensor:
        h = self.block1(x, mask, tape) + self.mlp(time).unsqueeze(-1)
        return self.block2(h, mask, tape) + self.res_conv(x * mask)


class Attention(nn.Module):
    """Multi-head self-attention with an additive mask bias (diffusers' ``Attention`` layout, no qkv bias)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads = heads
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        # The three projections' weights side by side (:meth:`join_projections`). A buffer, not a plain
        # attribute: a compiler takes a module's buffers' sizes as fixed, where a plain tensor's could be
        # tied to an input's that happened to be equal (1536 rows and frames), compiling again at every
        # other frame count. Not persistent: flow.pt holds the three weights.
        self.qkv_weight: Tensor | None
        self.register_buffer("qkv_weight", None, persistent=False)

    def forward(self, x: Tensor, bias: Tensor, tape: EstimatorTape | None = None) -> Tensor:
        """x ``[B, T, dim]``; bias ``[B or 1, T, keys]``, 0 where visible and very negative elsewhere
        (keys: T, plus the prefix's frames when a tape replays them)."""
        batch, length, _ = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(batch, length, self.heads, -1).transpose(1, 2)

        if self.qkv_weight is None:
            queries, keys, values = heads(self.to_q(x)), heads(self.to_k(x)), heads(self.to_v(x))
        else:
            queries, keys, values = (heads(t) for t in F.linear(x, self.qkv_weight).chunk(3, dim=-1))
        if tape is not None:
            keys, values = tape.keys_values(keys, values)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias.unsqueeze(1))
        return self.to_out[0](out.transpose(1, 2).reshape(batch, length, -1))

    def join_projections(self) -> None:
        """Project queries, keys and values in one matrix product: two kernels fewer a call.

        The three weights become views of the joined one, so it is held once and a ``load_state_dict``
        that copies into them reaches it. Join once the module's weights are loaded and placed: a later
        move (``.to()``) or an assigning load replaces the three and leaves the joined weight behind."""
        self.qkv_weight = joined(self.to_q, self.to_k, self.to_v).weight.detach()


class GELUProjection(nn.Module):
    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim_out)
        self.gelu_in_epilogue = False

    def forward(self, x: Tensor) -> Tensor:
        if not self.gelu_in_epilogue:
            return F.gelu(self.proj(x))
        # cuBLASLt applies bias and GELU as the product's epilogue (in its tanh form on CUDA; the
        # CPU computes the exact one), where a compiler leaves the product to cuBLAS and the GELU to a
        # kernel of its own.
        flat = torch._addmm_activation(self.proj.bias, x.reshape(-1, x.size(-1)), self.proj.weight.t(), use_gelu=True)
        return flat.view(*x.shape[:-1], -1)


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        # Index 1 is upstream's dropout; an Identity keeps ``net.2`` at the index flow.pt uses.
        self.net = nn.Sequential(GELUProjection(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class TransformerBlock(nn.Module):
    """Pre-norm self-attention and GELU feed-forward, each residual (Matcha's ``BasicTransformerBlock``)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: Tensor, bias: Tensor, tape: EstimatorTape | None = None) -> Tensor:
        x = x + self.attn1(self.norm1(x), bias, tape)
        return x + self.ff(self.norm3(x))


class Downsample1D(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class Upsample1D(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(dim, dim, 4, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class UNetLevel(nn.ModuleList):
    """One U-Net level stored as upstream's ``[resnet, transformer_blocks(, resample)]`` list."""

    def __init__(self, resnet: CausalResnetBlock1D, blocks: nn.ModuleList, resample: nn.Module | None) -> None:
        super().__init__([resnet, blocks] if resample is None else [resnet, blocks, resample])
        self.frames_major = False

    @property
    def tape_tensors(self) -> int:
        """Tensors :meth:`forward` hands a tape: its resnet's two causal convolutions', each block's keys and values."""
        return 2 + 2 * len(cast(nn.ModuleList, self[1]))

    def forward(self, x: Tensor, mask: Tensor, time: Tensor, bias: Tensor, tape: EstimatorTape | None = None) -> Tensor:
        """Resnet then transformers; :meth:`resample` is separate because the skip is taken in between.
        ``tape``: the level's own (:meth:`EstimatorTape.level`)."""
        x = self[0](x, mask, time, tape).transpose(1, 2)
        for block in cast(nn.ModuleList, self[1]):
            x = block(x, bias, tape)
        # Fused, a level hands its output on frames-major, the layout the next level's products read;
        # otherwise channels-major, as a convolution's. Either way the levels alike (CosyVoice2's mid levels)
        # take one layout, which one compiled graph serves (another layout would compile again).
        return x.transpose(1, 2) if self.frames_major else x.transpose(1, 2).contiguous()

    def resample(self, x: Tensor, tape: EstimatorTape | None = None) -> Tensor:
        resample = self[2]
        if isinstance(resample, CausalConv1d):
            return resample(x, tape)
        if tape is not None:
            raise ValueError("a prefix tape needs a U-Net without down- or upsampling (one level)")
        return cast(Tensor, resample(x))


def _share(tape: EstimatorTape | None, level: UNetLevel) -> EstimatorTape | None:
    return None if tape is None else tape.level(level.tape_tensors)


def _sinusoidal_time(t: Tensor, dim: int, scale: float = 1000.0) -> Tensor:
    half = dim // 2
    frequencies = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    angles = scale * t.unsqueeze(1) * frequencies.unsqueeze(0)
    return torch.cat((angles.sin(), angles.cos()), dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, in_channels: int, time_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_dim)
        self.linear_2 = nn.Linear(time_dim, time_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class CausalConditionalDecoder(nn.Module):
    """1-D U-Net predicting the flow velocity from (x, mu, speaker, prompt condition, t)."""

    def __init__(self, cfg: EstimatorConfig) -> None:
        super().__init__()
        self.in_channels = cfg.in_channels
        self.chunk_size = cfg.static_chunk_size
        time_dim = cfg.channels[0] * 4
        self.time_mlp = TimestepEmbedding(cfg.in_channels, time_dim)

        def transformers(dim: int) -> nn.ModuleList:
            return nn.ModuleList(
                TransformerBlock(dim, cfg.num_heads, cfg.attention_head_dim) for _ in range(cfg.n_blocks)
            )

        self.down_blocks = nn.ModuleList()
        dim_in = cfg.in_channels
        for i, dim in enumerate(cfg.channels):
            last = i == len(cfg.channels) - 1
            resample: nn.Module = CausalConv1d(dim, dim, 3) if last else Downsample1D(dim)
            self.down_blocks.append(UNetLevel(CausalResnetBlock1D(dim_in, dim, time_dim), transformers(dim), resample))
            dim_in = dim
        self.mid_blocks = nn.ModuleList(
            UNetLevel(CausalResnetBlock1D(dim_in, dim_in, time_dim), transformers(dim_in), None)
            for _ in range(cfg.num_mid_blocks)
        )
        self.up_blocks = nn.ModuleList()
        widths = (*cfg.channels[::-1], cfg.channels[0])
        for i in range(len(widths) - 1):
            dim = widths[i + 1]
            last = i == len(widths) - 2
            resample = CausalConv1d(dim, dim, 3) if last else Upsample1D(dim)
            self.up_blocks.append(
                UNetLevel(CausalResnetBlock1D(2 * widths[i], dim, time_dim), transformers(dim), resample)
            )
        self.final_block = CausalBlock1D(widths[-1], widths[-1])
        self.final_proj = PointwiseConv1d(widths[-1], cfg.out_channels)
        # One level (CosyVoice2's): no down- or upsampling, so a prefix tape can serve it.
        self.keeps_time_resolution = len(cfg.channels) == 1
        self.frames_major = False

    def fuse_kernels(self) -> None:
        """Compute the estimator in fewer GPU kernels, once its weights are loaded, placed and in their dtype.

        Replayed from CUDA graphs, a solve is bound by how many kernels it launches more than by
        arithmetic. Each attention projects queries, keys and values in one product; each feed-forward
        applies its GELU in its first product's epilogue; the causal and 1x1 convolutions become matrix
        products over frames, which spares cuDNN's layout copies around each (its kernels want channels
        last; the down- and upsampling convolutions of a multi-level U-Net stay as they are). The same
        weights and parameter names and the same output up to rounding, except that on CUDA the GELU is
        its tanh form (cuBLASLt's epilogue). The levels then hand their activations on frames-major
        (``[B, T, C]`` in memory behind ``[B, C, T]`` views), the layout the products and the
        transformers read: from channels-major input, each convolution's product needed a transposing
        copy first, slower at 32 rows than cuDNN's copies. Calling it again changes nothing.
        """
        if self.frames_major:
            return
        self.frames_major = True
        for module in self.modules():
            if isinstance(module, UNetLevel):
                module.frames_major = True
            elif isinstance(module, Attention):
                module.join_projections()
            elif isinstance(module, GELUProjection):
                module.gelu_in_epilogue = True
            elif isinstance(module, CausalConv1d | PointwiseConv1d):
                module.to_matmul()

    def _cat_channels(self, tensors: list[Tensor]) -> Tensor:
        """``[B, C, T]`` tensors side by side along channels, frames-major in memory where the kernels are fused."""
        if not self.frames_major:
            return torch.cat(tensors, dim=1)
        return torch.cat([t.transpose(1, 2) for t in tensors], dim=2).transpose(1, 2)

    def _attention_bias(
        self, mask: Tensor, streaming: Tensor, dtype: torch.dtype, prefix: Tensor | None = None
    ) -> Tensor:
        """``[B, T, T]`` additive bias from the padding mask ``[B, 1, T]``; chunked where ``streaming`` ``[B]``.

        With ``prefix`` (``[B, P]`` bool, each row's replayed prefix frames that are real), ``[B, T, P + T]``:
        every real prefix frame lies in an earlier chunk, so every query sees it.
        """
        length = mask.size(-1)
        visible = mask.bool().expand(-1, length, -1)
        if self.chunk_size > 0:
            chunks = chunk_mask(length, self.chunk_size, mask.device).unsqueeze(0)
            visible = visible & (chunks | ~streaming.view(-1, 1, 1))
        if prefix is not None:
            visible = torch.cat([prefix.unsqueeze(1).expand(-1, length, -1), visible], dim=2)
        return (1.0 - visible.to(dtype)) * _MASK_BIAS

    def forward(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: Tensor,
        tape: EstimatorTape | None = None,
    ) -> Tensor:
        """x, mu, cond ``[B, 80, T]``; mask ``[B, 1, T]``; t ``[B]``; spks ``[B, 80]``; streaming ``[B]`` bool
        -> velocity ``[B, 80, T]``. With a replaying ``tape`` the frames continue its prefixes."""
        time = self.time_mlp(_sinusoidal_time(t, self.in_channels).to(t.dtype))
        h = self._cat_channels([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(-1)), cond])
        prefix = None if tape is None else tape.visible

        # Each time resolution's padding mask and attention bias, worked out once for all its levels.
        masks = [mask]
        for _ in range(len(self.down_blocks) - 1):
            masks.append(masks[-1][:, :, ::2])
        biases = [self._attention_bias(level_mask, streaming, h.dtype, prefix) for level_mask in masks]
        skips: list[Tensor] = []
        for level, level_mask, bias in zip(cast(Iterable[UNetLevel], self.down_blocks), masks, biases, strict=True):
            h = level(h, level_mask, time, bias, _share(tape, level))
            skips.append(h)
            h = level.resample(h * level_mask, tape)
        for level in cast(Iterable[UNetLevel], self.mid_blocks):
            h = level(h, masks[-1], time, biases[-1], _share(tape, level))
        up = zip(cast(Iterable[UNetLevel], self.up_blocks), masks[::-1], biases[::-1], skips[::-1], strict=True)
        for level, level_mask, bias, skip in up:
            h = self._cat_channels([h[:, :, : skip.size(-1)], skip])
            h = level(h, level_mask, time, bias, _share(tape, level))
            h = level.resample(h * level_mask, tape)
        h = self.final_block(h, mask, tape)
        return self.final_proj(h * mask) * mask


@dataclass(frozen=True)
class Guidance:
    """The estimator's conditioning for a solve, doubled into the classifier-free-guidance pair (``[2B, ...]``)."""

    mask: Tensor
    mu: Tensor
    spks: Tensor
    cond: Tensor
    streaming: Tensor


class CausalConditionalCFM(nn.Module):
    """Euler integration of the estimator's velocity from fixed noise (t=0) to mel (t=1), with CFG."""

    rand_noise: Tensor

    def __init__(self, cfg: DecoderConfig, mel_bins: int) -> None:
        super().__init__()
        self.cfg_rate = cfg.inference_cfg_rate
        self.cosine_schedule = cfg.t_scheduler == "cosine"
        self.estimator = CausalConditionalDecoder(cfg.estimator)
        noise = torch.randn(
            [1, mel_bins, NOISE_FRAMES], generator=torch.Generator().manual_seed(NOISE_SEED), dtype=torch.float32
        )
        # Not persistent: flow.pt has no such entry; it is recreated identically on construction.
        self.register_buffer("rand_noise", noise, persistent=False)

    def time_steps(self, n_timesteps: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        t = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
        return 1 - torch.cos(t * 0.5 * torch.pi) if self.cosine_schedule else t

    def noise(self, start: int, frames: int) -> Tensor:
        """``[1, 80, frames]``: the pre-drawn noise of frames ``start`` to ``start + frames``."""
        if start + frames > self.rand_noise.size(2):
            raise ValueError(
                f"{start + frames} mel frames exceed the {self.rand_noise.size(2)} frames of pre-drawn noise"
            )
        return self.rand_noise[:, :, start : start + frames]

    def forward(
        self,
        mu: Tensor,
        mask: Tensor,
        spks: Tensor,
        cond: Tensor,
        n_timesteps: int,
        streaming: Tensor,
        *,
        noise: Tensor | None = None,
        tape: EstimatorTape | None = None,
    ) -> Tensor:
        """mu, cond ``[B, 80, T]``; mask ``[B, 1, T]``; spks ``[B, 80]``; streaming ``[B]`` bool
        -> mel ``[B, 80, T]`` (float32).

        ``noise`` (``[1 or B, 80, T]``) is where the solve starts, by default the pre-drawn noise of
        frames ``0..T``; a solve that continues a ``tape``'s prefix starts from the noise after it.
        Pure tensor code on the inputs' device, so a solve or one :meth:`step` of it can be recorded
        as a CUDA graph.
        """
        rows, _, frames = mu.shape
        if noise is None:
            noise = self.noise(0, frames)
        x = noise.to(mu.device, mu.dtype).expand(rows, -1, -1)
        guide = self.guidance(mu, mask, spks, cond, streaming)
        for t, dt in self.solver_steps(n_timesteps, mu.device, mu.dtype):
            x = self.step(x, guide, t, dt, tape)
        return x.float()

    def solver_steps(self, n_timesteps: int, device: torch.device, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
        """``(t, dt)`` of each Euler step, each ``[1]``. t accumulates dt in ``dtype``, as upstream's loop does,
        so every caller that steps with these gets the same mel."""
        t_span = self.time_steps(n_timesteps, device, dtype)
        t, dt = t_span[0:1], t_span[1] - t_span[0]
        steps = []
        for step in range(1, len(t_span)):
            steps.append((t, dt.reshape(1)))
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return steps

    @staticmethod
    def guidance(mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, streaming: Tensor) -> Guidance:
        """The estimator's inputs for the CFG pair: rows 0..B-1 conditioned, rows B..2B-1 unconditioned (zeros)."""
        return Guidance(
            mask=torch.cat([mask, mask]),
            mu=torch.cat([mu, torch.zeros_like(mu)]),
            spks=torch.cat([spks, torch.zeros_like(spks)]),
            cond=torch.cat([cond, torch.zeros_like(cond)]),
            streaming=torch.cat([streaming, streaming]),
        )

    def step(self, x: Tensor, guide: Guidance, t: Tensor, dt: Tensor, tape: EstimatorTape | None = None) -> Tensor:
        """One Euler step from ``x`` ``[B, 80, T]`` at time ``t``: both rows of the CFG pair in one batch."""
        rows = x.size(0)
        velocity = self.estimator(
            torch.cat([x, x]), guide.mask, guide.mu, t.expand(2 * rows), guide.spks, guide.cond, guide.streaming, tape
        )
        guided, unconditioned = velocity[:rows], velocity[rows:]
        return x + dt * ((1.0 + self.cfg_rate) * guided - self.cfg_rate * unconditioned)
