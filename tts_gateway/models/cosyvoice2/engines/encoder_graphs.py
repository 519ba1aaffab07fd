"""The flow's token encoder (embedding, conformer stacks, projection to ``mu``) replayed from CUDA graphs.

Every flow pass encodes its rows' prompt and target tokens before the solve. Eagerly that is a few
hundred small kernels launched one by one from Python (ten conformer blocks with a hand-written
relative-position attention), 10-13 ms of a lone first chunk's 53-57 ms flow on an H100, while the
solve after it is already replayed from graphs (:mod:`.flow_graphs`). Inside Triton the launching
thread also competes for the GIL with the server's other threads. Replayed from a graph, the
same kernels are queued at once.

Graphs need fixed shapes, so one is recorded per (rows, tokens) bucket when token2wav starts: rows
in the flow's :func:`~.flow_graphs.row_buckets`, tokens (prompt and target, before the look-ahead)
in steps of ``token_step`` up to ``max_tokens``. A batch is copied into the smallest bucket that
holds it; the encoder masks right-padded tokens and rows without tokens, so each row gets what it
would get alone (up to floating-point reordering), as for the eager batch that pads to its longest
row. A batch of more rows than the largest bucket is encoded in slices of that many (token2wav records
up to :data:`MAX_ROWS` rows); one longer than every bucket returns None and is encoded eagerly.

The graphs share one memory pool and static buffers: a lock keeps calls (with their copies in and
out) from overlapping, and the result is a copy, since a first chunk converted between the segments
of another group's solve encodes over the same buffers before that group's inputs are loaded again.
On the CPU every bucket is encoded eagerly over the same static buffers, which is how the tests
check this module's bookkeeping without a GPU.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from typing import Final

import torch
from torch import Tensor

from tts_gateway.models.cosyvoice2.engines.flow_graphs import EagerReplay, row_buckets
from tts_gateway.models.cosyvoice2.model.flow import CausalFlow

_log = logging.getLogger(__name__)

MAX_ROWS: Final = 16
"""Most rows token2wav records the encoder for; larger groups are encoded in slices of as many. Recorded for
32 rows, a group's flow took as long as with the eager encoder on an H200, while the largest bucket's pool
doubled: 9.0 GB for 32 rows x 768 tokens against 4.5 GB for 16 (the attention scores of its relative positions)."""


class EncoderGraphs:
    """Encodes batches that fit one of its buckets by replaying a recorded graph (a :class:`~..flow.TokenEncoder`)."""

    def __init__(self, flow: CausalFlow, *, max_rows: int, max_tokens: int, token_step: int) -> None:
        if max_rows < 1 or token_step < 1 or max_tokens < token_step:
            raise ValueError("encoder graphs need max_rows >= 1 and max_tokens >= token_step >= 1")
        self._flow = flow
        self._lookahead = flow.cfg.pre_lookahead_len
        self._ratio = flow.cfg.token_mel_ratio
        self._rows = row_buckets(max_rows)
        self._tokens = list(range(token_step, max_tokens + 1, token_step))
        rows, tokens = self._rows[-1], self._tokens[-1]
        weight = flow.input_embedding.weight
        device = weight.device
        self._input = torch.zeros(rows, tokens + self._lookahead, dtype=torch.long, device=device)
        self._lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self._has_context = torch.zeros(rows, dtype=torch.bool, device=device)
        self._streaming = torch.zeros(rows, dtype=torch.bool, device=device)
        self._mu = torch.zeros(rows, flow.cfg.output_size, self._ratio * tokens, dtype=weight.dtype, device=device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | EagerReplay] = {}
        self._lock = threading.Lock()
        started = time.monotonic()
        self._capture(device)
        self.capture_s = time.monotonic() - started
        _log.info("flow encoder captured for %d buckets in %.1f s", len(self._graphs), self.capture_s)

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """(rows, tokens before the look-ahead) of every recorded graph."""
        return sorted(self._graphs)

    @torch.inference_mode()
    def __call__(self, tokens: Tensor, lengths: Tensor, has_context: Tensor, streaming: Tensor) -> Tensor | None:
        """:meth:`CausalFlow.encode` of ``tokens`` ``[B, W]`` (on the CPU), or None when no bucket holds that many
        tokens. More rows than the largest bucket's are encoded in slices of its rows: rows are encoded apart
        from each other, and the eager encoder would take new memory for every larger shape it meets."""
        count, width = tokens.shape
        bucket = next((t for t in self._tokens if t >= width - self._lookahead), None)
        if bucket is None:
            return None
        mu = self._mu.new_empty(count, self._mu.size(1), self._ratio * (width - self._lookahead))
        most = self._rows[-1]
        for start in range(0, count, most):
            part = slice(start, start + most)
            self._replay(bucket, mu[part], tokens[part], lengths[part], has_context[part], streaming[part])
        return mu

    def _replay(
        self, bucket: int, out: Tensor, tokens: Tensor, lengths: Tensor, has_context: Tensor, streaming: Tensor
    ) -> None:
        """Write into ``out`` the mu of at most the largest bucket's rows, from the graph of ``bucket`` tokens
        (a copy: a later batch encodes over the same buffers)."""
        count, width = tokens.shape
        rows = next(r for r in self._rows if r >= count)
        with self._lock:
            # Rows and tokens past the batch's are masked; zeroed, they hold nothing of an earlier batch.
            self._input[:rows].zero_()
            self._input[:count, :width].copy_(tokens)
            for buffer in (self._lengths, self._has_context, self._streaming):
                buffer[:rows].zero_()
            self._lengths[:count] = lengths
            self._has_context[:count] = has_context
            self._streaming[:count] = streaming
            self._graphs[rows, bucket].replay()
            out.copy_(self._mu[:count, :, : self._ratio * (width - self._lookahead)])

    def _encode(self, rows: int, tokens: int) -> None:
        mu = self._flow.encode(
            self._input[:rows, : tokens + self._lookahead],
            self._lengths[:rows],
            self._has_context[:rows],
            self._streaming[:rows],
        )
        self._mu[:rows, :, : self._ratio * tokens] = mu

    @torch.inference_mode()
    def _capture(self, device: torch.device) -> None:
        if device.type != "cuda":
            for rows, tokens in itertools.product(self._rows, self._tokens):
                self._graphs[rows, tokens] = EagerReplay(functools.partial(self._encode, rows, tokens))
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            # One eager pass at the largest shape initialises the kernels' libraries off the graphs.
            self._encode(self._rows[-1], self._tokens[-1])
            for rows in reversed(self._rows):
                for tokens in reversed(self._tokens):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._encode(rows, tokens)
                    self._graphs[rows, tokens] = graph
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
