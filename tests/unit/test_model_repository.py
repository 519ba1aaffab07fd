"""Strict template filling and profile rendering of triton_repo/."""

from __future__ import annotations

from pathlib import Path

import pytest

from tts_gateway.models.model_repository import (
    TemplateError,
    fill_template,
    load_profiles,
    parse_overrides,
    render_repository,
)
from tts_gateway.paths import TRITON_REPOSITORY

REPO = TRITON_REPOSITORY


def test_fill_substitutes_every_placeholder() -> None:
    assert fill_template("a: ${x}\nb: ${y}", {"x": "1", "y": "two"}) == "a: 1\nb: two"


@pytest.mark.parametrize(
    ("values", "fragment"),
    [({"x": "1"}, "missing keys ['y']"), ({"x": "1", "y": "2", "z": "3"}, "unknown keys ['z']")],
)
def test_fill_rejects_missing_and_unknown_keys(values: dict[str, str], fragment: str) -> None:
    with pytest.raises(TemplateError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        fill_template("${x} ${y}", values)


def test_overrides_parse_and_reject_bad_syntax() -> None:
    assert parse_overrides(["piper.instance_count=2", "piper.voice_model=/v/a=b.onnx"]) == {
        "piper": {"instance_count": "2", "voice_model": "/v/a=b.onnx"}
    }
    with pytest.raises(TemplateError):
        parse_overrides(["instance_count=2"])


def test_every_profile_renders(tmp_path: Path) -> None:
    profiles = load_profiles(REPO)
    assert "cpu" in profiles
    for name, profile in profiles.items():
        dest = tmp_path / name
        rendered = render_repository(REPO, name, dest)
        assert rendered == [m.name for m in profile.models]
        for model in rendered:
            config = (dest / model / "config.pbtxt").read_text()
            assert "${" not in config
            assert not (dest / model / "config.pbtxt.tmpl").exists()


def test_render_rejects_unknown_override_and_keeps_old_repository(tmp_path: Path) -> None:
    dest = tmp_path / "repo"
    render_repository(REPO, "cpu", dest)
    with pytest.raises(TemplateError, match="not in profile"):
        render_repository(REPO, "cpu", dest, {"nosuchmodel": {"x": "1"}})
    with pytest.raises(TemplateError, match="unknown keys"):
        render_repository(REPO, "cpu", dest, {"piper": {"colour": "red"}})
    assert (dest / "piper" / "config.pbtxt").exists()
    assert not (tmp_path / "repo.rendering").exists()


def test_render_deploys_only_the_models_asked_for(tmp_path: Path) -> None:
    dest = tmp_path / "repo"
    names = render_repository(REPO, "bench", dest, only={"bench_fixture", "bench_fixture_stream"})
    assert names == ["bench_fixture", "bench_fixture_stream"]
    assert sorted(p.name for p in dest.iterdir()) == names
    with pytest.raises(TemplateError, match=r"only name models not in profile 'bench': \['kokoro'\]"):
        render_repository(REPO, "bench", dest, only={"piper", "kokoro"})


def test_benchmark_fixture_is_deployed_by_the_bench_profile_only() -> None:
    for name, profile in load_profiles(REPO).items():
        fixtures = sorted(m.name for m in profile.models if m.source == "bench_fixture")
        assert fixtures == (["bench_fixture", "bench_fixture_stream"] if name == "bench" else []), name


def test_only_the_profile_measured_to_gain_by_cuda_mps_asks_for_it(tmp_path: Path) -> None:
    assert {name for name, profile in load_profiles(REPO).items() if profile.cuda_mps} == {"gpu-torch"}
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "bad.toml").write_text('[profiles.bad]\ncuda_mps = "yes"\nmodels = []\n')
    with pytest.raises(TemplateError, match="'cuda_mps' must be true or false"):
        load_profiles(tmp_path)
