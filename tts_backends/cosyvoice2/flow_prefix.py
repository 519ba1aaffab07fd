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
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor, nn

from tts_backends.cosyvoice2.flow_decoder import Attention


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


def bytes_per_frame(estimator: nn.Module, n_timesteps: int) -> int:
    """What a recorded prefix costs per mel frame: keys and values of every attention, CFG pair, every step."""
    attentions = [module for module in estimator.modules() if isinstance(module, Attention)]
    parameter = next(estimator.parameters())
    per_step = sum(2 * 2 * module.to_k.out_features for module in attentions) * parameter.element_size()
    return per_step * n_timesteps


@dataclass(frozen=True, eq=False)
class VoicePrefix:
    """What the estimator computed for a voice's first ``frames`` mel frames, CFG pair as rows [2].

    ``tensors`` are in the order the estimator hands them to a tape, over all solver steps:
    a causal convolution's left context ``[2, C, k-1]``, an attention's keys and values
    ``[2, heads, frames, d]``.
    """

    frames: int
    tensors: tuple[Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class PrefixRecorder:
    """A tape that keeps what a solve over the prefix alone computes (the rows are the CFG pair)."""

    visible = None

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []

    def context(self, x: Tensor, width: int) -> Tensor:
        self.tensors.append(x[:, :, x.size(2) - width :].clone())
        return torch.nn.functional.pad(x, (width, 0))

    def keys_values(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        self.tensors += [keys.clone(), values.clone()]
        return keys, values


class PrefixReplay:
    """A tape that puts a recorded prefix in front of every row of a solve, from the first step on.

    ``tensors`` are laid out as :attr:`VoicePrefix.tensors`; ``visible`` (``[P]`` bool) says which
    of the attention frames are real (the rest is padding of a fixed-size buffer, as the CUDA
    graphs use).
    """

    def __init__(self, tensors: Sequence[Tensor], visible: Tensor) -> None:
        self.tensors = tensors
        self.visible = visible
        self._next = 0

    def _take(self, rows: int) -> Tensor:
        """The next recorded tensor, its CFG pair repeated for ``rows`` rows: [cond x rows, uncond x rows]."""
        recorded = self.tensors[self._next]
        self._next += 1
        pair = recorded.unsqueeze(1).expand(2, rows // 2, *recorded.shape[1:])
        return pair.reshape(rows, *recorded.shape[1:])

    def context(self, x: Tensor, width: int) -> Tensor:
        left = self._take(x.size(0))
        if left.size(2) != width:
            raise ValueError(f"the prefix holds {left.size(2)} frames of left context, the convolution needs {width}")
        return torch.cat([left, x], dim=2)

    def keys_values(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        rows = keys.size(0)
        return torch.cat([self._take(rows), keys], dim=2), torch.cat([self._take(rows), values], dim=2)


def voice_key(tokens: NDArray[np.integer], feats: NDArray[np.floating], embedding: NDArray[np.floating]) -> str:
    """A digest of a voice prompt's contents: equal prompts share a prefix, whichever object holds them."""
    digest = hashlib.blake2b(digest_size=16)
    for array in (tokens, feats, embedding):
        contiguous = np.ascontiguousarray(array)
        digest.update(str((contiguous.dtype.str, contiguous.shape)).encode())
        digest.update(contiguous.tobytes())
    return digest.hexdigest()


class VoicePrefixCache:
    """Recorded prefixes by voice key, least recently used dropped beyond ``max_bytes``. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, VoicePrefix] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(entry.nbytes for entry in self._entries.values())

    def get(self, key: str) -> VoicePrefix | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: str, prefix: VoicePrefix) -> None:
        """Keep ``prefix`` unless it alone is larger than the budget."""
        if prefix.nbytes > self.max_bytes:
            return
        with self._lock:
            self._entries[key] = prefix
            self._entries.move_to_end(key)
            total = sum(entry.nbytes for entry in self._entries.values())
            while total > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                total -= dropped.nbytes
