"""The CosyVoice2 orchestrator's Triton model: contract tensors in, ``waveform`` out.

Imported only inside Triton (it needs ``triton_python_backend_utils``); ``triton_repo/cosyvoice2/1/model.py``
builds the pipeline and its LLM source from the config's parameters, this class serves them.
The logic is :class:`tts_gateway.models.cosyvoice2.orchestrator.pipeline.CosyVoice2Pipeline`; the contract
handling (tensors, streaming, cancellation, errors) is shared with the other speech models
in :mod:`tts_gateway.models.triton_speech_model`. Deployed as ``cosyvoice2`` (one response)
and ``cosyvoice2_stream`` (decoupled: one response per chunk, then the final flag), and with
``text_streaming`` as ``cosyvoice2_bistream``: sessions whose text arrives in pieces
(:mod:`tts_gateway.models.cosyvoice2.orchestrator.text_sessions`), routed to their instance by
Triton's sequence batcher.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from numpy.typing import NDArray

from tts_gateway.models import contract
from tts_gateway.models.contract import parse_bool
from tts_gateway.models.cosyvoice2.orchestrator.llm_server_client import LLMServerClient
from tts_gateway.models.cosyvoice2.orchestrator.pipeline import CosyVoice2Pipeline
from tts_gateway.models.cosyvoice2.orchestrator.text_sessions import SessionCall, TextSessions, parse_session_call
from tts_gateway.models.cosyvoice2.orchestrator.triton_stages import LLMSource
from tts_gateway.models.request_parsing import SynthesisRequest
from tts_gateway.models.triton_speech_model import Cancelled, SpeechContractModel

# Pieces passed on to the LLM at once (each a short round trip on the server).
_PIECE_WORKERS = 8
_EMPTY = np.zeros(0, dtype=np.float32)


class CosyVoice2Model(SpeechContractModel):
    """Subclasses implement :meth:`load`."""

    def load(self, params: dict[str, str]) -> tuple[CosyVoice2Pipeline, LLMSource]:
        """The pipeline and the source of its LLM's tokens, from the config's string parameters."""
        raise NotImplementedError

    def setup(self, params: dict[str, str]) -> None:
        self._pipeline, self._llm = self.load(params)
        text_streaming = parse_bool(params.get(contract.PARAM_TEXT_STREAMING, ""))
        if text_streaming and isinstance(self._llm, LLMServerClient):
            raise ValueError("text_streaming needs the LLM as a Triton model (llm_model), not llm_urls")
        self._sessions = TextSessions(self._pipeline) if text_streaming else None

    def initialize(self, args: dict[str, str]) -> None:
        super().initialize(args)
        if self._sessions is not None and not self.decoupled:
            raise ValueError("text_streaming needs a decoupled model")
        if self._sessions is not None and "oldest" not in self.config.get("sequence_batching", {}):
            # Without it Triton hands a session's pieces to any instance, which may not hold the session; the
            # direct strategy would give an instance one session (max_batch_size 0: one place).
            raise ValueError("text_streaming needs sequence_batching with the oldest strategy (sessions stay put)")
        # Every piece of this instance's sessions reaches its execute thread; each is answered once the LLM
        # took it (a round trip), so they are passed on from threads of their own: on the execute thread,
        # each session's text waited behind every other session's.
        self._pieces = (
            None
            if self._sessions is None
            else ThreadPoolExecutor(max_workers=_PIECE_WORKERS, thread_name_prefix=f"{self.name}-pieces")
        )

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if self._sessions is None:
            return super().execute(requests)
        for request in requests:
            sender = request.get_response_sender()
            tensors = self.arrays(request, self.input_names)
            try:
                call = parse_session_call(tensors)
                if call.opens:
                    stream_id = self._sessions.open(call)
                    # An empty first response: the session is open and takes text.
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(contract.WAVEFORM, _EMPTY)]))
                    assert self._pool is not None
                    self._pool.submit(self._run_session, request, sender, call, stream_id, tensors)
                    continue
                assert self._pieces is not None
                self._pieces.submit(self._pass_piece, sender, call)
            except Exception as exc:
                self._fail(sender, exc)
        return None

    def _pass_piece(self, sender: Any, call: SessionCall) -> None:
        """Pass a later request's text, end or close to its session; answered once the LLM took it, so that a
        caller who waits for the answer before its next piece keeps them in order."""
        assert self._sessions is not None
        try:
            self._sessions.send(call)
        except Exception as exc:
            self._fail(sender, exc)
            return
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _fail(self, sender: Any, exc: Exception) -> None:
        sender.send(
            pb_utils.InferenceResponse(error=self._error(exc)), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )

    def _run_session(
        self, request: Any, sender: Any, call: SessionCall, stream_id: str, tensors: dict[str, Any]
    ) -> None:
        sessions = self._sessions
        assert sessions is not None
        request_id = request.request_id()
        self.send_stream(
            sender, lambda: sessions.run(call, stream_id, tensors, self._watch(request), request_id=request_id)
        )

    def finalize(self) -> None:
        if self._sessions is not None:
            self._sessions.close_all()
        if self._pieces is not None:
            self._pieces.shutdown(wait=True)
        super().finalize()
        self._llm.close()

    def synthesize(self, speech: SynthesisRequest, cancelled: Cancelled) -> Iterator[NDArray[np.float32]]:
        # Stream workers only wait on the stage models, which do the heavy work in their own processes.
        return self._pipeline.synthesize(speech, streaming=self.decoupled, is_cancelled=cancelled)
