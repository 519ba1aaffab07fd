"""ElevenLabs' REST text-to-speech on the gateway's one speech path.

A request becomes a gateway speech request (:meth:`TextToSpeechBody.speech_request`), which the speech
planner plans and the speech service synthesises as 24 kHz PCM, with the same checks, admission control,
sentence pipelining and failover as ``/v1/audio/speech``. This module only converts that audio into the
``output_format`` asked for (the socket's format table, :mod:`speech.text_stream.output_format`) and, for the
timestamped forms, estimates which characters each piece speaks (the socket's estimate,
:mod:`speech.text_stream.alignment`), in seconds from the start of the response.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from tts_gateway.gateway.api.elevenlabs_api import (
    AudioWithTimestamps,
    CharacterAlignment,
    TextToSpeechBody,
    TextToSpeechQuery,
)
from tts_gateway.gateway.errors import InvalidRequestError, NotFoundError
from tts_gateway.gateway.speech.plan import SpeechPlan
from tts_gateway.gateway.speech.request import SpeechRequest
from tts_gateway.gateway.speech.service import SpeechStream
from tts_gateway.gateway.speech.text_stream.alignment import CharAlignment, PhraseAligner
from tts_gateway.gateway.speech.text_stream.output_format import (
    AudioConverter,
    ConvertedAudio,
    OutputFormat,
    UnsupportedOutputFormat,
    pcm_pieces,
)

VOICE_NOT_FOUND: Final = "voice_not_found"


@dataclass(frozen=True)
class ElevenLabsSpeech:
    """Opens ElevenLabs responses over the speech service's two entry points, planning and opening a stream."""

    plan: Callable[[SpeechRequest], Awaitable[SpeechPlan]]
    open_stream: Callable[[SpeechPlan], Awaitable[SpeechStream]]

    async def open(
        self, voice_id: str, body: TextToSpeechBody, query: TextToSpeechQuery, *, streaming: bool
    ) -> ElevenLabsAudio:
        """Plan and start synthesis; raises a :class:`GatewayError` for anything wrong before the first byte.

        ``streaming=False``: the audio is one file sent whole, so a wav header carries exact sizes.
        """
        try:
            fmt = OutputFormat.parse(query.output_format)
        except UnsupportedOutputFormat as exc:
            raise InvalidRequestError(str(exc), param="output_format", code="invalid_output_format") from None
        try:
            plan = await self.plan(body.speech_request(voice_id))
        except InvalidRequestError as exc:
            # ElevenLabs answers a voice id it does not know with 404 (its SDK's NotFoundError).
            if exc.code != VOICE_NOT_FOUND:
                raise
            raise NotFoundError(
                f"voice {voice_id!r} does not exist; GET /v1/voices lists the voices", param="voice_id", code=exc.code
            ) from None
        stream = await self.open_stream(plan)
        return ElevenLabsAudio(fmt, fmt.converter(streaming=streaming), stream, body.text, " ".join(plan.sentences))


class ElevenLabsAudio:
    """One response's audio in its ElevenLabs format. It holds the speech stream (and its synthesis slot):
    the owner closes it however the response ends."""

    def __init__(
        self, fmt: OutputFormat, converter: AudioConverter, stream: SpeechStream, text: str, normalized: str
    ) -> None:
        self.format = fmt
        self._converter = converter
        self._stream = stream
        self._text = text
        self._normalized = normalized

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            self._converter.close()

    async def _converted(self) -> AsyncGenerator[tuple[ConvertedAudio, bool], None]:
        """The audio as converted, each piece with whether it is the last; the encoder's tail goes with the last.

        One piece is held back: only once the next has come is it known whether it is the last.
        """
        pending: ConvertedAudio | None = None
        async for pcm in self._stream:
            for piece in pcm_pieces(pcm):
                converted = await self._converter.convert_async(piece)
                if pending is not None:
                    yield pending, False
                pending = converted
        tail = await self._converter.finish()
        if pending is None:
            pending = ConvertedAudio(b"", 0.0)
        yield ConvertedAudio(pending.data + tail, pending.duration_ms), True

    async def audio(self) -> AsyncIterator[bytes]:
        """The encoded audio, as it is synthesised."""
        async for pcm in self._stream:
            if data := (await self._converter.convert_async(pcm)).data:
                yield data
        if tail := await self._converter.finish():
            yield tail

    async def timestamped(self) -> AsyncIterator[AudioWithTimestamps]:
        """The audio piece by piece, each with the characters it speaks (as written and as normalised)."""
        spoken = PhraseAligner(self._text)
        normalized = PhraseAligner(self._normalized)
        offset_ms = 0.0
        async with contextlib.aclosing(self._converted()) as pieces:
            async for audio, last in pieces:
                yield AudioWithTimestamps(
                    audio_base64=base64.b64encode(audio.data).decode(),
                    alignment=_seconds(spoken.take(audio.duration_ms, last=last), offset_ms),
                    normalized_alignment=_seconds(normalized.take(audio.duration_ms, last=last), offset_ms),
                )
                offset_ms += audio.duration_ms

    async def timestamped_whole(self) -> AudioWithTimestamps:
        """All the audio at once, with every character's times."""
        audio = bytearray()
        spoken = CharacterAlignment(characters=[], character_start_times_seconds=[], character_end_times_seconds=[])
        normalized = spoken.model_copy(deep=True)
        async for piece in self.timestamped():
            audio += base64.b64decode(piece.audio_base64)
            for whole, part in ((spoken, piece.alignment), (normalized, piece.normalized_alignment)):
                if part is not None:
                    whole.characters += part.characters
                    whole.character_start_times_seconds += part.character_start_times_seconds
                    whole.character_end_times_seconds += part.character_end_times_seconds
        return AudioWithTimestamps(
            audio_base64=base64.b64encode(audio).decode(), alignment=spoken, normalized_alignment=normalized
        )


def _seconds(alignment: CharAlignment, offset_ms: float) -> CharacterAlignment:
    starts = [(offset_ms + start) / 1000 for start in alignment.start_ms]
    return CharacterAlignment(
        characters=list(alignment.chars),
        character_start_times_seconds=[round(start, 3) for start in starts],
        character_end_times_seconds=[
            round(start + duration / 1000, 3) for start, duration in zip(starts, alignment.duration_ms, strict=True)
        ],
    )
