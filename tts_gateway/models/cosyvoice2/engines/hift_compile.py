"""HiFT's Snake activations compiled by ``torch.compile`` at load: one kernel each instead of seven.

HiFT's residual blocks apply a Snake activation before each of their 72 convolutions. Eagerly each is
seven elementwise kernels (a product, a sine, a square, a sum, a reciprocal, a product and a sum) over
float32 activations at the upsampled rates (400 Hz to 6 kHz). On an H200, of the 19.9 ms of kernels that
HiFT ran for a group of 32 first chunks, elementwise ones took 11.5 ms; compiled, each activation is one
kernel reading its input once, and the 72 took 2.9 ms (``benchmarks/gpu_flow_profile.py``). The
convolutions stay cuDNN's.

One function is compiled for every block's activation, its sizes symbolic: HiFT's three channel widths
and every row and sample count share a graph. A batch of one row specialises (PyTorch treats sizes 0
and 1 apart), so the warm-up runs one row and two. The graphs are guarded on the grad mode they were
traced in: the warm-up runs under ``inference_mode``, as every call token2wav makes does, so no request
waits for a compile (a call under ``no_grad`` or with grad would compile once more). Where HiFT is
recorded as CUDA graphs the compiled kernels are recorded with the rest.
"""

from __future__ import annotations

import time

import torch

from tts_gateway.models.cosyvoice2.engines.compiling import compile_failed, read_text_as_utf8
from tts_gateway.models.cosyvoice2.model.hift import HiFTGenerator, Snake, snake

# Mel frames of the warm-up's chunks: about a first chunk's. Sizes stay symbolic, but inductor picks a
# kernel's block size from the first call's, which should be of the size the kernels will mostly meet.
_WARM_UP_FRAMES = 64


def compile_hift_activations(hift: HiFTGenerator, backend: str) -> float:
    """Compile ``hift``'s Snake activations with ``backend`` and warm them up; seconds taken.

    Where compiling fails, the activations are left uncompiled and the error says how to run without."""
    started = time.monotonic()
    read_text_as_utf8()
    activations = [module for module in hift.modules() if isinstance(module, Snake)]
    reference = hift.conv_pre.bias
    try:
        compiled = torch.compile(snake, backend=backend, dynamic=True)
        for module in activations:
            module.activation = compiled
        with torch.inference_mode():
            for rows in (2, 1):
                mel = torch.zeros(rows, hift.conv_pre.in_channels, _WARM_UP_FRAMES, device=reference.device)
                generator = torch.Generator(reference.device).manual_seed(0)
                hift.vocode(mel.to(reference.dtype), hift.draw_noise(rows, _WARM_UP_FRAMES, generator))
    except Exception as exc:
        for module in activations:
            module.activation = snake
        raise compile_failed("HiFT's activations", backend, exc) from exc
    if reference.device.type == "cuda":
        torch.cuda.synchronize(reference.device)
    return time.monotonic() - started
