"""One CosyVoice2 request from contract inputs to audio: the orchestrator's logic.

The Triton orchestrator (``triton_repo/cosyvoice2``) is a thin adapter around
:class:`CosyVoice2Pipeline`. The pipeline reaches the other models only through the
:class:`Stages` protocol, so it runs unchanged against Triton (``triton_stages.py``)
or against in-process fakes in unit tests.

Per request: the voice prompt (speech tokens, mel feats, speaker embedding) comes from a
cache keyed by the reference recording; the LLM turns the prompt ids into speech tokens;
token2wav converts them into audio, either once (offline) or chunk by chunk as tokens
arrive (streaming: hop sizes from :class:`HopSchedule`, the tokens read ahead by
:class:`TokenFeed` so that a chunk can take what arrived while the last one was converted,
:meth:`HopSchedule.catch_up_hop`). Every request gets its own
token2wav session id, so concurrent streams never share vocoder state.
"""

from __future__ import annotations

import functools
import math
import secrets
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import NDArray

from tts_gateway.models.contract import parse_bool
from tts_gateway.models.cosyvoice2.model import vocab
from tts_gateway.models.cosyvoice2.orchestrator.first_hop import AdaptiveFirstHop
from tts_gateway.models.cosyvoice2.orchestrator.prompt_cache import PromptCache, voice_key
from tts_gateway.models.cosyvoice2.orchestrator.streaming import HopPolicy, HopSchedule
from tts_gateway.models.cosyvoice2.orchestrator.token_feed import LLMStalled, StopSignal, TokenFeed
from tts_gateway.models.request_parsing import ContractError, DependencyUnavailableError, SynthesisRequest
from tts_gateway.models.stage_trace import StageTrace

if TYPE_CHECKING:
    from tts_gateway.models.cosyvoice2.model.frontend import VoicePrompt

# Seeds drawn for requests that bring none: the LLM backends take an unsigned 64-bit seed.
_SEED_BITS = 63
# How long a stream that ends early waits for its token reader to close the LLM's stream.
_READER_WAIT_S = 2.0


class SynthesisError(RuntimeError):
    """The models ran but produced no usable speech (an internal error, not the caller's)."""


@dataclass(frozen=True)
class LLMRequest:
    """One generation call, in the terms of the TensorRT-LLM backend's inputs.

    ``top_k`` 0 and ``top_p`` 1.0 switch that filter off; ``seed`` None lets the LLM draw one.
    """

    input_ids: list[int]
    max_new_tokens: int
    min_new_tokens: int
    end_id: int | None
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int | None
    streaming: bool
    request_id: str = ""
    """Names the request in the LLM server's logs and traces (the token2wav session id)."""
    text_stream_id: str = ""
    """Set: the prompt has no target text, which follows in pieces (``llm_torch`` text streams)."""


@dataclass(frozen=True)
class TextPiece:
    """Text for an open text stream (token ids, possibly none); ``end`` completes its text, ``cancel`` ends it."""

    stream_id: str
    ids: tuple[int, ...]
    end: bool = False
    cancel: bool = False


@dataclass(frozen=True)
class Token2WavRequest:
    """One token2wav call.

    ``speech_tokens`` are all target tokens so far. Offline calls have ``token_offset``
    ``None`` and convert everything at once; streaming calls convert the tokens from
    ``token_offset`` on and keep cross-fade state under ``session_id`` until ``finalize``.
    """

    session_id: str
    speech_tokens: NDArray[np.int32]
    prompt: VoicePrompt
    token_offset: int | None
    finalize: bool
    speed: float


class Stages(Protocol):
    """What the pipeline needs from the models around it."""

    def voice_prompt(self, reference_wav: NDArray[np.float32]) -> VoicePrompt:
        """Speech tokens, 24 kHz mel feats and speaker embedding of a 16 kHz recording."""
        ...

    def generate(self, request: LLMRequest, is_cancelled: Callable[[], bool]) -> Generator[Sequence[int], None, None]:
        """Generated LLM ids, in pieces as they arrive; closing the iterator abandons the rest.

        ``is_cancelled`` is the request's cancellation check (an LLM server client asks it between retries).
        """
        ...

    def token2wav(self, request: Token2WavRequest) -> NDArray[np.float32]:
        """Audio for the tokens of ``request`` (mono, 24 kHz)."""
        ...

    def release(self, session_id: str) -> None:
        """Drop the streaming state of a session that will never be finalised."""
        ...

    def send_text(self, piece: TextPiece) -> None:
        """Pass text to the LLM's open text stream ``piece.stream_id`` (or end or cancel it)."""
        ...


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 50
    repetition_penalty: float = 1.1


@dataclass(frozen=True)
class PipelineSettings:
    """Everything a deployment may tune; filled from the model's ``config.pbtxt`` parameters."""

    sampling: SamplingDefaults
    hop_schedule: HopSchedule
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    max_output_tokens: int = 1500
    voice_cache_size: int = 32
    llm_stall_s: float = 120.0
    """A stream whose LLM sends nothing for this long (from the start: a wait for a slot counts) fails
    (``DependencyUnavailableError``)."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_token_text_ratio <= self.max_token_text_ratio:
            raise ValueError("need 0 <= min_token_text_ratio <= max_token_text_ratio")
        if self.max_output_tokens < 1:
            raise ValueError("max_output_tokens must be at least 1")
        if self.voice_cache_size < 1:
            raise ValueError("voice_cache_size must be at least 1")
        if not (math.isfinite(self.llm_stall_s) and self.llm_stall_s > 0):
            raise ValueError("llm_stall_timeout_s must be a finite positive number of seconds")

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> PipelineSettings:
        """Read the orchestrator's string parameters; a missing or malformed one is an error."""

        def get(key: str) -> str:
            if key not in params:
                raise ValueError(f"model parameter {key!r} is missing")
            return params[key]

        max_hop = int(get("max_hop_tokens"))
        max_first_hop = int(get("max_first_hop_tokens"))
        return cls(
            sampling=SamplingDefaults(
                temperature=float(get("temperature")),
                top_p=float(get("top_p")),
                top_k=int(get("top_k")),
                repetition_penalty=float(get("repetition_penalty")),
            ),
            hop_schedule=HopSchedule(
                first_hop=int(get("first_hop_tokens")),
                base_hop=int(get("base_hop_tokens")),
                policy=HopPolicy(get("hop_policy")),
                max_hop=max_hop if max_hop > 0 else None,
                catch_up=parse_bool(get("hop_catch_up")),
                max_first_hop=max_first_hop if max_first_hop > 0 else None,
            ),
            min_token_text_ratio=float(get("min_token_text_ratio")),
            max_token_text_ratio=float(get("max_token_text_ratio")),
            max_output_tokens=int(get("max_output_tokens")),
            voice_cache_size=int(get("voice_cache_size")),
            llm_stall_s=float(get("llm_stall_timeout_s")),
        )


class CosyVoice2Pipeline:
    """Contract request -> waveform chunks, against any :class:`Stages`."""

    def __init__(
        self,
        stages: Stages,
        tokenizer: vocab.TextTokenizer,
        settings: PipelineSettings,
        trace: StageTrace | None = None,
    ) -> None:
        self._stages = stages
        self._tokenizer = tokenizer
        self._settings = settings
        self._trace = trace or StageTrace("orchestrator", None)
        self._voices: PromptCache[VoicePrompt] = PromptCache(settings.voice_cache_size)
        schedule = settings.hop_schedule
        self.adaptive_first_hop = (
            None
            if schedule.max_first_hop is None
            else AdaptiveFirstHop(schedule.first_hop, schedule.max_first_hop, token_rate=schedule.token_rate)
        )

    def synthesize(
        self,
        request: SynthesisRequest,
        *,
        streaming: bool,
        is_cancelled: Callable[[], bool] = lambda: False,
    ) -> Iterator[NDArray[np.float32]]:
        """Yield the audio of ``request``: one waveform offline, successive chunks when streaming.

        A streamed request with ``speed`` other than 1.0 yields one chunk: the tempo change
        needs the whole mel.

        Stops early, without an error, once ``is_cancelled()`` turns true.
        """
        if request.reference_wav is None:
            raise ContractError(
                "CosyVoice2 has no built-in voices: send 'reference_wav' (and ideally 'reference_text')"
            )
        times = _Times(time.monotonic())
        wav = request.reference_wav
        # The prompt depends on the recording alone, not on its transcript.
        prompt = self._voices.get_or_compute(voice_key(wav, ""), lambda: self._stages.voice_prompt(wav))
        times.prompt_ready = time.monotonic()
        # Tempo changes stretch the whole mel at once (token2wav's offline path); a stream
        # with speed != 1 therefore arrives as a single chunk.
        streaming = streaming and request.speed == 1.0
        llm_request = self._llm_request(request, prompt, streaming=streaming)
        if streaming:
            chunks = self._stream(
                request, prompt, llm_request, _ThrottledCheck(is_cancelled), times, stall_s=self._settings.llm_stall_s
            )
        else:
            chunks = self._offline(request, prompt, llm_request, _ThrottledCheck(is_cancelled), times)
        yield from times.stamping_first(chunks)
        if self._trace.enabled:
            self._trace.record(llm_request.request_id, request=request.request_id, **vars(times))

    def _llm_request(self, request: SynthesisRequest, prompt: VoicePrompt, *, streaming: bool) -> LLMRequest:
        if request.instructions is not None:
            input_ids = vocab.build_instruct_prompt_ids(self._tokenizer, request.instructions, request.target_text)
        elif request.reference_text is None:
            # Without a transcript the recording still sets the voice (flow prompt and speaker
            # embedding) but cannot prefix the LLM: upstream's cross-lingual mode.
            input_ids = vocab.build_prompt_ids(self._tokenizer, "", request.target_text, [])
        else:
            input_ids = vocab.build_prompt_ids(
                self._tokenizer, request.reference_text, request.target_text, prompt.speech_tokens
            )
        settings = self._settings
        bounds = vocab.length_bounds(
            max(1, len(vocab.text_token_ids(self._tokenizer, request.target_text))),
            min_token_text_ratio=settings.min_token_text_ratio,
            max_token_text_ratio=settings.max_token_text_ratio,
            max_new_tokens_cap=settings.max_output_tokens,
        )
        return self._sampled(
            request,
            input_ids=input_ids,
            max_new_tokens=max(1, bounds.max_new_tokens),
            min_new_tokens=bounds.min_new_tokens,
            streaming=streaming,
            request_id=_new_session_id(),
        )

    def _sampled(self, request: SynthesisRequest, **fields: Any) -> LLMRequest:
        """An LLM request with the sampling of ``request``, the deployment's defaults where it sets none."""
        sampling = self._settings.sampling
        return LLMRequest(
            end_id=vocab.EOS1_ID,
            temperature=sampling.temperature if request.temperature is None else request.temperature,
            top_p=sampling.top_p if request.top_p is None else request.top_p,
            top_k=sampling.top_k if request.top_k is None else request.top_k,
            repetition_penalty=sampling.repetition_penalty,
            seed=secrets.randbits(_SEED_BITS) if request.seed is None else request.seed,
            **fields,
        )

    def synthesize_text_stream(
        self, request: SynthesisRequest, stream_id: str, *, is_cancelled: Callable[[], bool] = lambda: False
    ) -> Iterator[NDArray[np.float32]]:
        """Audio chunks of a text stream: the voice and sampling of ``request`` (its target text is not
        read), the text through :meth:`send_text` under ``stream_id`` (unique on the server).

        The LLM interleaves text and speech (``engines/llm_bistream.py``); chunks follow the usual hop
        schedule as its tokens arrive, and the stream waits for text without a stall limit. It ends
        after the text's end (or a cancel sent with :meth:`send_text`), with the final chunk.
        """
        if request.reference_wav is None:
            raise ContractError("a text stream needs 'reference_wav' (CosyVoice2 has no built-in voices)")
        if request.instructions is not None:
            raise ContractError("a text stream takes no 'instructions'")
        times = _Times(time.monotonic())
        wav = request.reference_wav
        prompt = self._voices.get_or_compute(voice_key(wav, ""), lambda: self._stages.voice_prompt(wav))
        times.prompt_ready = time.monotonic()
        # As offline: without a transcript the recording sets the voice but does not prefix the LLM.
        speech = [] if request.reference_text is None else prompt.speech_tokens
        llm_request = self._sampled(
            request,
            input_ids=vocab.build_prompt_ids(self._tokenizer, request.reference_text or "", "", speech),
            max_new_tokens=self._settings.max_output_tokens,
            min_new_tokens=0,
            streaming=True,
            request_id=stream_id,
            text_stream_id=stream_id,
        )
        cancel_sent = False

        def cancel_llm() -> None:
            # A stream waiting for text sends no token that would let its reader notice the end.
            nonlocal cancel_sent
            if not cancel_sent:
                cancel_sent = True
                self._stages.send_text(TextPiece(stream_id, (), cancel=True))

        def cancelled() -> bool:
            if is_cancelled():
                cancel_llm()
                return True
            return False

        chunks = self._stream(request, prompt, llm_request, _ThrottledCheck(cancelled), times, stall_s=None)
        ended = False
        try:
            yield from times.stamping_first(chunks)
            ended = True
        finally:
            if not ended:
                cancel_llm()
            chunks.close()
        if self._trace.enabled:
            self._trace.record(stream_id, request=request.request_id, text_stream=1, **vars(times))

    def send_text(self, stream_id: str, text: str, *, end: bool = False, cancel: bool = False) -> None:
        """Tokenize a piece of a text stream's text and pass it on (``end``: the text is complete)."""
        ids = tuple(vocab.text_token_ids(self._tokenizer, text)) if text else ()
        self._stages.send_text(TextPiece(stream_id, ids, end=end, cancel=cancel))

    def _speech_tokens(
        self,
        llm_request: LLMRequest,
        is_cancelled: _ThrottledCheck,
        times: _Times,
        stop: StopSignal | None = None,
    ) -> Generator[int, None, None]:
        """Speech tokens (not LLM ids) as generated; ends at the first non-speech id, on cancel or once ``stop`` is set.

        With ``stop`` (the tokens read on a thread of their own) every cancellation check goes through
        it, so none reaches Triton after the consumer stopped and may have sent the final response.
        """
        cancelled: Callable[[], bool] = is_cancelled
        unwanted: Callable[[], bool] = is_cancelled.always
        if stop is not None:
            cancelled = functools.partial(stop.unless_set, is_cancelled)
            unwanted = functools.partial(stop.unless_set, is_cancelled.always)
        pieces = self._stages.generate(llm_request, unwanted)
        try:
            for piece in pieces:
                if not times.first_token:
                    times.first_token = time.monotonic()
                if cancelled():
                    return
                for llm_id in piece:
                    token = vocab.id_to_speech_token(llm_id)
                    if token is None:
                        return
                    yield token
        finally:
            pieces.close()

    def _offline(
        self,
        request: SynthesisRequest,
        prompt: VoicePrompt,
        llm_request: LLMRequest,
        is_cancelled: _ThrottledCheck,
        times: _Times,
    ) -> Iterator[NDArray[np.float32]]:
        tokens = list(self._speech_tokens(llm_request, is_cancelled, times))
        times.first_hop = time.monotonic()
        if is_cancelled.always():
            return
        if not tokens:
            raise SynthesisError("the LLM produced no speech tokens")
        yield self._stages.token2wav(
            Token2WavRequest(
                session_id=llm_request.request_id,
                speech_tokens=np.asarray(tokens, dtype=np.int32),
                prompt=prompt,
                token_offset=None,
                finalize=True,
                speed=request.speed,
            )
        )

    def _stream(
        self,
        request: SynthesisRequest,
        prompt: VoicePrompt,
        llm_request: LLMRequest,
        is_cancelled: _ThrottledCheck,
        times: _Times,
        *,
        stall_s: float | None,
    ) -> Generator[NDArray[np.float32], None, None]:
        schedule = self._settings.hop_schedule
        session_id = llm_request.request_id
        offset = 0
        chunk_index = 0
        adaptive = self.adaptive_first_hop
        started = time.monotonic()
        first_ready = 0.0
        session_open = False
        stop = StopSignal()
        hop = schedule.next_hop(0)
        counted = False
        feed = TokenFeed(
            self._speech_tokens(llm_request, is_cancelled, times, stop),
            stop,
            name=f"tokens-{session_id[:8]}",
            stall_s=stall_s,
        )

        def convert(tokens: list[int], *, finalize: bool) -> NDArray[np.float32]:
            nonlocal first_ready
            audio = self._stages.token2wav(
                Token2WavRequest(
                    session_id=session_id,
                    speech_tokens=np.asarray(tokens, dtype=np.int32),
                    prompt=prompt,
                    token_offset=offset,
                    finalize=finalize,
                    speed=request.speed,
                )
            )
            if chunk_index == 0:
                first_ready = time.monotonic()
            elif chunk_index == 1 and adaptive is not None:
                adaptive.record(time.monotonic() - first_ready)
            return audio

        try:
            if adaptive is not None:
                hop, counted = adaptive.begin(), True
            while True:
                needed = schedule.chunk_end(offset, hop)
                arrived = feed.wait_for(needed)
                if arrived < needed:
                    break
                if chunk_index == 0 and adaptive is not None and (grown := adaptive.choose()) > hop:
                    # Streams started meanwhile (a burst): the first chunk waits for the larger hop's tokens.
                    hop = grown
                    continue
                if chunk_index > 0 and schedule.catch_up:
                    if feed.finished:
                        break
                    hop = schedule.catch_up_hop(hop, arrived - offset)
                if not times.first_hop:
                    times.first_hop = time.monotonic()
                    times.first_hop_tokens = hop
                chunk = convert(feed.tokens(schedule.chunk_end(offset, hop)), finalize=False)
                session_open = True
                yield chunk
                offset += hop
                chunk_index += 1
                hop = schedule.next_hop(
                    chunk_index,
                    emitted_tokens=offset,
                    pending_tokens=feed.arrived - offset,
                    elapsed_s=time.monotonic() - started,
                )
                if is_cancelled.always():
                    return
            if is_cancelled.always():
                return
            tokens = feed.all_tokens()
            if not tokens:
                raise SynthesisError("the LLM produced no speech tokens")
            if not times.first_hop:
                # The first chunk is the last: its tokens are all the LLM made.
                times.first_hop = time.monotonic()
            final = convert(tokens, finalize=True)
            session_open = False
            yield final
        except LLMStalled as exc:
            raise DependencyUnavailableError(f"{exc} (stream {session_id})") from exc
        finally:
            if adaptive is not None and counted:
                adaptive.end()
            # A stream that ends early (cancelled, failed, abandoned) waits for the LLM's next token, when
            # the reader closes the LLM's stream (cancelling it); one that finished has nothing to wait for.
            feed.close(_READER_WAIT_S)
            if session_open:
                self._stages.release(session_id)


@dataclass
class _Times:
    """When a request reached each stage (``time.monotonic()``; 0 for a stage not reached)."""

    started: float
    prompt_ready: float = 0.0
    first_token: float = 0.0
    first_hop: float = 0.0
    first_chunk: float = 0.0
    # Tokens of a stream's first chunk (0 offline, or when the first chunk was the last).
    first_hop_tokens: int = 0

    def stamping_first(self, chunks: Iterator[NDArray[np.float32]]) -> Iterator[NDArray[np.float32]]:
        """``chunks``, noting when the first of them was ready."""
        for chunk in chunks:
            if not self.first_chunk:
                self.first_chunk = time.monotonic()
            yield chunk


class _ThrottledCheck:
    """A cancellation check asked per generated token at most every ``interval_s``.

    Each ``is_cancelled()`` of a Triton request is a round trip to the server; asked for every
    token of every stream it would cost more than the tokens themselves. :meth:`always` asks.
    """

    def __init__(self, check: Callable[[], bool], interval_s: float = 0.05) -> None:
        self.always = check
        self._interval_s = interval_s
        self._next = 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self._interval_s
        return self.always()


def _new_session_id() -> str:
    """A token2wav session id that no other request, on any instance, can share."""
    return uuid.uuid4().hex
