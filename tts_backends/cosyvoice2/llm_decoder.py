"""The CosyVoice2 LLM's forward pass over a static KV cache with one slot per request.

Continuous batching needs every row of a decoding batch at its own position: transformers'
``StaticCache`` writes one shared ``cache_position`` for the whole batch, and its paged continuous
batching measured about five times slower per step on an H100 without flash-attention
(``shared/docs/gpu-engine-measurements.md``). So this module keeps the model's own modules
(embedding, RMSNorms, projections, rotary embedding, MLPs: the Hugging Face ``Qwen2ForCausalLM``
loaded as usual) and replaces only the cache and the attention around them:

- keys and values live in two preallocated tensors ``[layers, slots, kv_heads, max_len, head_dim]``;
  decoding batch row ``r`` is slot ``r`` (the engine keeps live requests in the leading slots), and
  each row writes its new key and value at its own position;
- decode attention treats the query heads that share a key/value head as that head's query rows
  (one token each), so grouped-query attention reads the cache without repeating it;
- the output head is cut to the columns that can be sampled (speech tokens and the ids after
  them), a 24th of the vocabulary.

Every tensor a decode step touches has a fixed address and shape per batch size, so the engine
can record one step per batch-size bucket as a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb


class SlotDecoder:
    """Prefill and decode of a Hugging Face Qwen2 model over a slot-indexed static KV cache."""

    def __init__(self, model: Any, *, slots: int, max_len: int, columns: Tensor) -> None:
        config = model.config
        self._layers = list(model.model.layers)
        self._embed = model.model.embed_tokens
        self._norm = model.model.norm
        self._rotary = model.model.rotary_emb
        weight = model.lm_head.weight
        self.device = weight.device
        self.dtype = weight.dtype
        self.slots = slots
        self.max_len = max_len
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self._groups = self.heads // self.kv_heads
        columns = columns.to(self.device)
        self._head_weight = weight.detach()[columns].contiguous()
        bias = model.lm_head.bias
        self._head_bias = None if bias is None else bias.detach()[columns].contiguous()
        # One slot more than requests: the staging slot that recorded prefills write into.
        self.staging_slot = slots
        shape = (len(self._layers), slots + 1, self.kv_heads, max_len, self.head_dim)
        self.keys = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.values = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self._key_positions = torch.arange(max_len, device=self.device)

    @property
    def cache_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    @torch.inference_mode()
    def prefill(self, ids: Tensor, lengths: Tensor, first_slot: int) -> Tensor:
        """Run right-padded prompts ``ids`` ``[k, n]`` into slots ``first_slot..first_slot+k-1``.

        Returns the logits (float32, sampled columns) after each prompt's last real token.
        """
        rows, length = ids.shape
        positions = torch.arange(length, device=self.device).unsqueeze(0).expand(rows, -1)
        causal = positions.unsqueeze(2) >= positions.unsqueeze(1)
        visible = (causal & (positions < lengths.unsqueeze(1)).unsqueeze(1)).unsqueeze(1)
        hidden = self._embed(ids)
        rotary = self._rotary(hidden, positions)
        slots = slice(first_slot, first_slot + rows)
        for index, layer in enumerate(self._layers):
            attention = layer.self_attn
            query, key, value = self._project(attention, layer.input_layernorm(hidden), rotary)
            self.keys[index, slots, :, :length] = key
            self.values[index, slots, :, :length] = value
            key = key.repeat_interleave(self._groups, dim=1)
            value = value.repeat_interleave(self._groups, dim=1)
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible)
            hidden = self._finish_layer(layer, hidden, out)
        last = hidden[torch.arange(rows, device=self.device), lengths - 1]
        return self._logits(last)

    @torch.inference_mode()
    def decode(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """One step for rows (= slots) ``0..len(tokens)-1``: each row's token at its position.

        Returns float32 logits over the sampled columns. No host synchronisation.
        """
        rows = tokens.shape[0]
        # Rows the engine leaves unused in a batch-size bucket keep counting up: keep them in range.
        positions = positions.clamp(max=self.max_len - 1)
        hidden = self._embed(tokens.unsqueeze(1))
        rotary = self._rotary(hidden, positions.unsqueeze(1))
        visible = (self._key_positions.unsqueeze(0) <= positions.unsqueeze(1))[:, None, None, :]
        row_index = torch.arange(rows, device=self.device)
        for index, layer in enumerate(self._layers):
            attention = layer.self_attn
            query, key, value = self._project(attention, layer.input_layernorm(hidden), rotary)
            keys, values = self.keys[index, :rows], self.values[index, :rows]
            keys[row_index, :, positions] = key[:, :, 0]
            values[row_index, :, positions] = value[:, :, 0]
            grouped = query.reshape(rows, self.kv_heads, self._groups, self.head_dim)
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=visible)
            hidden = self._finish_layer(layer, hidden, out.reshape(rows, self.heads, 1, self.head_dim))
        return self._logits(hidden[:, 0])

    def move_slot(self, source: int, target: int, length: int | None = None) -> None:
        """Copy one slot's cache (its first ``length`` positions, default all) over another's."""
        end = self.max_len if length is None else length
        self.keys[:, target, :, :end] = self.keys[:, source, :, :end]
        self.values[:, target, :, :end] = self.values[:, source, :, :end]

    def _project(self, attention: Any, hidden: Tensor, rotary: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        rows, length, _ = hidden.shape
        query = attention.q_proj(hidden).view(rows, length, self.heads, self.head_dim).transpose(1, 2)
        key = attention.k_proj(hidden).view(rows, length, self.kv_heads, self.head_dim).transpose(1, 2)
        value = attention.v_proj(hidden).view(rows, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        return query, key, value

    @staticmethod
    def _finish_layer(layer: Any, hidden: Tensor, attended: Tensor) -> Tensor:
        rows, _, length, _ = attended.shape
        hidden = hidden + layer.self_attn.o_proj(attended.transpose(1, 2).reshape(rows, length, -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _logits(self, hidden: Tensor) -> Tensor:
        return F.linear(self._norm(hidden), self._head_weight, self._head_bias).float()
