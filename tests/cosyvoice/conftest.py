"""Shared fixtures of the CosyVoice2 model-side tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

REFERENCE_DIR = Path(__file__).resolve().parents[2] / "var" / "reference"


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """The upstream ``cosyvoice`` package unpacked for parity tests, or a skip saying how to get it."""
    if not (REFERENCE_DIR / "cosyvoice" / "flow" / "flow.py").is_file():
        pytest.skip(
            "upstream reference code absent: pip install --no-deps --target var/reference cosyvoice-minicpmo==0.1.0"
        )
    return REFERENCE_DIR


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Decode on one thread: a tiny model only loses to thread hand-offs (tens of times slower)."""
    # Imported here: the Python 3.12 leg of scripts/test.sh runs a module of this folder without torch.
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
