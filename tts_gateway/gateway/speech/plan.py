"""What a speech request asks for, decided before any synthesis.

:meth:`SpeechPlanner.plan` does every check that can fail because of the request (model,
voice, capabilities), so errors reach the client with a proper status before any byte is
sent; it then normalises the input (numbers, money, dates... as words) and splits it into
the sentences the service synthesises one by one. Text streamed in is planned in two steps:
:meth:`SpeechPlanner.context` resolves model and voice once per context, and
:meth:`SpeechPlanner.piece` plans each piece of its text within it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tts_gateway.gateway.settings import Settings
from tts_gateway.gateway.speech.audio_encoding import AudioFormat
from tts_gateway.gateway.speech.request import SpeechRequest
from tts_gateway.gateway.speech.text_normalization import TextNormalizer
from tts_gateway.gateway.speech.text_splitting import split_sentences
from tts_gateway.gateway.speech.voice_registry import ResolvedVoice, VoiceRegistry
from tts_gateway.gateway.triton.live_catalog import LiveCatalog
from tts_gateway.gateway.triton.model_catalog import SpeechModel
from tts_gateway.models import contract


def synthesis_pieces(text: str, settings: Settings) -> list[str]:
    """The pieces of ``text`` the gateway synthesises one by one (the benchmarks send Triton the same)."""
    return split_sentences(
        text,
        max_chars=settings.sentence_max_chars,
        first_max_chars=settings.first_sentence_max_chars,
        min_chars=settings.sentence_min_chars,
    )


@dataclass(frozen=True)
class SpeechPlan:
    """Everything decided about a request before synthesis starts."""

    model: SpeechModel
    triton_model: str
    voice: ResolvedVoice
    sentences: tuple[str, ...]
    speed: float
    response_format: AudioFormat
    sse: bool
    input_chars: int
    whole: bool = False
    """The body goes out once complete (``stream: false``), not as it is synthesised."""
    seed: int | None = None
    instructions: str | None = None

    @property
    def streaming_model(self) -> bool:
        """The Triton model called is the decoupled twin: audio arrives in chunks."""
        return self.triton_model == self.model.stream_model

    @property
    def reproducible(self) -> bool:
        """The model draws its randomness from the request's seed: a sentence synthesised again
        comes out the same (so a stream restarted elsewhere can skip what was already sent)."""
        return self.seed is not None and contract.SEED in self.model.inputs

    @property
    def model_speed(self) -> bool:
        """The Triton model called changes tempo itself; otherwise the gateway time-stretches."""
        return self.triton_model in self.model.speed_variants

    def model_inputs(self, index: int, sentence: str) -> dict[str, Any]:
        values: dict[str, Any] = {contract.TARGET_TEXT: sentence}
        inputs = self.model.inputs
        if self.seed is not None and contract.SEED in inputs:
            # One seed per sentence, all derived from the request's: reproducible, not repetitive.
            values[contract.SEED] = (self.seed + index) % 2**63
        if self.instructions and contract.INSTRUCTIONS in inputs:
            values[contract.INSTRUCTIONS] = self.instructions
        if self.model_speed and self.speed != 1.0:
            values[contract.SPEED] = self.speed
        return values | self.voice_inputs()

    def voice_inputs(self) -> dict[str, Any]:
        """The contract inputs that set the voice: its recording (and transcript), else its built-in id."""
        return voice_inputs(self.model, self.voice)


@dataclass(frozen=True)
class ContextPlan:
    """What one context of text streamed in (a WebSocket's context, a Wyoming request) speaks with,
    resolved once, when it opens (:meth:`SpeechPlanner.context`).

    Each piece of its text is then only normalised and cut into sentences (:meth:`SpeechPlanner.piece`):
    nothing is resolved again. A context is one turn in one voice, so it speaks to its end with the
    voice it opened with, even when that voice is deleted or replaced meanwhile, as a speech request
    already planned does (a text-streaming session holds the voice's recording in its model anyway);
    the next context resolves the voice again.
    """

    model: SpeechModel
    triton_model: str
    voice: ResolvedVoice
    speed: float
    normalize: bool

    def voice_inputs(self) -> dict[str, Any]:
        """The contract inputs that set the voice (:meth:`SpeechPlan.voice_inputs`)."""
        return voice_inputs(self.model, self.voice)


def voice_inputs(model: SpeechModel, voice: ResolvedVoice) -> dict[str, Any]:
    """The contract inputs that set ``voice`` on ``model``: its recording (and transcript), else its built-in id."""
    values: dict[str, Any] = {}
    reference = voice.reference
    if reference is not None:
        values[contract.REFERENCE_WAV] = reference.audio.samples
        values[contract.REFERENCE_WAV_LEN] = reference.audio.samples.size
        if reference.transcript and contract.REFERENCE_TEXT in model.inputs:
            values[contract.REFERENCE_TEXT] = reference.transcript
    elif contract.VOICE in model.inputs:
        values[contract.VOICE] = voice.id
    return values


class SpeechPlanner:
    def __init__(
        self, catalog: LiveCatalog, voices: VoiceRegistry, settings: Settings, normalizer: TextNormalizer
    ) -> None:
        self._catalog = catalog
        self._voices = voices
        self._settings = settings
        self._normalizer = normalizer

    async def plan(self, request: SpeechRequest) -> SpeechPlan:
        context = self.context(
            request.model, request.voice_id, speed=request.speed, normalize=request.text_normalization
        )
        return replace(
            self.piece(context, await self.normalize(context, request.input)),
            response_format=request.response_format,
            sse=request.stream_format == "sse",
            input_chars=len(request.input),
            whole=not request.stream,
            seed=request.seed,
            instructions=request.instructions,
        )

    def context(self, model: str, voice: str, *, speed: float = 1.0, normalize: bool | None = None) -> ContextPlan:
        """``model`` and ``voice`` resolved against what the servers serve now; raises :class:`GatewayError`
        when they cannot be spoken. ``normalize``: ``None`` follows the gateway's default."""
        catalog = self._catalog.current
        speech_model = catalog.resolve(model)
        resolved = self._voices.resolve(voice, speech_model, catalog)
        return ContextPlan(
            model=speech_model,
            triton_model=catalog.require_streaming_or_offline(speech_model, self._settings.backend_mode),
            voice=resolved,
            speed=speed,
            normalize=self._settings.text_normalization if normalize is None else normalize,
        )

    async def normalize(self, context: ContextPlan, text: str) -> str:
        """``text`` as ``context``'s model reads it (numbers, money, dates... as words), if it normalises."""
        return await self._normalizer.normalize_async(text) if context.normalize else text

    def piece(self, context: ContextPlan, normalized: str) -> SpeechPlan:
        """A piece of ``context``'s text, already normalised, as a speech request of its own (16-bit PCM,
        streamed): cut into the sentences the speech service synthesises one by one."""
        return SpeechPlan(
            model=context.model,
            triton_model=context.triton_model,
            voice=context.voice,
            sentences=tuple(synthesis_pieces(normalized, self._settings)),
            speed=context.speed,
            response_format="pcm",
            sse=False,
            input_chars=len(normalized),
        )
