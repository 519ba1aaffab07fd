"""Settings validation: bad values fail at start-up, not at the first request."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.settings import OPENAI_VOICE_NAMES, Settings


def test_voice_aliases_from_the_environment_merge_over_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_VOICE_ALIASES", '{"alloy": "grandpa", "robot": "lumen"}')
    aliases = Settings().voice_aliases
    assert aliases["alloy"] == "grandpa" and aliases["robot"] == "lumen"
    assert set(OPENAI_VOICE_NAMES) <= set(aliases)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("triton_url", "http://triton:8000/v2"),
        ("ref_max_seconds", 45.0),
        ("embedded_overrides", ["no-equals-sign"]),
        ("backend_mode", "sometimes"),
        ("port", 0),
    ],
)
def test_bad_values_are_rejected(field: str, value: object) -> None:
    with pytest.raises(ValidationError):
        Settings(**{field: value})


def test_triton_url_accepts_grpc_scheme() -> None:
    assert Settings(triton_url="grpc://triton:8001").triton_url == "triton:8001"
