"""CosyVoice2's flow: speech tokens + speaker embedding + voice prompt -> 80-bin mel at 50 frames/s.

Inference path of upstream ``CausalMaskedDiffWithXvec``: the prompt's and the target's tokens are
embedded together, encoded and upsampled x``token_mel_ratio`` by the conformer encoder, projected to
mel width (``mu``), and decoded by conditional flow matching conditioned on ``mu``, the projected
speaker embedding and the prompt's mel frames. Only the target's frames are returned.

Streaming follows upstream: every chunk re-runs the flow over prompt + all target tokens so far
(there is no flow cache). Unless ``finalize``, the last ``pre_lookahead_len`` tokens only feed the
encoder's look-ahead and get no frames of their own. Because the noise is pre-drawn and sliced, the
frames of a prefix computed again come out the same, which is what lets chunks be cut at any frame.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tts_backends.cosyvoice2.config import FlowConfig
from tts_backends.cosyvoice2.flow_decoder import CausalConditionalCFM
from tts_backends.cosyvoice2.flow_encoder import UpsampleConformerEncoder


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
        expected_feat = (1, cfg.token_mel_ratio * prompt_token.size(1), cfg.output_size)
        if tuple(prompt_feat.shape) != expected_feat:
            raise ValueError(
                f"prompt_feat must be {list(expected_feat)} for these prompt tokens, got {list(prompt_feat.shape)}"
            )
        if tuple(embedding.shape) != (1, cfg.spk_embed_dim):
            raise ValueError(f"embedding must be [1, {cfg.spk_embed_dim}], got {list(embedding.shape)}")
        if not finalize and token.size(1) < cfg.pre_lookahead_len:
            raise ValueError(f"a non-final chunk needs at least {cfg.pre_lookahead_len} target tokens (look-ahead)")

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
        weight = self.input_embedding.weight
        speaker = self.spk_embed_affine_layer(F.normalize(embedding.to(weight.device, weight.dtype), dim=1))

        tokens = torch.cat([prompt_token, token], dim=1).to(weight.device)
        x = self.input_embedding(tokens.clamp(min=0))
        context = None
        if not finalize:
            lookahead = self.cfg.pre_lookahead_len
            x, context = x[:, :-lookahead], x[:, -lookahead:]
        h = self.encoder(x, context, streaming)
        mu = self.encoder_proj(h).transpose(1, 2).contiguous()

        frames, prompt_frames = mu.size(2), prompt_feat.size(1)
        cond = torch.zeros_like(mu)
        cond[:, :, :prompt_frames] = prompt_feat.transpose(1, 2).to(weight.device, weight.dtype)
        mask = torch.ones([1, 1, frames], device=weight.device, dtype=weight.dtype)
        mel = self.decoder(mu, mask, speaker, cond, n_timesteps, streaming)
        return mel[:, :, prompt_frames:]
