"""Speech models the Triton servers serve, what each can do, and the names clients use for them.

The catalog is built from Triton's model configs: a model is a speech model when its
config carries ``tts_contract``; its decoupled ``NAME_stream`` twin, if deployed, is
used for streaming, and a ``NAME_bistream`` deployment declaring ``text_streaming`` serves
sessions whose text arrives in pieces (it is no speech model of its own). Clients may name a
model by id or alias; the names are resolved here, so nothing a client sends ever reaches a
Triton URL unchecked.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from tts_gateway.gateway.errors import InvalidRequestError, NotFoundError
from tts_gateway.gateway.triton.client import TritonModelConfig
from tts_gateway.models import contract

logger = logging.getLogger(__name__)

# Preferred default when several speech models are deployed: the best voice first.
_PREFERENCE = ("cosyvoice2", "piper")


@dataclass(frozen=True)
class SpeechModel:
    id: str
    description: str
    sample_rate: int
    supports_cloning: bool
    speed_variants: frozenset[str]
    builtin_voices: tuple[str, ...]
    languages: tuple[str, ...]
    inputs: frozenset[str]
    offline_model: str | None
    stream_model: str | None
    text_stream_model: str | None = None

    @property
    def supports_speed(self) -> bool:
        """Some deployed variant changes tempo itself (the gateway time-stretches for the others)."""
        return bool(self.speed_variants)

    @property
    def supports_streaming(self) -> bool:
        return self.stream_model is not None

    @property
    def default_voice(self) -> str | None:
        return self.builtin_voices[0] if self.builtin_voices else None


def _native_speed(config: TritonModelConfig) -> bool:
    declared = contract.parse_bool(config.parameters.get(contract.PARAM_SUPPORTS_SPEED, "false"))
    return declared and contract.SPEED in config.inputs


def _speech_model(name: str, offline: TritonModelConfig | None, stream: TritonModelConfig | None) -> SpeechModel:
    variants = [c for c in (offline, stream) if c is not None]
    params = variants[0].parameters
    return SpeechModel(
        id=name,
        description=params.get(contract.PARAM_DESCRIPTION, ""),
        sample_rate=int(params[contract.PARAM_SAMPLE_RATE]),
        supports_cloning=contract.parse_bool(params.get(contract.PARAM_SUPPORTS_CLONING, "false")),
        speed_variants=frozenset(c.name for c in variants if _native_speed(c)),
        builtin_voices=contract.parse_list(params.get(contract.PARAM_BUILTIN_VOICES, "")),
        languages=contract.parse_list(params.get(contract.PARAM_LANGUAGES, "")),
        inputs=variants[0].inputs,
        offline_model=offline.name if offline else None,
        stream_model=stream.name if stream else None,
    )


class ModelCatalog:
    def __init__(
        self,
        models: Iterable[SpeechModel],
        *,
        default_model: str | None = None,
        aliases: Mapping[str, str] | None = None,
        openai_names: Iterable[str] = (),
    ) -> None:
        self.models = {m.id: m for m in models}
        self.default = self._pick_default(default_model)
        self._aliases = {name: self.default.id for name in openai_names} if self.default else {}
        for alias, target in (aliases or {}).items():
            if target not in self.models:
                logger.warning("model alias %r points at %r, which is not deployed", alias, target)
                continue
            self._aliases[alias] = target

    @classmethod
    def from_triton(
        cls,
        configs: Iterable[TritonModelConfig],
        *,
        default_model: str | None = None,
        aliases: Mapping[str, str] | None = None,
        openai_names: Iterable[str] = (),
    ) -> ModelCatalog:
        by_name = {
            c.name: c for c in configs if c.parameters.get(contract.PARAM_TTS_CONTRACT) == contract.CONTRACT_VERSION
        }
        text_streams = {
            name.removesuffix(contract.TEXT_STREAM_SUFFIX): by_name.pop(name)
            for name, config in list(by_name.items())
            if contract.parse_bool(config.parameters.get(contract.PARAM_TEXT_STREAMING, "false"))
        }
        models: list[SpeechModel] = []
        for name, config in sorted(by_name.items()):
            base = name.removesuffix(contract.STREAM_SUFFIX) if config.decoupled else name
            if config.decoupled and base != name and base in by_name:
                continue  # listed with its offline twin
            offline = None if config.decoupled else config
            stream = config if config.decoupled else by_name.get(contract.stream_model_name(name))
            try:
                model = _speech_model(base, offline, stream)
                if base in text_streams:
                    model = replace(model, text_stream_model=text_streams[base].name)
                models.append(model)
            except (KeyError, ValueError) as exc:
                logger.error("ignoring speech model %r: its capability parameters are invalid (%s)", base, exc)
        return cls(models, default_model=default_model, aliases=aliases, openai_names=openai_names)

    def _pick_default(self, wanted: str | None) -> SpeechModel | None:
        if wanted is not None:
            if wanted in self.models:
                return self.models[wanted]
            logger.warning("default model %r is not deployed; choosing another", wanted)
        for name in _PREFERENCE:
            if name in self.models:
                return self.models[name]
        return next(iter(self.models.values()), None)

    @property
    def builtin_voices(self) -> list[str]:
        """Every model's own voices."""
        return [v for m in self.models.values() for v in m.builtin_voices]

    @property
    def aliases(self) -> Mapping[str, str]:
        return dict(self._aliases)

    def resolve(self, name: str) -> SpeechModel:
        model = self.models.get(name) or self.models.get(self._aliases.get(name, ""))
        if model is None:
            known = sorted([*self.models, *self._aliases])
            raise NotFoundError(
                f"model {name!r} does not exist; available: {', '.join(known) or 'none'}",
                param="model",
                code="model_not_found",
            )
        return model

    def require_streaming_or_offline(self, model: SpeechModel, mode: str) -> str:
        """The Triton model to call for ``mode`` ("stream" or "offline"), falling back to the other."""
        first, second = (
            (model.stream_model, model.offline_model) if mode == "stream" else (model.offline_model, model.stream_model)
        )
        target = first or second
        if target is None:
            raise InvalidRequestError(f"model {model.id!r} has no deployed variant", param="model")
        return target
