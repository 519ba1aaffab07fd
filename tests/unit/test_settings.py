"""Settings validation: bad values fail at start-up, not at the first request."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from tts_gateway.gateway.settings import OPENAI_VOICE_NAMES, Settings
from tts_gateway.models.model_repository import parse_overrides
from tts_gateway.paths import TRITON_REPOSITORY


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
        ("api_keys", "good-key, bad key"),
        ("api_keys", '["unterminated"'),
        ("public_endpoints", "health"),
        ("max_concurrent_speech", 0),
        ("max_queued_speech", -1),
        ("backend_chunk_timeout", 0),
        ("queue_timeout", 300.0),
        ("llm_urls", "localhost:8000/v1"),
        ("llm_urls", "http://llm:8000/v1, grpc://llm:8001"),
    ],
)
def test_bad_values_are_rejected(field: str, value: object) -> None:
    with pytest.raises(ValidationError):
        Settings(**{field: value})


def test_llm_urls_are_read_comma_or_space_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_LLM_URLS", " http://a:8000/v1, http://b:8000/v1 ")
    assert Settings().llm_urls == "http://a:8000/v1,http://b:8000/v1"
    monkeypatch.setenv("TTS_LLM_URLS", "")
    assert Settings().llm_urls is None


def test_triton_url_accepts_grpc_scheme() -> None:
    assert Settings(triton_url="grpc://triton:8001").triton_url == "triton:8001"


def test_triton_url_takes_a_list() -> None:
    settings = Settings(triton_url="grpc://a:8001, b.triton.svc:8001,[::1]:8001,a:8001")
    assert settings.triton_urls == ["a:8001", "b.triton.svc:8001", "[::1]:8001"]
    assert Settings(triton_url=" ").triton_urls == []
    with pytest.raises(ValidationError, match="'b'"):
        Settings(triton_url="a:8001,b")


@pytest.mark.parametrize("value", ["key-one,key-two", " key-one , key-two ,", '["key-one", "key-two"]'])
def test_api_keys_come_comma_separated_or_as_json(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("TTS_API_KEYS", value)
    settings = Settings()
    assert [key.get_secret_value() for key in settings.api_keys] == ["key-one", "key-two"]
    assert "key-one" not in repr(settings)


def test_auth_is_off_and_health_public_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TTS_API_KEYS", raising=False)
    monkeypatch.delenv("TTS_PUBLIC_ENDPOINTS", raising=False)
    assert Settings().api_keys == []
    assert Settings().public_endpoints == ["/health"]
    monkeypatch.setenv("TTS_API_KEYS", "")
    assert Settings().api_keys == []


def test_public_endpoints_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_PUBLIC_ENDPOINTS", "/health,/metrics")
    assert Settings().public_endpoints == ["/health", "/metrics"]
    monkeypatch.setenv("TTS_PUBLIC_ENDPOINTS", "")
    assert Settings().public_endpoints == []


def test_path_settings_are_read_from_the_directory_the_gateway_started_in(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    relative = {
        "triton_repository": "templates",
        "models_root": "../models",
        "embedded_workdir": "work/embedded",
        "ref_audios_dir": "./refs",
        "voices_dir": "voices",
    }
    for field, value in relative.items():
        monkeypatch.setenv(f"TTS_{field.upper()}", value)
    (tmp_path / ".env").write_text('TTS_EMBEDDED_OVERRIDES=["token2wav.model_dir=checkpoints/cosy"]\n')
    settings = Settings()
    for field, value in relative.items():
        assert getattr(settings, field) == Path(os.path.normpath(tmp_path / value)), field
    # A path among the template overrides too; other values stay as written.
    assert parse_overrides(settings.embedded_overrides) == {"token2wav": {"model_dir": f"{tmp_path}/checkpoints/cosy"}}
    assert parse_overrides(["cosyvoice2.llm_model=llm"]) == {"cosyvoice2": {"llm_model": "llm"}}
    # Defaults too: uploaded voices go under the starting directory, the shipped files stay where they are.
    for field in relative:
        monkeypatch.delenv(f"TTS_{field.upper()}")
    defaults = Settings()
    assert defaults.voices_dir == tmp_path / "data" / "voices"
    assert defaults.triton_repository == TRITON_REPOSITORY


@pytest.mark.parametrize("given", [{"ssl_certfile": "cert.pem"}, {"ssl_keyfile": "key.pem"}])
def test_tls_needs_a_certificate_and_its_key(given: dict[str, str]) -> None:
    with pytest.raises(ValidationError, match="both ssl_certfile and ssl_keyfile"):
        Settings(**given)  # type: ignore[arg-type]


def test_tls_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_SSL_CERTFILE", "/etc/tls/cert.pem")
    monkeypatch.setenv("TTS_SSL_KEYFILE", "/etc/tls/key.pem")
    settings = Settings()
    assert (str(settings.ssl_certfile), str(settings.ssl_keyfile)) == ("/etc/tls/cert.pem", "/etc/tls/key.pem")
