"""What a speech request asks for, decided before any synthesis.

:meth:`SpeechPlanner.plan` does every check that can fail because of the request (model,
voice, capabilities), so errors reach the client with a proper status before any byte is
sent; it then normalises the input (numbers, money, dates... as words) and splits it into
the sentences the service synthesises one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
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
        values: dict[str, Any] = {}
        inputs = self.model.inputs
        reference = self.voice.reference
        if reference is not None:
            values[contract.REFERENCE_WAV] = reference.audio.samples
            values[contract.REFERENCE_WAV_LEN] = reference.audio.samples.size
            if reference.transcript and contract.REFERENCE_TEXT in inputs:
                values[contract.REFERENCE_TEXT] = reference.transcript
        elif contract.VOICE in inputs:
            values[contract.VOICE] = self.voice.id
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
        catalog = self._catalog.current
        model = catalog.resolve(request.model)
        voice = self._voices.resolve(request.voice_id, model, catalog)
        triton_model = catalog.require_streaming_or_offline(model, self._settings.backend_mode)
        normalize = request.text_normalization
        if normalize is None:
            normalize = self._settings.text_normalization
        text = await self._normalizer.normalize_async(request.input) if normalize else request.input
        sentences = synthesis_pieces(text, self._settings)
        return SpeechPlan(
            model=model,
            triton_model=triton_model,
            voice=voice,
            sentences=tuple(sentences),
            speed=request.speed,
            response_format=request.response_format,
            sse=request.stream_format == "sse",
            input_chars=len(request.input),
            whole=not request.stream,
            seed=request.seed,
            instructions=request.instructions,
        )
