"""The flow's work on a voice prompt, done once per voice and reused by every streaming chunk.

A streaming chunk runs the flow over the voice prompt and every target token so far. In
streaming mode everything in the flow is causal at chunk granularity: the encoder and the
estimator attend within their own and earlier chunks, the estimator's convolutions are causal,
and the solve starts from pre-drawn noise sliced by frame. So the first frames of the prompt,
up to a chunk boundary the encoder's look-ahead does not cross, come out the same in every
chunk of every request with that voice, and so does everything the estimator computes for them
at each step: the keys and values of every attention and the last frames entering every
causal convolution. :class:`VoicePrefix` holds those (recorded once by solving the prefix
alone); a later solve replays them and runs only over the frames after the prefix.

Only the prompt is cached, not a request's own earlier frames: those would cost about 2.2 MiB per
frame in fp16 (56 attention layers x keys and values x 10 steps x the CFG pair) per request, too
much to keep for every stream in flight. A voice's prefix is shared by all its requests.

Offline calls and final chunks attend to all frames at once (not chunked), so they run as before.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor, nn
from torch.nn import functional as F

from tts_gateway.models.cosyvoice2.model.flow_decoder import Attention, CausalConv1d


def prefix_frames(prompt_tokens: int, *, lookahead: int, ratio: int, align: int, limit: int) -> int:
    """Mel frames of a prompt of ``prompt_tokens`` tokens that every streaming chunk computes alike.

    The prefix ends on a multiple of ``align`` frames (a chunk boundary of both the encoder and
    the estimator), its last token's look-ahead stays inside the prompt, and it is at most
    ``limit`` frames. 0 when the prompt is too short.
    """
    voiced = max(0, prompt_tokens - lookahead) * ratio
    return min(voiced, limit) // align * align


def chunk_alignment(estimator_chunk: int, encoder_chunk: int, ratio: int) -> int:
    """Frames a prefix is a multiple of: chunk boundaries of the estimator and of the encoder (at the mel rate)."""
    chunks = [size for size in (estimator_chunk, encoder_chunk * ratio) if size > 0]
    return math.lcm(*chunks) if chunks else 1


def prefix_nbytes(estimator: nn.Module, n_timesteps: int, frames: int) -> int:
    """What a recorded prefix of ``frames`` frames holds, in bytes: every attention's keys and values
    per frame, and every causal convolution's left context, for the CFG pair at every step."""
    element = next(estimator.parameters()).element_size()
    per_frame = sum(2 * m.to_k.out_features for m in estimator.modules() if isinstance(m, Attention))
    context = sum(m.in_channels * m.left_pad for m in estimator.modules() if isinstance(m, CausalConv1d))
    return 2 * n_timesteps * element * (per_frame * frames + context)


def frames_within(estimator: nn.Module, n_timesteps: int, budget: int) -> int:
    """The most frames whose prefix fits ``budget`` bytes (0 when not even the context fits)."""
    fixed = prefix_nbytes(estimator, n_timesteps, 0)
    per_frame = prefix_nbytes(estimator, n_timesteps, 1) - fixed
    return max(0, budget - fixed) // per_frame


@dataclass(frozen=True, eq=False)
class VoicePrefix:
    """What the estimator computed for a voice's first ``frames`` mel frames over ``steps`` solver
    steps, CFG pair as rows [2].

    ``tensors`` are in the order the estimator hands them to a tape, over all solver steps:
    a causal convolution's left context ``[2, C, k-1]``, an attention's keys and values
    ``[2, heads, capacity, d]`` (zeros after ``frames``).
    """

    frames: int
    steps: int
    tensors: tuple[Tensor, ...]

    @property
    def capacity(self) -> int:
        """Frames its keys and values hold: ``frames``, or more where recorded for a larger buffer."""
        return next((t.size(2) for t in self.tensors if t.dim() == 4), self.frames)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class PrefixRecorder:
    """A tape that keeps what a solve over the prefix alone computes (the rows are the CFG pair)."""

    visible = None

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []

    def level(self, count: int) -> PrefixRecorder:
        """The tape of a U-Net level that hands it ``count`` tensors: this one, which keeps them in order."""
        return self

    def context(self, x: Tensor, width: int) -> Tensor:
        self.tensors.append(x[:, :, x.size(2) - width :].clone())
        return torch.nn.functional.pad(x, (width, 0))

    def keys_values(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        self.tensors += [keys.clone(), values.clone()]
        return keys, values


class PrefixReplay:
    """A tape that puts recorded prefixes in front of every row of a solve, from the first step on; rows of
    several voices share one solve.

    ``tensors`` are laid out as :attr:`VoicePrefix.tensors`, each with the CFG pairs of up to S voices
    stacked as ``[2S, ...]`` (voice s at 2s conditioned, 2s + 1 unconditioned; keys and values padded to
    P frames). ``rows`` (``[B]`` long) picks each estimator row's entry, and ``visible`` (``[B, P]`` bool)
    says which of its prefix frames are real. Each tensor is gathered for the rows and put in front of
    theirs: inside a compiled level the two are one kernel.
    """

    def __init__(self, tensors: TensorList, rows: Tensor, visible: Tensor) -> None:
        self.tensors = tensors
        self.rows = rows
        self.visible = visible
        self._next = 0

    def level(self, count: int) -> PrefixReplay:
        """The next ``count`` tensors as a tape of their own, for a U-Net level to take in order. A compiled
        level is handed a tape that starts at its first tensor, so that each of its calls looks alike."""
        share = tuple(self.tensors[index] for index in range(self._next, self._next + count))
        self._next += count
        return PrefixReplay(share, self.rows, self.visible)

    def _take(self) -> Tensor:
        recorded = self.tensors[self._next]
        self._next += 1
        return recorded.index_select(0, self.rows)

    def context(self, x: Tensor, width: int) -> Tensor:
        left = self._take()
        if left.size(2) != width:
            raise ValueError(f"the prefix holds {left.size(2)} frames of left context, the convolution needs {width}")
        return torch.cat([left, x], dim=2)

    def keys_values(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        return torch.cat([self._take(), keys], dim=2), torch.cat([self._take(), values], dim=2)


def voice_slots(prefixes: Sequence[VoicePrefix]) -> tuple[list[VoicePrefix], list[int]]:
    """The rows' distinct voices in the order they first come, and each row's slot among them."""
    slots: dict[int, int] = {}
    voices: list[VoicePrefix] = []
    for prefix in prefixes:
        if id(prefix) not in slots:
            slots[id(prefix)] = len(voices)
            voices.append(prefix)
    return voices, [slots[id(prefix)] for prefix in prefixes]


def replay_rows(
    slots: Sequence[int], frames: Sequence[int], rows: int, capacity: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """For solve rows whose voices sit in ``slots`` with prefixes of ``frames`` frames (one each), padded to
    ``rows``: each estimator row's entry in stacked prefixes (``[2 * rows]`` long) and which of its
    ``capacity`` prefix frames are real (``[2 * rows, capacity]`` bool); padding rows take entry 0 and see
    none. The estimator's rows are the CFG pair: ``rows`` conditioned, then as many unconditioned."""
    padding = rows - len(slots)
    entry = torch.tensor([*slots, *[0] * padding], device=device)
    counts = torch.tensor([*frames, *[0] * padding], device=device).unsqueeze(1)
    visible = torch.arange(capacity, device=device).unsqueeze(0) < counts
    return torch.cat([2 * entry, 2 * entry + 1]), torch.cat([visible, visible])


class TensorList(Protocol):
    """Tensors by position: a tuple or list, or :class:`StackedPrefixes`."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Tensor: ...


class StackedPrefixes:
    """The voices' recorded tensors stacked as :class:`PrefixReplay` takes them, keys and values padded to
    ``capacity`` frames (zeros, which the replay's ``visible`` hides). Each is stacked when the replay takes
    it, so an eager solve never holds a copy of every step's at once; one voice that needs no padding is
    handed over as recorded. ``static`` marks their sizes static, as the CUDA graphs' buffers are, for a
    compiled estimator."""

    def __init__(self, voices: Sequence[VoicePrefix], capacity: int, *, static: bool = False) -> None:
        self._voices = voices
        self._capacity = capacity
        self._static = static

    def __len__(self) -> int:
        return len(self._voices[0].tensors)

    def __getitem__(self, index: int, /) -> Tensor:
        recorded = [voice.tensors[index] for voice in self._voices]
        if recorded[0].dim() == 4:
            recorded = [
                F.pad(t, (0, 0, 0, self._capacity - t.size(2))) if t.size(2) < self._capacity else t for t in recorded
            ]
        stacked = recorded[0] if len(recorded) == 1 else torch.cat(recorded)
        if self._static:
            torch._dynamo.mark_static(stacked)
        return stacked


def voice_key(tokens: NDArray[np.integer], feats: NDArray[np.floating], embedding: NDArray[np.floating]) -> str:
    """A digest of a voice prompt's contents: equal prompts share a prefix, whichever object holds them."""
    digest = hashlib.blake2b(digest_size=16)
    for array in (tokens, feats, embedding):
        contiguous = np.ascontiguousarray(array)
        digest.update(str((contiguous.dtype.str, contiguous.shape)).encode())
        digest.update(contiguous.tobytes())
    return digest.hexdigest()


class VoicePrefixCache:
    """Recorded prefixes by voice key within ``max_bytes``. Thread-safe.

    A voice is admitted while there is room; to make room, only voices unused for ``idle_s``
    seconds are dropped (least recently used first). A voice in use is never dropped for another,
    so more voices than fit do not evict each other at every chunk (each eviction would cost the
    next chunk a fresh recording): the voices that do not fit run without a prefix, as before.
    """

    def __init__(self, max_bytes: int, *, idle_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.idle_s = idle_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[VoicePrefix, float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes_locked()

    def get(self, key: str) -> VoicePrefix | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries[key] = (entry[0], self._clock())
            self._entries.move_to_end(key)
            return entry[0]

    def make_room(self, nbytes: int) -> bool:
        """Whether a prefix of ``nbytes`` fits, after dropping idle voices if it does not yet."""
        with self._lock:
            return self._make_room_locked(nbytes)

    def put(self, key: str, prefix: VoicePrefix) -> bool:
        """Keep ``prefix`` if it fits (see :meth:`make_room`); returns whether it was kept."""
        with self._lock:
            self._entries.pop(key, None)
            if not self._make_room_locked(prefix.nbytes):
                return False
            self._entries[key] = (prefix, self._clock())
            return True

    def _make_room_locked(self, nbytes: int) -> bool:
        if nbytes > self.max_bytes:
            return False
        total = self._nbytes_locked()
        now = self._clock()
        for key, (entry, used) in list(self._entries.items()):
            if total + nbytes <= self.max_bytes:
                break
            if now - used >= self.idle_s:
                del self._entries[key]
                total -= entry.nbytes
        return total + nbytes <= self.max_bytes

    def _nbytes_locked(self) -> int:
        return sum(entry.nbytes for entry, _ in self._entries.values())
