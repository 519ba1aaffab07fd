"""Render ``triton_repo/`` templates into a Triton model repository for one profile.

``triton_repo/`` holds one source directory per model (``config.pbtxt.tmpl`` with
``${var}`` placeholders plus ``1/model.py``) and ``profiles/*.toml``, which list for
each profile the models to deploy, under which names, with which values. A source
directory may be deployed several times (``piper`` as ``piper`` and ``piper_stream``).

Filling is strict: a placeholder without a value and a value without a placeholder
are both errors, so a typo in a profile or an override fails at render time instead
of producing a config Triton silently reads differently.
"""

from __future__ import annotations

import shutil
import string
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATE_NAME = "config.pbtxt.tmpl"
PROFILES_DIR = "profiles"


class TemplateError(ValueError):
    """A template and the values offered for it do not match."""


@dataclass(frozen=True)
class ModelDeployment:
    """One model directory of a rendered repository."""

    source: str
    name: str
    values: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    models: tuple[ModelDeployment, ...]
    # Whether its server runs under a CUDA MPS daemon where the operator leaves that to it ("auto").
    cuda_mps: bool = False


def fill_template(template: str, values: Mapping[str, str]) -> str:
    """Substitute ``${var}`` placeholders, rejecting missing and unknown keys."""
    tmpl = string.Template(template)
    if not tmpl.is_valid():
        raise TemplateError("template has a malformed placeholder")
    wanted = set(tmpl.get_identifiers())
    offered = set(values)
    missing = sorted(wanted - offered)
    unknown = sorted(offered - wanted)
    if missing or unknown:
        raise TemplateError(f"missing keys {missing}, unknown keys {unknown}")
    return tmpl.substitute(values)


def load_profiles(source_root: Path) -> dict[str, Profile]:
    """Read every ``profiles/*.toml`` of the source repository; a profile is defined once."""
    profiles: dict[str, Profile] = {}
    for path in sorted((source_root / PROFILES_DIR).glob("*.toml")):
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
        for name, body in raw.get("profiles", {}).items():
            if name in profiles:
                raise TemplateError(f"profile {name!r} is defined twice (again in {path.name})")
            profiles[name] = _parse_profile(name, body)
    return profiles


def _parse_profile(name: str, body: dict[str, object]) -> Profile:
    entries = body.get("models", [])
    if not isinstance(entries, list):
        raise TemplateError(f"profile {name!r}: 'models' must be an array of tables")
    models = tuple(
        ModelDeployment(
            source=str(entry["source"]),
            name=str(entry.get("name", entry["source"])),
            values={key: _stringify(val) for key, val in entry.get("values", {}).items()},
        )
        for entry in entries
    )
    cuda_mps = body.get("cuda_mps", False)
    if not isinstance(cuda_mps, bool):
        raise TemplateError(f"profile {name!r}: 'cuda_mps' must be true or false")
    return Profile(name=name, description=str(body.get("description", "")), models=models, cuda_mps=cuda_mps)


def _stringify(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_overrides(items: list[str]) -> dict[str, dict[str, str]]:
    """Parse ``MODEL.KEY=VALUE`` command-line overrides into ``{model: {key: value}}``."""
    overrides: dict[str, dict[str, str]] = {}
    for item in items:
        target, sep, value = item.partition("=")
        model, dot, key = target.partition(".")
        if not sep or not dot or not model or not key:
            raise TemplateError(f"override {item!r} is not of the form MODEL.KEY=VALUE")
        overrides.setdefault(model, {})[key] = value
    return overrides


def render_repository(
    source_root: Path,
    profile_name: str,
    dest: Path,
    overrides: Mapping[str, Mapping[str, str]] | None = None,
    only: Collection[str] | None = None,
) -> list[str]:
    """Render ``profile_name`` from ``source_root`` into ``dest``; return the model names.

    ``dest`` is replaced wholesale, so a rendered repository never mixes profiles.
    ``overrides`` maps a deployed model name to values that replace the profile's.
    ``only`` deploys just those of the profile's models (all when ``None``).
    """
    profiles = load_profiles(source_root)
    if profile_name not in profiles:
        raise TemplateError(f"unknown profile {profile_name!r}; known: {sorted(profiles)}")
    profile = profiles[profile_name]
    overrides = dict(overrides or {})
    names = {m.name for m in profile.models}
    for what, given in (("overrides", overrides), ("only", only or ())):
        unknown_models = sorted(set(given) - names)
        if unknown_models:
            raise TemplateError(f"{what} name models not in profile {profile_name!r}: {unknown_models}")
    models = [m for m in profile.models if only is None or m.name in only]

    staging = dest.with_name(dest.name + ".rendering")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for model in models:
            src = source_root / model.source
            template = (src / TEMPLATE_NAME).read_text(encoding="utf-8")
            values = {**model.values, **overrides.get(model.name, {})}
            try:
                config = fill_template(template, values)
            except TemplateError as exc:
                raise TemplateError(f"model {model.name!r} ({model.source}): {exc}") from exc
            out = staging / model.name
            shutil.copytree(src, out, ignore=shutil.ignore_patterns(TEMPLATE_NAME, "__pycache__"))
            (out / "config.pbtxt").write_text(config, encoding="utf-8")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return [m.name for m in models]
