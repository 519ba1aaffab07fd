"""Shared fixtures of the CosyVoice2 model-side tests.

torch is imported inside the fixtures that need it: the Python 3.12 leg of scripts/test.sh runs a
module of this folder in an environment without torch.
"""

from __future__ import annotations

import importlib.util
import sys
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
    for package in ("cosyvoice", "matcha"):
        _register_package(package, REFERENCE_DIR / package)
    return REFERENCE_DIR


def _register_package(name: str, directory: Path) -> None:
    """Make ``import NAME.…`` find the reference's package, as an installed one would be found, without
    putting the whole reference directory (with its ``bin`` and stray modules) on ``sys.path``."""
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        name, directory / "__init__.py", submodule_search_locations=[str(directory)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Decode on one thread: a tiny model only loses to thread hand-offs (tens of times slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def token2wav_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny config's ``cosyvoice2.yaml``, ``flow.pt`` and ``hift.pt``, laid out as the official model dir."""
    import torch

    from tts_gateway.models.cosyvoice2.checkpoints.config_writer import tiny_config, write_config
    from tts_gateway.models.cosyvoice2.model.flow import CausalFlow
    from tts_gateway.models.cosyvoice2.model.hift import HiFTGenerator

    directory = tmp_path_factory.mktemp("cosyvoice2")
    cfg = tiny_config()
    torch.manual_seed(0)
    write_config(cfg, directory / "cosyvoice2.yaml")
    torch.save(CausalFlow(cfg.flow).state_dict(), directory / "flow.pt")
    torch.save(HiFTGenerator(cfg.hift).state_dict(), directory / "hift.pt")
    return directory
