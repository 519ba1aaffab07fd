"""CosyVoice2's flow: speech tokens + speaker embedding + voice prompt -> 80-bin mel at 50 frames/s.

Inference path of upstream ``CausalMaskedDiffWithXvec``: the prompt's and the target's tokens are
embedded together, encoded and upsampled x``token_mel_ratio`` by the conformer encoder, projected to
mel width (``mu``), and decoded by conditional flow matching conditioned on ``mu``, the projected
speaker embedding and the prompt's mel frames. Only the target's frames are returned.

Streaming follows upstream: every chunk runs the flow over prompt + all target tokens so far.
Unless ``finalize``, the last ``pre_lookahead_len`` tokens only feed the encoder's look-ahead and get
no frames of their own. Because the noise is pre-drawn and sliced, the frames of a prefix computed
again come out the same, which is what lets chunks be cut at any frame. What the estimator computes
for the voice prompt is the same in every streaming chunk, so it can be recorded once per voice
(:meth:`CausalFlow.record_prefix`) and replayed (:mod:`.flow_prefix`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tts_gateway.models.cosyvoice2.model.config import FlowConfig
from tts_gateway.models.cosyvoice2.model.flow_decoder import NOISE_FRAMES, CausalConditionalCFM
from tts_gateway.models.cosyvoice2.model.flow_encoder import UpsampleConformerEncoder
from tts_gateway.models.cosyvoice2.model.flow_prefix import (
    PrefixRecorder,
    PrefixReplay,
    StackedPrefixes,
    VoicePrefix,
    chunk_alignment,
    prefix_frames,
    replay_rows,
    voice_slots,
)


def _padded(frames: int, multiple: int, *, limit: int) -> int:
    """``frames`` rounded up to a multiple of ``multiple``, but not past ``limit``."""
    return max(frames, min(-(-frames // multiple) * multiple, limit))


class TokenEncoder(Protocol):
    """A replacement for the eager :meth:`CausalFlow.encode` (CUDA-graph replays): ``mu``, or None where it has no
    fitting shape. ``tokens`` are on the CPU, the other inputs on the flow's device."""

    def __call__(self, tokens: Tensor, lengths: Tensor, has_context: Tensor, streaming: Tensor) -> Tensor | None: ...


class MelSolver(Protocol):
    """A replacement for the eager solve (CUDA-graph replays): the mel, or None where it has no fitting shape.

    ``prefixes``, where given, are each row's voice prefix: the inputs are the frames after it, and the solve
    starts from the noise after it. ``between_segments``, where given, is called between parts of the solve;
    it may run other solves through the same solver (the token2wav queue converts streams' first chunks there).
    ``n_timesteps`` is the solve's Euler steps (None: the solver's own count).
    """

    def __call__(
        self,
        mu: Tensor,
        mask: Tensor,
        speaker: Tensor,
        cond: Tensor,
        streaming: Tensor,
        prefixes: Sequence[VoicePrefix] | None,
        between_segments: Callable[[], None] | None = None,
        n_timesteps: int | None = None,
    ) -> Tensor | None: ...


@dataclass(frozen=True, eq=False)
class FlowItem:
    """One utterance of a batched flow call: tensors of one row, without a batch dimension."""

    token: Tensor
    """``[T]`` target speech tokens so far (the last ``pre_lookahead_len`` are look-ahead unless ``finalize``)."""
    prompt_token: Tensor
    """``[Tp]`` voice prompt tokens."""
    prompt_feat: Tensor
    """``[ratio*Tp, 80]`` voice prompt mel frames."""
    embedding: Tensor
    """``[192]`` speaker embedding."""
    streaming: bool
    finalize: bool


class CausalFlow(nn.Module):
    """State dict == upstream ``flow.pt`` (keys and shapes), so the official weights load with strict=True."""

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(cfg.encoder, cfg.pre_lookahead_len, cfg.token_mel_ratio)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = CausalConditionalCFM(cfg.decoder, cfg.output_size)
        # An eager solve pads its frames to a multiple of this (masked, so the mel is the same);
        # compiling the estimator's levels sets it (flow_compile.ALIGNED_FRAMES).
        self.frame_multiple = 1
        # With a compiled estimator, an eager solve after voice prefixes stacks them as the CUDA graphs' buffers
        # hold them, this many voices of this many frames, so that the estimator meets one shape of them (set
        # with the compile; (0, 0) stacks only the voices a solve has).
        self.prefix_slots = (0, 0)

    @classmethod
    def from_checkpoint(cls, cfg: FlowConfig, path: Path, device: torch.device, dtype: torch.dtype) -> CausalFlow:
        """Load ``flow.pt`` (a plain state dict) strictly, then move to ``device``/``dtype`` in eval mode."""
        flow = cls(cfg)
        state = torch.load(path, map_location="cpu", weights_only=True)
        try:
            flow.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise RuntimeError(f"{path} does not match the flow hyperparameters of cosyvoice2.yaml: {exc}") from exc
        return flow.to(device=device, dtype=dtype).eval()

    def prefix_frames(self, prompt_tokens: int, limit: int = NOISE_FRAMES) -> int:
        """Frames of a prompt of ``prompt_tokens`` tokens that :meth:`record_prefix` can record (0: none)."""
        cfg = self.cfg
        align = chunk_alignment(self.decoder.estimator.chunk_size, cfg.encoder.static_chunk_size, cfg.token_mel_ratio)
        if self.decoder.estimator.chunk_size <= 0 or cfg.encoder.static_chunk_size <= 0:
            return 0  # attention over everything: no frame is final before the last
        if not self.decoder.estimator.keeps_time_resolution:
            return 0  # a U-Net that resamples time mixes frames across the prefix's end
        return prefix_frames(
            prompt_tokens, lookahead=cfg.pre_lookahead_len, ratio=cfg.token_mel_ratio, align=align, limit=limit
        )

    @torch.inference_mode()
    def record_prefix(
        self,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        frames: int,
        *,
        n_timesteps: int = 10,
        capacity: int = 0,
    ) -> VoicePrefix:
        """What every streaming solve computes for the voice's first ``frames`` mel frames.

        prompt_token ``[Tp]``, prompt_feat ``[ratio*Tp, 80]``, embedding ``[192]``; ``frames`` from
        :meth:`prefix_frames`. The prefix is solved alone: nothing in it depends on later frames. Keys and
        values are kept for ``capacity`` frames where that is more (zeros after ``frames``), so that a
        voice fills a slot of the CUDA graphs' buffers with one copy of each tensor whole.
        """
        if not 0 < frames <= self.prefix_frames(prompt_token.numel()):
            raise ValueError(f"{frames} frames are not a recordable prefix of {prompt_token.numel()} prompt tokens")
        weight = self.input_embedding.weight
        device, dtype = weight.device, weight.dtype
        tokens = prompt_token.reshape(1, -1).to(device).clamp(min=0)
        padded = torch.cat([tokens, tokens.new_zeros(1, self.cfg.pre_lookahead_len)], dim=1)
        yes = torch.tensor([True], device=device)
        mu = self.encode(padded, torch.tensor([tokens.size(1)], device=device), ~yes, yes)[:, :, :frames].contiguous()
        speaker = self.spk_embed_affine_layer(F.normalize(embedding.reshape(1, -1).to(device, dtype), dim=1))
        cond = prompt_feat[:frames].transpose(0, 1).unsqueeze(0).to(device, dtype)
        recorder = PrefixRecorder()
        mask = torch.ones(1, 1, frames, device=device, dtype=dtype)
        # Uncompiled: compiled levels would compile again, mid-request, for a tape that keeps what it is handed.
        with torch.compiler.set_stance("force_eager"):
            self.decoder(mu, mask, speaker, cond, n_timesteps, yes, tape=recorder)
        padding = max(0, capacity - frames)
        kept = (F.pad(t, (0, 0, 0, padding)) if t.dim() == 4 and padding else t for t in recorder.tensors)
        return VoicePrefix(frames, n_timesteps, tuple(kept))

    def encode(self, tokens: Tensor, lengths: Tensor, has_context: Tensor, streaming: Tensor) -> Tensor:
        """``mu`` ``[B, 80, ratio * (W - lookahead)]`` of token rows ``[B, W]`` right-padded with zeros (see
        :meth:`UpsampleConformerEncoder.forward` for ``lengths``, ``has_context`` and ``streaming``)."""
        h = self.encoder(self.input_embedding(tokens.clamp(min=0)), lengths, has_context, streaming)
        return self.encoder_proj(h).transpose(1, 2)

    def mel_frames(self, target_tokens: int, *, finalize: bool) -> int:
        """Frames :meth:`inference` returns for ``target_tokens`` target tokens."""
        voiced = target_tokens if finalize else target_tokens - self.cfg.pre_lookahead_len
        return self.cfg.token_mel_ratio * voiced

    def _check_inputs(
        self, token: Tensor, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor, finalize: bool
    ) -> None:
        cfg = self.cfg
        if token.dim() != 2 or token.size(0) != 1 or prompt_token.dim() != 2 or prompt_token.size(0) != 1:
            raise ValueError("token and prompt_token must be [1, T] (one utterance)")
        if token.dtype.is_floating_point or prompt_token.dtype.is_floating_point:
            raise ValueError("speech tokens must be integer tensors")
        for tokens in (token, prompt_token):
            # Checked here, not by the embedding: on CUDA an id out of range is a device-side assert.
            # (Negative ids are clamped to 0 on the way in, as upstream does.)
            if tokens.numel() and int(tokens.max()) >= cfg.vocab_size:
                raise ValueError(f"speech tokens must be below {cfg.vocab_size}")
        frames = cfg.token_mel_ratio * (prompt_token.size(1) + token.size(1))
        if frames > NOISE_FRAMES:
            raise ValueError(f"{frames} mel frames exceed the flow's {NOISE_FRAMES} frames of pre-drawn noise")
        expected_feat = (1, cfg.token_mel_ratio * prompt_token.size(1), cfg.output_size)
        if tuple(prompt_feat.shape) != expected_feat:
            raise ValueError(
                f"prompt_feat must be {list(expected_feat)} for these prompt tokens, got {list(prompt_feat.shape)}"
            )
        if tuple(embedding.shape) != (1, cfg.spk_embed_dim):
            raise ValueError(f"embedding must be [1, {cfg.spk_embed_dim}], got {list(embedding.shape)}")
        if not finalize and token.size(1) < cfg.pre_lookahead_len:
            raise ValueError(f"a non-final chunk needs at least {cfg.pre_lookahead_len} target tokens (look-ahead)")

    def check_item(self, item: FlowItem) -> None:
        """Raise ValueError unless ``item``'s shapes fit this flow (what :meth:`inference_batch` assumes)."""
        self._check_inputs(
            item.token[None], item.prompt_token[None], item.prompt_feat[None], item.embedding[None], item.finalize
        )

    @torch.inference_mode()
    def inference(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        streaming: bool,
        finalize: bool,
        n_timesteps: int = 10,
    ) -> Tensor:
        """Mel ``[1, 80, frames]`` (float32) of the target tokens.

        token ``[1, T]`` are the target's speech tokens so far, prompt_token ``[1, Tp]`` the voice
        prompt's, prompt_feat ``[1, ratio*Tp, 80]`` its mel frames and embedding ``[1, 192]`` its
        speaker embedding. ``streaming`` selects chunked attention (as upstream's streaming mode);
        ``finalize=False`` treats the last ``pre_lookahead_len`` tokens as look-ahead only.
        """
        self._check_inputs(token, prompt_token, prompt_feat, embedding, finalize)
        item = FlowItem(token[0], prompt_token[0], prompt_feat[0], embedding[0], streaming, finalize)
        return self.inference_batch([item], n_timesteps=n_timesteps)[0].unsqueeze(0)

    @torch.inference_mode()
    def inference_batch(
        self,
        items: Sequence[FlowItem],
        *,
        n_timesteps: int = 10,
        solver: MelSolver | None = None,
        prefixes: Sequence[VoicePrefix] | None = None,
        between_segments: Callable[[], None] | None = None,
        encoder: TokenEncoder | None = None,
        eager_solves: list[tuple[int, int]] | None = None,
    ) -> list[Tensor]:
        """Mel ``[80, frames_i]`` (float32) of each item's target tokens, computed as one batch.

        Rows are right-padded to the longest; the encoder and the estimator mask the padding, so
        each row gets what it would get alone (up to floating-point reordering). ``solver`` (for
        example CUDA-graph replays, :mod:`tts_gateway.models.cosyvoice2.engines.flow_graphs`) replaces the eager
        flow-matching solve where it has a shape that fits (and calls ``between_segments`` between the
        parts of its solve, see :class:`MelSolver`); ``encoder`` likewise replaces the eager encoder (for
        example :mod:`tts_gateway.models.cosyvoice2.engines.encoder_graphs`). With ``prefixes`` (one per item, recorded
        for its voice; all items streaming) each row's solve runs only after its voice's prefix. ``eager_solves``,
        where given, gets the (rows, frames) of the solve when it runs eagerly (its memory grows with them).
        """
        starts = [0] * len(items) if prefixes is None else [prefix.frames for prefix in prefixes]
        if prefixes is not None:
            if len(prefixes) != len(items):
                raise ValueError(f"{len(prefixes)} voice prefixes for {len(items)} items")
            if not all(item.streaming and item.prompt_feat.size(0) >= s for item, s in zip(items, starts, strict=True)):
                raise ValueError("a voice prefix serves streaming chunks of a prompt at least as long as the prefix")
            for prefix in prefixes:
                if prefix.steps != n_timesteps:
                    raise ValueError(f"a voice prefix was recorded over {prefix.steps} solver steps, not {n_timesteps}")
        weight = self.input_embedding.weight
        device, dtype = weight.device, weight.dtype
        lookahead = self.cfg.pre_lookahead_len
        ratio = self.cfg.token_mel_ratio
        voiced = [
            item.prompt_token.numel() + item.token.numel() - (0 if item.finalize else lookahead) for item in items
        ]
        rows = len(items)
        width = max(voiced) + lookahead
        tokens = torch.zeros(rows, width, dtype=torch.long)
        for row, item in enumerate(items):
            sequence = torch.cat([item.prompt_token.reshape(-1), item.token.reshape(-1)]).cpu()
            tokens[row, : sequence.numel()] = sequence
        lengths = torch.tensor(voiced, device=device)
        has_context = torch.tensor([not item.finalize for item in items], device=device)
        streaming = torch.tensor([item.streaming for item in items], device=device)
        mu = None if encoder is None else encoder(tokens, lengths, has_context, streaming)
        if mu is None:
            mu = self.encode(tokens.to(device), lengths, has_context, streaming).contiguous()

        frames = mu.size(2)
        embeddings = torch.stack([item.embedding.reshape(-1) for item in items]).to(device, dtype)
        speaker = self.spk_embed_affine_layer(F.normalize(embeddings, dim=1))
        cond = torch.zeros_like(mu)
        for row, item in enumerate(items):
            cond[row, :, : item.prompt_feat.size(0)] = item.prompt_feat.transpose(0, 1).to(device, dtype)
        steps = torch.arange(frames, device=device)
        mask = (steps.unsqueeze(0) < ratio * lengths.unsqueeze(1)).unsqueeze(1).to(dtype)
        if prefixes is not None:
            mu, mask, cond = _after(starts, mu, mask, cond)
        mel = None
        if solver is not None:
            mel = solver(mu, mask, speaker, cond, streaming, prefixes, between_segments, n_timesteps=n_timesteps)
        if mel is None:
            if eager_solves is not None:
                eager_solves.append((mu.size(0), mu.size(2)))
            padded = _padded(mu.size(2), self.frame_multiple, limit=NOISE_FRAMES - max(starts))
            if padded > mu.size(2):
                mu, mask, cond = (F.pad(tensor, (0, padded - tensor.size(2))) for tensor in (mu, mask, cond))
            noise = torch.cat([self._noise_after(start, padded) for start in starts])
            tape = None if prefixes is None else self._replay(prefixes, device)
            mel = self.decoder(mu, mask, speaker, cond, n_timesteps, streaming, noise=noise, tape=tape)
        ends = [
            (item.prompt_feat.size(0) - starts[row], ratio * voiced[row] - starts[row])
            for row, item in enumerate(items)
        ]
        return [mel[row, :, first:last] for row, (first, last) in enumerate(ends)]

    def _noise_after(self, start: int, frames: int) -> Tensor:
        """The pre-drawn noise of ``frames`` frames from ``start``, zeros past the last (frames a row with a later
        start than others in its solve only pads, masked)."""
        noise = self.decoder.noise(start, min(frames, NOISE_FRAMES - start))
        return F.pad(noise, (0, frames - noise.size(2)))

    def _replay(self, prefixes: Sequence[VoicePrefix], device: torch.device) -> PrefixReplay:
        """A tape over the rows' prefixes for an eager solve (the CUDA graphs keep theirs in static buffers)."""
        voices, slots = voice_slots(prefixes)
        stacked_voices, frames = self.prefix_slots
        capacity = max(frames, *(voice.capacity for voice in voices))
        padded = voices + [voices[0]] * (stacked_voices - len(voices))
        entries, visible = replay_rows(slots, [prefix.frames for prefix in prefixes], len(prefixes), capacity, device)
        return PrefixReplay(StackedPrefixes(padded, capacity, static=stacked_voices > 0), entries, visible)


def _after(starts: Sequence[int], mu: Tensor, mask: Tensor, cond: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``mu``, ``mask`` and ``cond`` (``[B, C, T]``), each row from its own start on, shifted to frame 0; the
    frames a row then has past ``T`` are masked."""
    frames = mu.size(2)
    source = torch.tensor(starts, device=mu.device).view(-1, 1, 1) + torch.arange(
        frames - min(starts), device=mu.device
    ).view(1, 1, -1)
    index = source.clamp(max=frames - 1)
    mu, mask, cond = (t.gather(2, index.expand(-1, t.size(1), -1)) for t in (mu, mask, cond))
    return mu, mask * (source < frames).to(mask.dtype), cond
