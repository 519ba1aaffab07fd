"""HiFT's activations compiled (hift_compile.py): the same audio, compiled at load for every shape.

The GPU profiles compile with inductor; here ``aot_eager`` traces the same graphs with symbolic
sizes on the CPU without generating kernels.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from tts_gateway.models.cosyvoice2.checkpoints.random_checkpoint import official_config
from tts_gateway.models.cosyvoice2.engines.hift_compile import compile_hift_activations
from tts_gateway.models.cosyvoice2.model.hift import HiFTGenerator, Snake, snake

pytestmark = pytest.mark.cosyvoice


def _compiled_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _hift() -> HiFTGenerator:
    torch.manual_seed(0)
    hift = HiFTGenerator(official_config().hift).eval()
    with torch.no_grad():
        for parameter in hift.parameters():
            parameter.normal_(0.0, 0.05)
    return hift


def _vocode(hift: HiFTGenerator, mel: torch.Tensor, frames: torch.Tensor | None = None) -> torch.Tensor:
    rows, _, length = mel.shape
    noise = hift.draw_noise(rows, length, torch.Generator().manual_seed(1))
    with torch.inference_mode():
        return hift.vocode(mel, noise, frames=frames)[0]


def test_compiled_activations_vocode_every_shape_as_uncompiled_without_compiling_again() -> None:
    """CosyVoice2's HiFT has Snakes at three channel widths; one row, several, and padded rows of
    different lengths all run the graphs compiled at load."""
    hift = _hift()
    mels = [torch.randn(1, 80, 17), torch.randn(3, 80, 30), torch.randn(5, 80, 52)]
    padded = torch.randn(2, 80, 40)
    lengths = torch.tensor([40, 23])
    expected = [_vocode(hift, mel) for mel in mels] + [_vocode(hift, padded, lengths)]
    torch._dynamo.reset()
    before = _compiled_graphs()
    compile_hift_activations(hift, "aot_eager")
    loaded = _compiled_graphs()
    # One graph for a batch of one row, one for more rows: every width and length shares it.
    assert loaded - before == 2
    assert all(m.activation is not snake for m in hift.modules() if isinstance(m, Snake))
    got = [_vocode(hift, mel) for mel in mels] + [_vocode(hift, padded, lengths)]
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want, atol=1e-6, rtol=1e-5)
    assert _compiled_graphs() == loaded


def test_a_compile_that_fails_says_how_to_run_without_and_leaves_hift_uncompiled() -> None:
    hift = _hift()
    with pytest.raises(RuntimeError, match="empty compile_backend runs it uncompiled"):
        compile_hift_activations(hift, "no-such-backend")
    assert all(m.activation is snake for m in hift.modules() if isinstance(m, Snake))
