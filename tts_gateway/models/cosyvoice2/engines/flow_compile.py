"""The flow estimator's U-Net levels compiled by ``torch.compile`` at load, for every shape at once.

Replayed from CUDA graphs, a first chunk's flow still launches about 15,500 kernels, most of them
small: layer norms, activations, residual adds and cuDNN's layout copies around the convolutions
(``benchmarks/gpu_flow_profile.py``). Inductor fuses those. Compiling the estimator whole with
static shapes took 70-80 s for each of token2wav's 72 CUDA-graph buckets, so this compiles its
levels instead (what PyTorch calls regional compilation), with symbolic shapes: the 12 mid levels
are instances of one class with parameters of one shape and share one compiled graph, and a graph
serves every row and frame count that is a multiple of 8, as the recorded buckets' are and eager
solves are padded to (:data:`ALIGNED_FRAMES`). The levels run inside the recorded solve, where the compiled
code's Python launchers cost nothing per call; the encoder, which runs eagerly, is left as it is
(compiled, its blocks made a first chunk slower in Triton, where the host is busy).
"""

from __future__ import annotations

import time
from typing import Final

import torch

from tts_gateway.models.cosyvoice2.engines.compiling import compile_failed, read_text_as_utf8
from tts_gateway.models.cosyvoice2.model.flow import CausalFlow, FlowItem
from tts_gateway.models.cosyvoice2.model.flow_decoder import UNetLevel

_WARM_UP_TOKENS: Final = 20
# A prompt long enough for a voice prefix of one chunk (50 frames) before its look-ahead.
_WARM_UP_PREFIX_TOKENS: Final = 40

ALIGNED_FRAMES: Final = 8
"""Frames of a compiled flow's eager solves are padded to a multiple of this. Inductor specialises a
compiled level on whether its frame count is a multiple of 8 (its alignment check around attention);
the recorded solves' buckets must be, and eager solves padded alike run the same compiled graphs:
three compiles at load instead of six."""


def compile_flow_levels(
    flow: CausalFlow, backend: str, *, n_timesteps: int, warm_up: bool = True, fuse: bool = True
) -> float:
    """Compile the U-Net levels of ``flow``'s estimator in place with ``backend``; seconds taken.

    With ``fuse`` the estimator first computes in fewer kernels
    (:meth:`~tts_gateway.models.cosyvoice2.model.flow_decoder.CausalConditionalDecoder.fuse_kernels`).

    ``torch.compile`` only traces a level at its first call, so this then converts a streaming
    first chunk (and one after a voice prefix where ``flow.prefix_slots`` says prefixes are replayed):
    a request must not be the one that waits for a compile. (The estimator's batch
    is the classifier-free-guidance pair, never 1, so the trace's sizes stay symbolic.) Inductor
    picks its kernels' block sizes and reduction splits for the shape of that first call, so a
    caller about to record CUDA graphs passes ``warm_up=False`` and lets its recording, which starts
    with the largest bucket, be the first call: compiled from the warm-up's 2 rows x 80 frames, a
    group's flow at 64 streams took about 230 ms on the H100 instead of 200.
    """
    started = time.monotonic()
    read_text_as_utf8()
    flow.frame_multiple = ALIGNED_FRAMES
    if fuse:
        flow.decoder.estimator.fuse_kernels()
    try:
        for module in flow.decoder.estimator.modules():
            if isinstance(module, UNetLevel):
                module.compile(backend=backend, dynamic=True)
        if warm_up:
            _warm_up(flow, n_timesteps)
    except Exception as exc:
        raise compile_failed("the flow", backend, exc) from exc
    return time.monotonic() - started


def _warm_up(flow: CausalFlow, n_timesteps: int) -> None:
    weight = flow.input_embedding.weight
    cfg = flow.cfg
    tokens = torch.zeros(_WARM_UP_TOKENS, dtype=torch.long)
    item = FlowItem(
        token=tokens,
        prompt_token=tokens,
        prompt_feat=torch.zeros(cfg.token_mel_ratio * _WARM_UP_TOKENS, cfg.output_size, dtype=weight.dtype),
        embedding=torch.ones(cfg.spk_embed_dim, dtype=weight.dtype),
        streaming=True,
        finalize=False,
    )
    flow.inference_batch([item], n_timesteps=n_timesteps)
    capacity = flow.prefix_slots[1]
    frames = flow.prefix_frames(_WARM_UP_PREFIX_TOKENS, capacity)
    if capacity > 0 and frames > 0:
        # A chunk after a voice prefix: the levels take a tape then, which compiles them once more.
        prompt = torch.zeros(_WARM_UP_PREFIX_TOKENS, dtype=torch.long)
        feat = torch.zeros(cfg.token_mel_ratio * prompt.numel(), cfg.output_size, dtype=weight.dtype)
        prefix = flow.record_prefix(prompt, feat, item.embedding, frames, n_timesteps=n_timesteps, capacity=capacity)
        after = FlowItem(tokens, prompt, feat, item.embedding, streaming=True, finalize=False)
        flow.inference_batch([after], n_timesteps=n_timesteps, prefixes=[prefix])
    if weight.device.type == "cuda":
        torch.cuda.synchronize(weight.device)
