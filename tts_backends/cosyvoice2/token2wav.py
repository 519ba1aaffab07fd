"""Speech tokens -> 24 kHz waveform: CosyVoice2's flow (tokens -> mel) followed by HiFT (mel -> audio).

Offline, all tokens are converted at once. Streaming, every chunk re-runs the flow over the voice
prompt and all target tokens so far (upstream has no flow cache), keeps the mel of the tokens not
converted yet, and vocodes it with per-request HiFT state (:class:`HiftStreamState`) so that the
chunks join without clicks.

The per-request state lives in a dict keyed by a caller-chosen request id. Upstream mixed audio
between concurrent requests whose ids were empty or reused; here an id must be non-empty, a chunk
must continue exactly where the previous chunk of the same id stopped, and one id cannot run two
chunks at once, so a collision is an error instead of silently shared audio. State is dropped when
the final chunk is done, on :meth:`Token2Wav.release`, when a chunk fails, and after ``state_ttl_s``
seconds without a chunk (cancelled requests that never finalise).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeAlias

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import NDArray
from torch import Tensor

from tts_backends.cosyvoice2.config import load_config
from tts_backends.cosyvoice2.flow import CausalFlow
from tts_backends.cosyvoice2.hift import HiFTGenerator
from tts_backends.cosyvoice2.hift_stream import DEFAULT_MEL_CACHE_FRAMES, HiftStreamState

DEFAULT_STATE_TTL_S = 300.0

SpeechTokens: TypeAlias = Sequence[int] | NDArray[np.integer[Any]]


class SpeechPrompt(Protocol):
    """The voice a request speaks with (``frontend.VoicePrompt`` has this shape)."""

    @property
    def speech_tokens(self) -> NDArray[np.int64]:
        """(L,) speech tokens of the reference recording."""
        ...

    @property
    def feats(self) -> NDArray[np.float32]:
        """(2L, 80) 24 kHz log-mel frames of the reference recording."""
        ...

    @property
    def embedding(self) -> NDArray[np.float32]:
        """(192,) speaker embedding."""
        ...


class StreamStateError(ValueError):
    """A streaming call that does not continue its request's state (unknown id, wrong offset, overlap)."""


@dataclass
class _Stream:
    hift: HiftStreamState
    generator: torch.Generator
    last_used: float
    consumed_tokens: int = 0
    busy: bool = False


class Token2Wav:
    """Flow + HiFT, offline and streaming, safe to call from several threads at once.

    HiFT's excitation noise comes from a generator seeded with ``vocoder_seed`` per request (one
    per stream, carried across its chunks), so equal tokens and prompt give equal audio.
    """

    def __init__(
        self,
        flow: CausalFlow,
        hift: HiFTGenerator,
        *,
        n_timesteps: int = 10,
        mel_cache_frames: int = DEFAULT_MEL_CACHE_FRAMES,
        state_ttl_s: float = DEFAULT_STATE_TTL_S,
        vocoder_seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if state_ttl_s <= 0:
            raise ValueError("state_ttl_s must be positive")
        self.flow = flow
        self.hift = hift
        self.n_timesteps = n_timesteps
        self.mel_cache_frames = mel_cache_frames
        self.state_ttl_s = state_ttl_s
        self.vocoder_seed = vocoder_seed
        self._clock = clock
        self._token_mel_ratio = flow.cfg.token_mel_ratio
        self._pre_lookahead = flow.cfg.pre_lookahead_len
        self._device = hift.conv_post.bias.device
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(
        cls,
        model_dir: Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        hift_dtype: torch.dtype = torch.float32,
        n_timesteps: int = 10,
        state_ttl_s: float = DEFAULT_STATE_TTL_S,
        vocoder_seed: int = 0,
    ) -> Token2Wav:
        """Load ``cosyvoice2.yaml``, ``flow.pt`` and ``hift.pt`` from ``model_dir``.

        ``dtype`` applies to the flow; HiFT stays in ``hift_dtype`` (float32 by default, as upstream
        keeps it even when the flow runs in fp16: it is cheap and its exp/iSTFT head is sensitive).
        """
        device = torch.device(device)
        cfg = load_config(model_dir / "cosyvoice2.yaml")
        flow = CausalFlow.from_checkpoint(cfg.flow, model_dir / "flow.pt", device, dtype)
        hift = HiFTGenerator.from_checkpoint(cfg.hift, model_dir / "hift.pt", device, hift_dtype)
        return cls(flow, hift, n_timesteps=n_timesteps, state_ttl_s=state_ttl_s, vocoder_seed=vocoder_seed)

    @property
    def sample_rate(self) -> int:
        return self.hift.m_source.sampling_rate

    @property
    def active_streams(self) -> int:
        """Requests whose streaming state is currently held."""
        with self._lock:
            return len(self._streams)

    def offline(self, tokens: SpeechTokens, prompt: SpeechPrompt, *, speed: float = 1.0) -> NDArray[np.float32]:
        """All of ``tokens`` as one waveform (mono float32 at :attr:`sample_rate`).

        ``speed`` changes the tempo by stretching the mel linearly along time before vocoding, as
        upstream does: ``frames / speed`` frames are vocoded, so duration scales by ``1 / speed``
        while HiFT's F0 prediction keeps the pitch. Only offline synthesis supports it (upstream
        too): in a stream, the cached frames and cross-fades assume an unstretched mel.
        """
        if not (math.isfinite(speed) and speed > 0):
            raise ValueError(f"speed must be a positive number, got {speed}")
        target = self._token_tensor(tokens)
        if target.shape[1] == 0:
            raise ValueError("no speech tokens to convert")
        with torch.inference_mode():
            mel = self._mel(target, prompt, streaming=False, finalize=True)
            if speed != 1.0:
                mel = F.interpolate(mel, size=max(1, int(mel.shape[2] / speed)), mode="linear")
            generator = torch.Generator(device=self._device).manual_seed(self.vocoder_seed)
            wav, _ = self.hift.inference(mel, generator=generator)
        return self._to_numpy(wav[0])

    def stream_chunk(
        self,
        request_id: str,
        tokens: SpeechTokens,
        prompt: SpeechPrompt,
        token_offset: int,
        finalize: bool,
    ) -> NDArray[np.float32]:
        """Audio of the tokens from ``token_offset`` on, for one chunk of the stream ``request_id``.

        ``tokens`` are all target tokens so far. A non-final chunk converts all but the last
        ``pre_lookahead_len`` (3) tokens, which only serve as look-ahead; the next chunk must then
        start at that point (``token_offset`` = tokens converted so far). The final chunk converts
        everything left and flushes the withheld cross-fade tail; the request's state is dropped.
        As in upstream's streaming loop, non-final chunks run the flow with chunked (streaming)
        attention and the final chunk with full attention.
        """
        if not request_id:
            raise ValueError("request_id must be a non-empty id unique to the request")
        target = self._token_tensor(tokens)
        converted = target.shape[1] if finalize else target.shape[1] - self._pre_lookahead
        if converted < token_offset:
            raise ValueError(
                f"{target.shape[1]} tokens do not reach past token_offset {token_offset}"
                + ("" if finalize else f" plus the {self._pre_lookahead}-token look-ahead")
            )
        stream = self._checkout(request_id, token_offset)
        failed = True
        try:
            with torch.inference_mode():
                mel = self._mel(target, prompt, streaming=not finalize, finalize=finalize)
                mel = mel[:, :, token_offset * self._token_mel_ratio :]
                audio = stream.hift.step(mel, self._vocoder(stream.generator), final=finalize)
            stream.consumed_tokens = converted
            failed = False
        finally:
            self._checkin(request_id, stream, drop=finalize or failed)
        return self._to_numpy(audio)

    def release(self, request_id: str) -> None:
        """Forget the streaming state of ``request_id`` (a cancelled request); unknown ids are ignored."""
        with self._lock:
            self._streams.pop(request_id, None)

    def evict_stale(self) -> int:
        """Drop idle streaming states older than ``state_ttl_s``; returns how many were dropped."""
        with self._lock:
            return self._evict_stale_locked(self._clock())

    def _evict_stale_locked(self, now: float) -> int:
        stale = [
            key
            for key, stream in self._streams.items()
            if not stream.busy and now - stream.last_used > self.state_ttl_s
        ]
        for key in stale:
            del self._streams[key]
        return len(stale)

    def _checkout(self, request_id: str, token_offset: int) -> _Stream:
        with self._lock:
            now = self._clock()
            self._evict_stale_locked(now)
            stream = self._streams.get(request_id)
            if stream is None:
                if token_offset != 0:
                    raise StreamStateError(
                        f"no streaming state for request {request_id!r} at token_offset {token_offset}: "
                        "the id is unknown, already finalised, released or expired"
                    )
                stream = _Stream(
                    hift=HiftStreamState(
                        mel_cache_frames=self.mel_cache_frames, samples_per_frame=self.hift.samples_per_frame
                    ),
                    generator=torch.Generator(device=self._device).manual_seed(self.vocoder_seed),
                    last_used=now,
                )
                self._streams[request_id] = stream
            elif stream.busy:
                raise StreamStateError(f"request {request_id!r} already has a chunk in progress")
            elif token_offset != stream.consumed_tokens:
                raise StreamStateError(
                    f"request {request_id!r} converted {stream.consumed_tokens} tokens so far, "
                    f"but the chunk starts at token_offset {token_offset}"
                )
            stream.busy = True
            return stream

    def _checkin(self, request_id: str, stream: _Stream, *, drop: bool) -> None:
        with self._lock:
            stream.busy = False
            stream.last_used = self._clock()
            if drop and self._streams.get(request_id) is stream:
                del self._streams[request_id]

    def _vocoder(self, generator: torch.Generator) -> Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor]]:
        def vocode(mel: Tensor, cache_source: Tensor | None) -> tuple[Tensor, Tensor]:
            return self.hift.inference(mel, cache_source, generator=generator)

        return vocode

    def _mel(self, target: Tensor, prompt: SpeechPrompt, *, streaming: bool, finalize: bool) -> Tensor:
        # Copies: prompts are shared, read-only arrays (a voice cache hands the same one to many requests).
        prompt_tokens = torch.from_numpy(np.array(prompt.speech_tokens, dtype=np.int64))[None]
        prompt_feat = torch.from_numpy(np.array(prompt.feats, dtype=np.float32))[None]
        embedding = torch.from_numpy(np.array(prompt.embedding, dtype=np.float32))[None]
        return self.flow.inference(
            target,
            prompt_tokens,
            prompt_feat,
            embedding,
            streaming=streaming,
            finalize=finalize,
            n_timesteps=self.n_timesteps,
        )

    @staticmethod
    def _token_tensor(tokens: SpeechTokens) -> Tensor:
        array = np.asarray(tokens)
        if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
            raise ValueError("tokens must be a 1-D sequence of integer speech tokens")
        return torch.as_tensor(array.astype(np.int64))[None]

    @staticmethod
    def _to_numpy(wav: Tensor) -> NDArray[np.float32]:
        return np.ascontiguousarray(wav.detach().float().cpu().numpy(), dtype=np.float32)
