"""Model discovery from Triton configs, aliases and default choice."""

from __future__ import annotations

import pytest

from tts_gateway.gateway.errors import NotFoundError
from tts_gateway.gateway.triton.client import TritonModelConfig
from tts_gateway.gateway.triton.model_catalog import ModelCatalog


def _config(name: str, *, decoupled: bool = False, contract: bool = True, **params: str) -> TritonModelConfig:
    parameters = {"sample_rate": "24000", **params}
    if contract:
        parameters["tts_contract"] = "1"
    return TritonModelConfig(name, frozenset({"target_text", "speed"}), decoupled, parameters)


CONFIGS = [
    _config("piper", builtin_voices="joe", sample_rate="22050", supports_speed="true"),
    _config("piper_stream", decoupled=True, builtin_voices="joe", sample_rate="22050"),
    _config("cosyvoice2", supports_cloning="true"),
    _config("cosyvoice2_stream", decoupled=True, supports_cloning="true"),
    _config("audio_tokenizer", contract=False),
    _config("streamonly_stream", decoupled=True),
]


def test_twins_are_paired_and_helpers_ignored() -> None:
    catalog = ModelCatalog.from_triton(CONFIGS)
    assert set(catalog.models) == {"piper", "cosyvoice2", "streamonly"}
    piper = catalog.models["piper"]
    assert (piper.offline_model, piper.stream_model) == ("piper", "piper_stream")
    assert piper.sample_rate == 22_050 and not piper.supports_cloning
    # Only the offline variant declares native speed: the gateway time-stretches streams.
    assert piper.speed_variants == frozenset({"piper"})
    assert piper.default_voice == "joe"
    only = catalog.models["streamonly"]
    assert (only.offline_model, only.stream_model) == (None, "streamonly_stream")


def test_default_prefers_cosyvoice2_and_openai_names_follow_it() -> None:
    catalog = ModelCatalog.from_triton(CONFIGS, openai_names=("tts-1", "tts-1-hd"))
    assert catalog.resolve("tts-1").id == "cosyvoice2"
    assert catalog.resolve("piper").id == "piper"


def test_configured_default_and_aliases() -> None:
    catalog = ModelCatalog.from_triton(
        CONFIGS, default_model="piper", aliases={"fast": "piper", "ghost": "absent"}, openai_names=("tts-1",)
    )
    assert catalog.resolve("tts-1").id == "piper"
    assert catalog.resolve("fast").id == "piper"
    assert "ghost" not in catalog.aliases


def test_unknown_model_is_not_found_with_param() -> None:
    catalog = ModelCatalog.from_triton(CONFIGS)
    with pytest.raises(NotFoundError) as info:
        catalog.resolve("../../v2/repository")
    assert info.value.param == "model"
    assert info.value.code == "model_not_found"


def test_backend_mode_falls_back_to_the_deployed_variant() -> None:
    catalog = ModelCatalog.from_triton(CONFIGS)
    assert catalog.require_streaming_or_offline(catalog.models["piper"], "offline") == "piper"
    assert catalog.require_streaming_or_offline(catalog.models["piper"], "stream") == "piper_stream"
    assert catalog.require_streaming_or_offline(catalog.models["streamonly"], "offline") == "streamonly_stream"


def test_a_model_with_broken_capabilities_is_left_out() -> None:
    broken = TritonModelConfig("broken", frozenset({"target_text"}), False, {"tts_contract": "1"})
    odd = _config("odd", supports_cloning="perhaps")
    catalog = ModelCatalog.from_triton([*CONFIGS, broken, odd])
    assert "broken" not in catalog.models and "odd" not in catalog.models
    assert "piper" in catalog.models


def test_a_text_streaming_deployment_belongs_to_its_model() -> None:
    bistream = _config("cosyvoice2_bistream", decoupled=True, supports_cloning="true", text_streaming="true")
    catalog = ModelCatalog.from_triton([*CONFIGS, bistream])
    assert set(catalog.models) == {"piper", "cosyvoice2", "streamonly"}
    assert catalog.models["cosyvoice2"].text_stream_model == "cosyvoice2_bistream"
    assert catalog.models["cosyvoice2"].stream_model == "cosyvoice2_stream"
    assert catalog.models["piper"].text_stream_model is None
