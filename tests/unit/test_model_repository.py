"""Strict template filling and profile rendering of triton_repo/."""

from __future__ import annotations

import textwrap
from pathlib import Path, PurePosixPath

import pytest

from tests.fixtures.scripted_triton import REPOSITORY as SCRIPTED_REPOSITORY
from tts_gateway.models.contract import STREAM_SUFFIX, stream_model_name
from tts_gateway.models.model_repository import (
    PROFILE_ROOT,
    ROOTED_KEYS,
    TemplateError,
    deployment_overrides,
    fill_template,
    load_profile,
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


def _source_root(tmp_path: Path, profiles: str) -> Path:
    """A template repository with one source ``tone`` and the given profile file."""
    (tmp_path / "tone").mkdir(parents=True)
    (tmp_path / "tone" / "config.pbtxt.tmpl").write_text("d: ${decoupled}\nrate: ${rate}\nwho: ${who}\n")
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "p.toml").write_text(textwrap.dedent(profiles))
    return tmp_path


RESOLVED = """
    [defaults.tone]
    values = { decoupled = false, rate = 16000, who = "default" }
    stream = { decoupled = true, who = "stream default" }

    [profiles.base]
    description = "base"
    cuda_mps = true
    [[profiles.base.models]]
    source = "tone"
    stream = true
    [[profiles.base.models]]
    source = "tone"
    name = "loud"
    values = { rate = 48000 }

    [profiles.child]
    extends = "base"
    [[profiles.child.models]]
    name = "tone"
    values = { rate = 22050, who = "child" }
    stream = { rate = 8000 }
    [[profiles.child.models]]
    source = "tone"
    name = "quiet"

    [profiles.grandchild]
    description = "grandchild"
    extends = "child"
    cuda_mps = false
    without = ["loud"]
    [[profiles.grandchild.models]]
    name = "quiet"
    stream = true
"""


def test_profiles_resolve_defaults_overrides_inheritance_and_stream_twins(tmp_path: Path) -> None:
    profiles = load_profiles(_source_root(tmp_path, RESOLVED))

    def deployed(name: str) -> dict[str, dict[str, str]]:
        return {m.name: dict(m.values) for m in profiles[name].models}

    # Defaults fill what a profile leaves out; a profile's value wins; the twin follows its model
    # and differs in the source's stream defaults only.
    assert deployed("base") == {
        "tone": {"decoupled": "false", "rate": "16000", "who": "default"},
        "tone_stream": {"decoupled": "true", "rate": "16000", "who": "stream default"},
        "loud": {"decoupled": "false", "rate": "48000", "who": "default"},
    }
    # A child changes only what it names, keeps the parent's order and appends its own models; the
    # twin is derived from the child's values, then the profile's own twin values apply.
    assert deployed("child") == {
        "tone": {"decoupled": "false", "rate": "22050", "who": "child"},
        "tone_stream": {"decoupled": "true", "rate": "8000", "who": "stream default"},
        "loud": {"decoupled": "false", "rate": "48000", "who": "default"},
        "quiet": {"decoupled": "false", "rate": "16000", "who": "default"},
    }
    assert [m.name for m in profiles["child"].models] == ["tone", "tone_stream", "loud", "quiet"]
    assert (profiles["child"].description, profiles["child"].cuda_mps) == ("base", True)
    # Two levels deep: a model dropped, a twin added to an inherited model, settings overridden.
    assert list(deployed("grandchild")) == ["tone", "tone_stream", "quiet", "quiet_stream"]
    assert deployed("grandchild")["tone_stream"] == deployed("child")["tone_stream"]
    assert deployed("grandchild")["quiet_stream"]["decoupled"] == "true"
    assert (profiles["grandchild"].description, profiles["grandchild"].cuda_mps) == ("grandchild", False)
    assert {m.source for m in profiles["grandchild"].models} == {"tone"}


@pytest.mark.parametrize(
    ("profiles", "message"),
    [
        ("[profiles.a]\ncolour = 1\n", r"p.toml: profile 'a': unknown keys \['colour'\]"),
        ("[profiles.a]\nextends = 'nope'\n", r"p.toml: profile 'a' extends unknown profile 'nope'"),
        (
            "[profiles.a]\nextends = 'b'\n[profiles.b]\nextends = 'a'\n",
            r"p.toml: profile '(a|b)' extends itself through",
        ),
        (
            "[profiles.a]\n[profiles.b]\nextends = 'a'\nwithout = ['tone']\n",
            r"p.toml: profile 'b': 'without' names 'tone', not a model of 'a'",
        ),
        ("[[profiles.a.models]]\nsource = 'tone'\ncolour = 1\n", r"profile 'a', models\[0\]: unknown keys"),
        ("[[profiles.a.models]]\nsource = 'drum'\n", r"profile 'a', models\[0\]: no model source 'drum'"),
        ("[[profiles.a.models]]\nname = 'tone'\n", r"profile 'a', model 'tone': needs 'source'"),
        ("[defaults.tone]\nvalue = {}\n", r"p.toml: defaults.tone: unknown keys \['value'\]"),
        ("[cosyvoice]\n", r"p.toml: unknown keys \['cosyvoice'\]"),
        (
            "[[profiles.a.models]]\nsource = 'tone'\nstream = true\n"
            "[[profiles.a.models]]\nsource = 'tone'\nname = 'tone_stream'\n",
            r"'tone_stream' is both declared and 'tone''s stream twin",
        ),
    ],
)
def test_malformed_profile_files_fail_saying_where(tmp_path: Path, profiles: str, message: str) -> None:
    with pytest.raises(TemplateError, match=message):
        load_profiles(_source_root(tmp_path, profiles))


@pytest.mark.parametrize("source", [REPO, SCRIPTED_REPOSITORY], ids=["shipped", "fixtures"])
def test_every_shipped_profile_renders_with_its_twins_derived(tmp_path: Path, source: Path) -> None:
    profiles = load_profiles(source)
    for name, profile in profiles.items():
        rendered = render_repository(source, name, tmp_path / name)
        assert rendered == [m.name for m in profile.models]
        assert sorted(path.name for path in (tmp_path / name).iterdir()) == sorted(rendered)
        models = {m.name: m for m in profile.models}
        for model in profile.models:
            config = (tmp_path / name / model.name / "config.pbtxt").read_text()
            assert "${" not in config, (name, model.name)
            for key in ROOTED_KEYS:
                # `tts-models --models-root` and TTS_MODELS_ROOT move these paths: they must lie under it.
                if key in model.values:
                    assert PurePosixPath(model.values[key]).is_relative_to(PROFILE_ROOT), (name, model.name, key)
            if not model.name.endswith(STREAM_SUFFIX):
                continue
            offline = models[model.name.removesuffix(STREAM_SUFFIX)]
            assert stream_model_name(offline.name) == model.name
            assert (offline.source, offline.values["decoupled"], model.values["decoupled"]) == (
                model.source,
                "false",
                "true",
            ), (name, model.name)
            assert set(offline.values) == set(model.values), (name, model.name)


def test_deployment_overrides_move_model_paths_and_point_orchestrators_at_llm_servers(tmp_path: Path) -> None:
    profile = load_profile(REPO, "cosyvoice2-cpu-llm-server")
    models = tmp_path / "models"
    overrides = deployment_overrides(
        profile, models_root=models, llm_urls="http://a:1/v1", explicit={"cosyvoice2": {"llm_urls": "http://b:2/v1"}}
    )
    assert overrides["token2wav"]["model_dir"] == str(models / "CosyVoice2-0.5B")
    assert overrides["cosyvoice2_stream"]["llm_dir"] == str(models / "cosyvoice2_llm")
    # Both orchestrators take the LLM servers; an explicit MODEL.KEY=VALUE wins.
    assert overrides["cosyvoice2_stream"]["llm_urls"] == "http://a:1/v1"
    assert overrides["cosyvoice2"]["llm_urls"] == "http://b:2/v1"
    render_repository(REPO, profile.name, tmp_path / "repo", overrides)
    assert 'string_value: "http://a:1/v1"' in (tmp_path / "repo" / "cosyvoice2_stream" / "config.pbtxt").read_text()
    assert deployment_overrides(profile) == {}
    with pytest.raises(TemplateError, match="'cpu' has no model that talks to an LLM server"):
        deployment_overrides(load_profile(REPO, "cpu"), llm_urls="http://a:1/v1")
    with pytest.raises(TemplateError, match="unknown profile 'nope'"):
        load_profile(REPO, "nope")
