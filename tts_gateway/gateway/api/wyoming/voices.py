"""The gateway's voices as Wyoming sees them: the ``info`` answer, and which voice a request means.

The voices are those ``GET /v1/audio/voices`` lists (every voice some ready model can speak,
uploaded ones included), read afresh for every ``describe`` and every request, so a voice uploaded
or a model that comes up is offered without a restart. Each is one Wyoming voice named by its id;
the gateway's models have no voices with several speakers (every speaker is a voice of its own),
so no voice lists ``speakers``, and a ``speaker`` a client sends is ignored, as ``wyoming-piper``
ignores it for a voice with one speaker.

A voice one model owns is spoken by that model; a reference voice (shipped or uploaded) by the
default model when it clones, else by the first model that does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Final

from wyoming.info import Attribution, Info, TtsProgram, TtsVoice
from wyoming.tts import SynthesizeVoice

from tts_gateway.gateway.errors import InvalidRequestError
from tts_gateway.gateway.speech.audio_encoding import OUTPUT_SAMPLE_RATE
from tts_gateway.gateway.speech.text_stream.synthesis import VoiceChoice
from tts_gateway.gateway.speech.voice_registry import VoiceRegistry
from tts_gateway.gateway.triton.live_catalog import LiveCatalog
from tts_gateway.gateway.triton.model_catalog import ModelCatalog

PROGRAM_NAME: Final = "tts-gateway"


def _package_version() -> str | None:
    # A source tree on the path without an install (as GPU benchmarks carry it) has no metadata;
    # Wyoming's version field is optional, so that is no reason to refuse to start.
    try:
        return version("tts-gateway")
    except PackageNotFoundError:
        return None


_VERSION: Final = _package_version()
_KINDS = {"builtin": "", "reference": "reference voice, ", "uploaded": "uploaded voice, "}


@dataclass(frozen=True)
class WyomingVoice:
    name: str
    model: str
    """The model that speaks it."""
    languages: tuple[str, ...]
    description: str
    attribution: str


def list_voices(catalog: ModelCatalog, registry: VoiceRegistry) -> list[WyomingVoice]:
    """Every voice some ready model can speak, in the order ``/v1/audio/voices`` lists them."""
    voices: list[WyomingVoice] = []
    for info in registry.describe(catalog):
        owners = info.models
        model_id = catalog.default.id if catalog.default is not None and catalog.default.id in owners else owners[0]
        model = catalog.models[model_id]
        voices.append(
            WyomingVoice(
                name=info.id,
                model=model.id,
                # Home Assistant offers a voice only for a language it lists.
                languages=model.languages or ("en",),
                description=f"{info.id} ({_KINDS.get(info.type, '')}{model.id})",
                attribution=model.description or model.id,
            )
        )
    return voices


def describe(voices: Sequence[WyomingVoice]) -> Info:
    """The ``info`` event's content: one text-to-speech program with every voice, installed."""
    return Info(
        tts=[
            TtsProgram(
                name=PROGRAM_NAME,
                description="OpenAI-compatible text-to-speech gateway",
                attribution=Attribution(name=PROGRAM_NAME, url=""),
                installed=True,
                version=_VERSION,
                voices=[
                    TtsVoice(
                        name=voice.name,
                        description=voice.description,
                        attribution=Attribution(name=voice.attribution, url=""),
                        installed=True,
                        version=_VERSION,
                        languages=list(voice.languages),
                    )
                    for voice in voices
                ],
                supports_synthesize_streaming=True,
            )
        ]
    )


def choose(requested: SynthesizeVoice | None, voices: Sequence[WyomingVoice], catalog: ModelCatalog) -> VoiceChoice:
    """The voice and model a request asks for: by name, else the first voice of its language, else the
    default model's own voice (or the first listed).

    A name not listed (an alias such as ``alloy``, or a voice that does not exist) goes to the default
    model as it is: planning it accepts the alias or reports the unknown voice, as for a speech request.
    """
    if catalog.default is None:
        raise InvalidRequestError("no speech model is ready", param="voice")
    if requested is not None and requested.name:
        for voice in voices:
            if voice.name == requested.name:
                return VoiceChoice(voice.name, voice.model)
        return VoiceChoice(requested.name, catalog.default.id)
    if requested is not None and requested.language:
        for voice in voices:
            if any(_same_language(requested.language, language) for language in voice.languages):
                return VoiceChoice(voice.name, voice.model)
        raise InvalidRequestError(f"no voice speaks language {requested.language!r}", param="voice")
    default_voice = catalog.default.default_voice
    if default_voice is not None:
        return VoiceChoice(default_voice, catalog.default.id)
    if not voices:
        raise InvalidRequestError("no voice is available", param="voice")
    return VoiceChoice(voices[0].name, voices[0].model)


def _same_language(requested: str, offered: str) -> bool:
    """``en_US`` and ``en-US`` are one language; ``en`` covers every ``en-*``."""
    wanted, have = requested.replace("_", "-").lower(), offered.replace("_", "-").lower()
    return wanted == have or wanted.split("-")[0] == have


class GatewayVoices:
    """The voices of the running gateway: its live catalog and its voice registry. The voice chosen is
    checked as the request's synthesis is planned, so it is refused exactly when a speech request would be."""

    def __init__(self, catalog: LiveCatalog, registry: VoiceRegistry) -> None:
        self._catalog = catalog
        self._registry = registry

    def info(self) -> Info:
        """Every voice while some model is ready; none while no Triton server is ready."""
        if not self._catalog.ready:
            return describe([])
        return describe(list_voices(self._catalog.current, self._registry))

    async def choose(self, requested: SynthesizeVoice | None) -> VoiceChoice:
        """The voice ``requested`` means; raises :class:`GatewayError` while no model is served."""
        catalog = self._catalog.current
        return choose(requested, list_voices(catalog, self._registry), catalog)

    def sample_rate(self, voice: VoiceChoice) -> int:
        """The rate of the model that speaks ``voice``; the speech service's own if the model has gone."""
        model = self._catalog.current.models.get(voice.model)
        return OUTPUT_SAMPLE_RATE if model is None else model.sample_rate
