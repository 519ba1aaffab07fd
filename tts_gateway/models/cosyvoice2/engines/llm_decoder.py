"""The CosyVoice2 LLM's forward pass over a static KV cache with one slot per request.

Continuous batching needs every row of a decoding batch at its own position: transformers'
``StaticCache`` writes one shared ``cache_position`` for the whole batch, and its paged continuous
batching measured about five times slower per step on an H100 without flash-attention. So this
module keeps the model's own weights and modules (embedding, RMSNorms, projections, rotary embedding,
activation: the Hugging Face ``Qwen2ForCausalLM`` loaded as usual) and replaces the cache, the attention
around it and how the projections are grouped:

- keys and values live in one preallocated tensor ``[layers, 2, slots, kv_heads, max_len, head_dim]``;
  decoding batch row ``r`` is slot ``r`` (the engine keeps live requests in the leading slots), and
  each row writes its new key and value at its own position, both in one write (one kernel a layer
  fewer than two writes);
- decode attention treats the query heads that share a key/value head as that head's query rows
  (one token each), so grouped-query attention reads the cache without repeating it;
- the output head is cut to the columns that can be sampled (speech tokens and the ids after
  them), a 24th of the vocabulary;
- the query, key and value projections are one matrix product, and so are the MLP's gate and
  up projections (:func:`joined`): three kernels fewer of about nineteen a layer, 16-20 %
  of a recorded decode step at 1 to 64 rows on an H200;
- a decode step attends to the first ``span`` positions of the cache only, the smallest of a few
  spans that holds every row's position, instead of all ``max_len``.

Every tensor a decode step touches has a fixed address and shape per batch size and span, so the
engine can record one step per (batch-size bucket, span) as a CUDA graph.

What lies between two cache operations (a layer's input norm, projections and rotary embedding;
its output projection, residual and MLP; the final norm and head) is a module of its own, a
region that :meth:`SlotDecoder.compile` compiles. Replayed from CUDA graphs, an uncompiled step
launches about 40 small kernels a layer; inductor fuses the norms, rotary embedding and
activations into a few, and the step is still bound by those launches (a few hundred kernels of a few
microseconds each at Qwen2-0.5B's 24 layers), not by arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from tts_gateway.models.cosyvoice2.engines.compiling import read_text_as_utf8
from tts_gateway.models.cosyvoice2.model.joined_linear import joined

# Cache positions a decode step may attend to: a prompt with a voice prompt and a sentence's speech
# tokens fits the first, the longest requests the last (``max_len`` is always added).
DEFAULT_SPANS: Final = (512, 1024, 2048)
_ATTENTION_WITHOUT_CUDNN: Final = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class AttentionInput(nn.Module):
    """A decoder layer up to its attention: input norm, query/key/value projections, rotary embedding."""

    def __init__(self, layer: Any, *, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        attention = layer.self_attn
        self.norm = layer.input_layernorm
        self.qkv_proj = joined(attention.q_proj, attention.k_proj, attention.v_proj)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self._widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """``hidden`` ``[rows, length, width]`` to the query ``[rows, heads, length, head_dim]`` and the key
        and value stacked, ``[rows, 2, kv_heads, length, head_dim]``, as the cache holds them."""
        rows, length, _ = hidden.shape
        query, key, value = (
            projected.view(rows, length, -1, self.head_dim).transpose(1, 2)
            for projected in self.qkv_proj(self.norm(hidden)).split(self._widths, dim=-1)
        )
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        return query, torch.stack((key, value), dim=1)


class LayerOutput(nn.Module):
    """A decoder layer after its attention: output projection and residual, post-attention norm, gated MLP."""

    def __init__(self, layer: Any) -> None:
        super().__init__()
        mlp = layer.mlp
        self.o_proj = layer.self_attn.o_proj
        self.norm = layer.post_attention_layernorm
        self.gate_up_proj = joined(mlp.gate_proj, mlp.up_proj)
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, hidden: Tensor, attended: Tensor) -> Tensor:
        """The layer's output for its input ``hidden`` and the attention's ``[rows, heads, length, head_dim]``."""
        rows, _, length, _ = attended.shape
        hidden = hidden + self.o_proj(attended.transpose(1, 2).reshape(rows, length, -1))
        gate, up = self.gate_up_proj(self.norm(hidden)).chunk(2, dim=-1)
        return hidden + self.down_proj(self.act_fn(gate) * up)


class SampledHead(nn.Module):
    """The final norm and the output head cut to the sampled columns; float32 logits."""

    def __init__(self, norm: nn.Module, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.norm = norm
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, hidden: Tensor) -> Tensor:
        return F.linear(self.norm(hidden), self.weight, self.bias).float()


class SlotDecoder:
    """Prefill and decode of a Hugging Face Qwen2 model over a slot-indexed static KV cache."""

    def __init__(
        self, model: Any, *, slots: int, max_len: int, columns: Tensor, spans: Sequence[int] = DEFAULT_SPANS
    ) -> None:
        config = model.config
        layers = list(model.model.layers)
        self._embed = model.model.embed_tokens
        self._rotary = model.model.rotary_emb
        weight = model.lm_head.weight
        self.device = weight.device
        self.dtype = weight.dtype
        self.slots = slots
        self.max_len = max_len
        self.spans: tuple[int, ...] = tuple(sorted({s for s in spans if 0 < s < max_len} | {max_len}))
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self._groups = self.heads // self.kv_heads
        shapes = {"heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim}
        self._inputs = [AttentionInput(layer, **shapes) for layer in layers]
        self._outputs = [LayerOutput(layer) for layer in layers]
        columns = columns.to(self.device)
        bias = model.lm_head.bias
        self._head = SampledHead(
            model.model.norm,
            weight.detach()[columns].contiguous(),
            None if bias is None else bias.detach()[columns].contiguous(),
        )
        # One slot more than requests: the staging slot, which a recorded pass's spare rows and columns write into.
        self.staging_slot = slots
        shape = (len(layers), 2, slots + 1, self.kv_heads, max_len, self.head_dim)
        self.cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self._key_positions = torch.arange(max_len, device=self.device)

    def compile(self, backend: str) -> None:
        """Compile every region with ``backend``, for any number of rows and prompt length.

        Alike regions share their compiled code (dynamo compiles one per shape class, not per layer);
        a region compiles when it first runs, so the caller runs its steps once before serving.
        """
        read_text_as_utf8()
        for region in (*self._inputs, *self._outputs, self._head):
            region.compile(backend=backend, dynamic=True)

    def span_for(self, end: int) -> int:
        """The smallest span holding positions ``0..end-1``; ValueError past ``max_len``."""
        if end > self.max_len:
            raise ValueError(f"position {end - 1} lies past the cache's {self.max_len} positions")
        return next(span for span in self.spans if span >= end)

    @property
    def cache_bytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    @torch.inference_mode()
    def prefill(self, ids: Tensor, lengths: Tensor, first_slot: int) -> Tensor:
        """Run right-padded prompts ``ids`` ``[k, n]`` into slots ``first_slot..first_slot+k-1``.

        Returns the logits (float32, sampled columns) after each prompt's last real token. The engine runs
        this pass eagerly, for prompts longer than its recorded prefills, so its shape is the prompt's length:
        cuDNN's attention, which builds and keeps a graph for every new shape, would grow the host memory
        with every new length, hence the other kernels.
        """
        rows, length = ids.shape
        positions = torch.arange(length, device=self.device).unsqueeze(0).expand(rows, -1)
        causal = positions.unsqueeze(2) >= positions.unsqueeze(1)
        visible = (causal & (positions < lengths.unsqueeze(1)).unsqueeze(1)).unsqueeze(1)
        hidden = self._embed(ids)
        cos, sin = self._rotary(hidden, positions)
        slots = slice(first_slot, first_slot + rows)
        with sdpa_kernel(_ATTENTION_WITHOUT_CUDNN):
            for index, (enter, leave) in enumerate(zip(self._inputs, self._outputs, strict=True)):
                query, key_value = enter(hidden, cos, sin)
                self.cache[index, :, slots, :, :length] = key_value.transpose(0, 1)
                key, value = key_value.repeat_interleave(self._groups, dim=2).unbind(1)
                out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible)
                hidden = leave(hidden, out)
        last = hidden[torch.arange(rows, device=self.device), lengths - 1]
        return self._head(last)

    @torch.inference_mode()
    def extend(self, ids: Tensor, starts: Tensor, lengths: Tensor, slots: Tensor, span: int) -> Tensor:
        """Append the first ``lengths[r]`` of ``ids[r]`` (``[rows, width]``) to slot ``slots[r]``, whose first
        ``starts[r]`` positions are cached, all rows in one pass; returns each row's logits (float32, sampled
        columns) after its last id. Attends to the first ``span`` positions, which must hold every row's input.

        Shapes depend only on rows, width and span, and nothing waits for the host, so the engine records
        this pass as a CUDA graph: text streams start a round at almost every step, and launched eagerly
        from Python the pass would hold the engine's thread between steps. To fill a bucket, a row may name
        the staging slot. Columns past a row's length write their keys into the staging slot, never past a
        row's input: the row's next decode steps find its cache as they would after an exact pass.
        """
        rows, width = ids.shape
        columns = self._key_positions[:width]
        positions = starts.unsqueeze(1) + columns
        real = columns.unsqueeze(0) < lengths.unsqueeze(1)
        write_slots = torch.where(real, slots.unsqueeze(1), self.staging_slot)
        write_positions = torch.where(real, positions, columns)
        hidden = self._embed(ids)
        cos, sin = self._rotary(hidden, positions)
        # Each query sees the cache and its row's ids up to its own position; the query heads that share
        # a key/value head are that head's query rows, as in a decode step.
        hidden_keys = self._key_positions[:span].view(1, 1, span) > positions.unsqueeze(2)
        mask = torch.zeros(hidden_keys.shape, device=self.device, dtype=self.dtype).masked_fill_(
            hidden_keys, float("-inf")
        )
        mask = mask.repeat(1, self._groups, 1).unsqueeze(1)
        # Not cuDNN's attention: it builds a graph for every new shape.
        with sdpa_kernel(_ATTENTION_WITHOUT_CUDNN):
            for index, (enter, leave) in enumerate(zip(self._inputs, self._outputs, strict=True)):
                query, key_value = enter(hidden, cos, sin)
                layer = self.cache[index]
                layer[:, write_slots, :, write_positions] = key_value.permute(0, 3, 1, 2, 4)
                grouped = query.reshape(rows, self.kv_heads, self._groups * width, self.head_dim)
                out = F.scaled_dot_product_attention(
                    grouped, layer[0, slots, :, :span], layer[1, slots, :, :span], attn_mask=mask
                )
                hidden = leave(hidden, out.reshape(rows, self.heads, width, self.head_dim))
        return self._head(hidden[torch.arange(rows, device=self.device), lengths - 1])

    def save_slot(self, slot: int, length: int) -> Tensor:
        """A copy of one slot's first ``length`` cached positions (keys and values)."""
        return self.cache[:, :, slot, :, :length].clone()

    def restore_slot(self, slot: int, saved: Tensor) -> None:
        """Write a :meth:`save_slot` copy back, into ``slot``."""
        self.cache[:, :, slot, :, : saved.shape[-2]] = saved

    @torch.inference_mode()
    def decode(self, tokens: Tensor, positions: Tensor, span: int) -> Tensor:
        """One step for rows (= slots) ``0..len(tokens)-1``: each row's token at its position.

        Attends to the first ``span`` cache positions, which must hold every row's position.
        Returns float32 logits over the sampled columns. No host synchronisation.
        """
        rows = tokens.shape[0]
        # Rows the engine leaves unused in a batch-size bucket keep counting up: keep them in range.
        positions = positions.clamp(max=span - 1)
        hidden = self._embed(tokens.unsqueeze(1))
        cos, sin = self._rotary(hidden, positions.unsqueeze(1))
        # An additive mask, made once for every layer (a boolean one is converted in each attention).
        hidden_keys = self._key_positions[:span].unsqueeze(0) > positions.unsqueeze(1)
        mask = torch.zeros(hidden_keys.shape, device=self.device, dtype=self.dtype).masked_fill_(
            hidden_keys, float("-inf")
        )[:, None, None, :]
        row_index = torch.arange(rows, device=self.device)
        for index, (enter, leave) in enumerate(zip(self._inputs, self._outputs, strict=True)):
            query, key_value = enter(hidden, cos, sin)
            layer = self.cache[index, :, :rows, :, :span]
            layer[:, row_index, :, positions] = key_value[:, :, :, 0]
            grouped = query.reshape(rows, self.kv_heads, self._groups, self.head_dim)
            out = F.scaled_dot_product_attention(grouped, layer[0], layer[1], attn_mask=mask)
            hidden = leave(hidden, out.reshape(rows, self.heads, 1, self.head_dim))
        return self._head(hidden[:, 0])

    def move_slot(self, source: int, target: int, length: int | None = None) -> None:
        """Copy one slot's cache (its first ``length`` positions, default all) over another's."""
        end = self.max_len if length is None else length
        self.cache[:, :, target, :, :end] = self.cache[:, :, source, :, :end]
