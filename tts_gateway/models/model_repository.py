"""Render ``triton_repo/`` templates into a Triton model repository for one profile.

``triton_repo/`` holds one source directory per model (``config.pbtxt.tmpl`` with
``${var}`` placeholders plus ``1/model.py``) and ``profiles/*.toml``, which list for
each profile the models to deploy, under which names, with which values. A source
directory may be deployed several times (``piper`` as ``piper`` and ``piper_stream``).

A profile file holds two kinds of tables, so that each value is written once:

``[defaults.SOURCE]``
    ``values``: what every deployment of the source takes unless its profile says otherwise;
    ``stream``: the values in which the source's streaming twin differs from the offline model
    (``decoupled = true`` at least). A source's defaults are defined in one file only.
``[profiles.NAME]``
    ``description``, ``cuda_mps``, ``gpu``, ``extends = "PARENT"`` (start from the parent's models,
    description, ``cuda_mps`` and ``gpu``), ``without = [MODEL, ...]`` (drop some of the parent's models)
    and ``[[profiles.NAME.models]]`` entries: ``source``, ``name`` (default: the source),
    ``values`` and ``stream``. An entry naming one of the parent's models only changes its values.
    ``stream = true`` also deploys the model's twin ``NAME_stream`` right after it, with the
    model's values plus the source's stream defaults; a table instead of ``true`` adds values of
    this profile's twin alone; ``false`` drops an inherited twin.

The twin's values are derived, never copied: source defaults, then the profile's values for
the model (parents first), then the source's stream defaults, then the profile's twin values.
Unknown keys, a parent that does not exist, a cycle and a source without a template are
errors that name the file and the profile.

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
from pathlib import Path, PurePosixPath
from typing import Any

from tts_gateway.models.contract import stream_model_name
from tts_gateway.paths import invocation_path

TEMPLATE_NAME = "config.pbtxt.tmpl"
PROFILES_DIR = "profiles"
# Profiles name model paths under this root; a models root given at render time replaces it.
PROFILE_ROOT = PurePosixPath("/models")
ROOTED_KEYS = ("model_dir", "llm_dir", "engine_dir")
# Where an orchestrator finds its LLM servers (empty: the LLM is a model of the same Triton server).
LLM_URLS_KEY = "llm_urls"

_FILE_KEYS = frozenset({"defaults", "profiles"})
_DEFAULTS_KEYS = frozenset({"values", "stream"})
_PROFILE_KEYS = frozenset({"description", "cuda_mps", "gpu", "extends", "without", "models"})
_ENTRY_KEYS = frozenset({"source", "name", "values", "stream"})


class TemplateError(ValueError):
    """A template and the values offered for it do not match, or a profile file is malformed."""


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
    # Whether its models run on a GPU: the embedded server then starts once per GPU (TTS_EMBEDDED_GPUS).
    gpu: bool = False


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
    """Read every ``profiles/*.toml`` of the source repository and resolve each profile fully."""
    defaults: dict[str, _Defaults] = {}
    declared: dict[str, _Declared] = {}
    for path in sorted((source_root / PROFILES_DIR).glob("*.toml")):
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
        where = path.name
        _check_keys(raw, _FILE_KEYS, where)
        for source, body in _table(raw, "defaults", where).items():
            at = f"{where}: defaults.{source}"
            if source in defaults:
                raise TemplateError(f"{at}: defined again (first in {defaults[source].where})")
            _check_source(source_root, source, at)
            body = _as_table(body, at)
            _check_keys(body, _DEFAULTS_KEYS, at)
            defaults[source] = _Defaults(
                where=where, values=_table(body, "values", at), stream=_table(body, "stream", at)
            )
        for name, body in _table(raw, "profiles", where).items():
            if name in declared:
                raise TemplateError(f"{where}: profile {name!r} is defined again (first in {declared[name].where})")
            declared[name] = _parse_profile(source_root, name, _as_table(body, f"{where}: profile {name!r}"), where)
    resolved: dict[str, _Resolved] = {}
    for name in declared:
        _resolve(name, declared, resolved, ())
    return {name: _deploy(name, resolved[name], defaults) for name in declared}


def load_profile(source_root: Path, name: str) -> Profile:
    """One profile of the source repository, resolved; an unknown name is an error listing the known ones."""
    profiles = load_profiles(source_root)
    if name not in profiles:
        raise TemplateError(f"unknown profile {name!r}; known: {sorted(profiles)}")
    return profiles[name]


@dataclass(frozen=True)
class _Defaults:
    where: str
    values: dict[str, Any]
    stream: dict[str, Any]


@dataclass(frozen=True)
class _Entry:
    """A model as one profile declares it, before defaults and inheritance."""

    source: str | None
    name: str
    values: dict[str, Any]
    # Not given (None), no twin (False), a twin (True) or a twin with these values of its own.
    stream: bool | dict[str, Any] | None


@dataclass(frozen=True)
class _Declared:
    where: str
    description: str | None
    cuda_mps: bool | None
    gpu: bool | None
    extends: str | None
    without: tuple[str, ...]
    entries: tuple[_Entry, ...]


@dataclass(frozen=True)
class _Model:
    source: str
    values: dict[str, Any]
    stream: dict[str, Any] | None


@dataclass(frozen=True)
class _Resolved:
    description: str
    cuda_mps: bool
    gpu: bool
    models: dict[str, _Model]


def _parse_profile(source_root: Path, name: str, body: dict[str, Any], where: str) -> _Declared:
    at = f"{where}: profile {name!r}"
    _check_keys(body, _PROFILE_KEYS, at)
    description = body.get("description")
    cuda_mps = body.get("cuda_mps")
    gpu = body.get("gpu")
    extends = body.get("extends")
    without = body.get("without", [])
    if description is not None and not isinstance(description, str):
        raise TemplateError(f"{at}: 'description' must be a string")
    if cuda_mps is not None and not isinstance(cuda_mps, bool):
        raise TemplateError(f"{at}: 'cuda_mps' must be true or false")
    if gpu is not None and not isinstance(gpu, bool):
        raise TemplateError(f"{at}: 'gpu' must be true or false")
    if extends is not None and not isinstance(extends, str):
        raise TemplateError(f"{at}: 'extends' must be a profile name")
    if not isinstance(without, list) or not all(isinstance(item, str) for item in without):
        raise TemplateError(f"{at}: 'without' must be an array of model names")
    if without and extends is None:
        raise TemplateError(f"{at}: 'without' needs 'extends'")
    raw_entries = body.get("models", [])
    if not isinstance(raw_entries, list):
        raise TemplateError(f"{at}: 'models' must be an array of tables")
    entries = []
    for index, raw in enumerate(raw_entries):
        entry_at = f"{at}, models[{index}]"
        raw = _as_table(raw, entry_at)
        _check_keys(raw, _ENTRY_KEYS, entry_at)
        source = raw.get("source")
        if source is not None:
            if not isinstance(source, str):
                raise TemplateError(f"{entry_at}: 'source' must be a string")
            _check_source(source_root, source, entry_at)
        model_name = raw.get("name", source)
        if not isinstance(model_name, str):
            raise TemplateError(f"{entry_at}: needs 'source' or 'name'")
        stream = raw.get("stream")
        if stream is not None and not isinstance(stream, (bool, dict)):
            raise TemplateError(f"{entry_at}: 'stream' must be true, false or a table of values")
        entries.append(_Entry(source, model_name, _table(raw, "values", entry_at), stream))
    return _Declared(where, description, cuda_mps, gpu, extends, tuple(without), tuple(entries))


def _resolve(
    name: str, declared: dict[str, _Declared], resolved: dict[str, _Resolved], chain: tuple[str, ...]
) -> _Resolved:
    """The profile's models with its parents' entries merged in, parents first (defaults not applied yet)."""
    if name in resolved:
        return resolved[name]
    own = declared[name]
    at = f"{own.where}: profile {name!r}"
    if own.extends is None:
        base = _Resolved("", False, False, {})
    elif own.extends not in declared:
        raise TemplateError(f"{at} extends unknown profile {own.extends!r}; known: {sorted(declared)}")
    elif own.extends in chain or own.extends == name:
        raise TemplateError(f"{at} extends itself through {' -> '.join((*chain, name, own.extends))}")
    else:
        base = _resolve(own.extends, declared, resolved, (*chain, name))
    models = dict(base.models)
    for dropped in own.without:
        if models.pop(dropped, None) is None:
            raise TemplateError(f"{at}: 'without' names {dropped!r}, not a model of {own.extends!r}")
    for entry in own.entries:
        models[entry.name] = _merge(models.get(entry.name), entry, f"{at}, model {entry.name!r}")
    result = _Resolved(
        description=base.description if own.description is None else own.description,
        cuda_mps=base.cuda_mps if own.cuda_mps is None else own.cuda_mps,
        gpu=base.gpu if own.gpu is None else own.gpu,
        models=models,
    )
    resolved[name] = result
    return result


def _merge(inherited: _Model | None, entry: _Entry, at: str) -> _Model:
    if inherited is None:
        if entry.source is None:
            raise TemplateError(f"{at}: needs 'source' (no parent deploys a model of that name)")
        stream = entry.stream if isinstance(entry.stream, dict) else ({} if entry.stream else None)
        return _Model(entry.source, dict(entry.values), stream)
    if entry.source is not None and entry.source != inherited.source:
        raise TemplateError(f"{at}: source {entry.source!r}, but the parent deploys it from {inherited.source!r}")
    stream = inherited.stream
    if entry.stream is False:
        stream = None
    elif entry.stream is True:
        stream = stream or {}
    elif isinstance(entry.stream, dict):
        stream = {**(stream or {}), **entry.stream}
    return _Model(inherited.source, {**inherited.values, **entry.values}, stream)


def _deploy(name: str, profile: _Resolved, defaults: Mapping[str, _Defaults]) -> Profile:
    """Apply the source defaults and derive the streaming twins."""
    deployments: list[ModelDeployment] = []
    for model_name, model in profile.models.items():
        source = defaults.get(model.source, _Defaults("", {}, {}))
        values = {**source.values, **model.values}
        deployments.append(ModelDeployment(model.source, model_name, _stringified(values)))
        if model.stream is not None:
            twin = stream_model_name(model_name)
            if twin in profile.models:
                raise TemplateError(f"profile {name!r}: {twin!r} is both declared and {model_name!r}'s stream twin")
            stream_values = {**values, **source.stream, **model.stream}
            deployments.append(ModelDeployment(model.source, twin, _stringified(stream_values)))
    return Profile(
        name=name,
        description=profile.description,
        models=tuple(deployments),
        cuda_mps=profile.cuda_mps,
        gpu=profile.gpu,
    )


def _check_keys(body: Mapping[str, Any], allowed: frozenset[str], at: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise TemplateError(f"{at}: unknown keys {unknown}; allowed: {sorted(allowed)}")


def _check_source(source_root: Path, source: str, at: str) -> None:
    if not (source_root / source / TEMPLATE_NAME).is_file():
        raise TemplateError(f"{at}: no model source {source!r} (no {source}/{TEMPLATE_NAME})")


def _table(body: Mapping[str, Any], key: str, at: str) -> dict[str, Any]:
    return _as_table(body.get(key, {}), f"{at}: {key!r}")


def _as_table(value: object, at: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TemplateError(f"{at} must be a table")
    return value


def _stringified(values: Mapping[str, object]) -> dict[str, str]:
    return {key: _stringify(value) for key, value in values.items()}


def _stringify(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_overrides(items: list[str]) -> dict[str, dict[str, str]]:
    """Parse ``MODEL.KEY=VALUE`` command-line overrides into ``{model: {key: value}}``.

    The values of the path keys (``model_dir`` ...) are read from the directory the command started in.
    """
    overrides: dict[str, dict[str, str]] = {}
    for item in items:
        target, sep, value = item.partition("=")
        model, dot, key = target.partition(".")
        if not sep or not dot or not model or not key:
            raise TemplateError(f"override {item!r} is not of the form MODEL.KEY=VALUE")
        if key in ROOTED_KEYS and value:
            value = str(invocation_path(value))
        overrides.setdefault(model, {})[key] = value
    return overrides


def deployment_overrides(
    profile: Profile,
    *,
    models_root: Path | None = None,
    llm_urls: str | None = None,
    explicit: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, dict[str, str]]:
    """Overrides that fit ``profile`` to this machine, for :func:`render_repository`.

    ``models_root`` (absolute, as :func:`invocation_path` reads the user's) moves
    every ``/models/...`` path value under it; ``llm_urls`` replaces the
    LLM servers of every model that has some (both orchestrators); ``explicit`` overrides
    (``MODEL.KEY=VALUE``) win over both.
    """
    result: dict[str, dict[str, str]] = {}
    if models_root is not None:
        for model in profile.models:
            for key in ROOTED_KEYS:
                value = model.values.get(key)
                if value is not None and PurePosixPath(value).is_relative_to(PROFILE_ROOT):
                    relative = PurePosixPath(value).relative_to(PROFILE_ROOT)
                    result.setdefault(model.name, {})[key] = str(models_root / relative)
    if llm_urls is not None:
        takers = [model.name for model in profile.models if LLM_URLS_KEY in model.values]
        if not takers:
            raise TemplateError(f"profile {profile.name!r} has no model that talks to an LLM server ({LLM_URLS_KEY})")
        for name in takers:
            result.setdefault(name, {})[LLM_URLS_KEY] = llm_urls
    for model_name, values in (explicit or {}).items():
        result.setdefault(model_name, {}).update(values)
    return result


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
    profile = load_profile(source_root, profile_name)
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
