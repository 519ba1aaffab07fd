"""Fixtures of the tests against a real Triton."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.scripted_triton import start_scripted_triton
from tts_gateway.gateway.embedded.server import EmbeddedTriton


@pytest.fixture(scope="module")
def scripted_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    """Triton over the scripted test model, whose input text says what it does."""
    server = start_scripted_triton(tmp_path_factory.mktemp("scripted_triton"))
    yield server
    server.stop(grace=2.0)
