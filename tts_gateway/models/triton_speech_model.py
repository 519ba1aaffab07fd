"""Base of the Triton Python models that serve the speech contract, over :mod:`tts_gateway.models.triton_model`.

Imported only inside Triton (it needs ``triton_python_backend_utils``). A subclass
sets itself up from the config parameters and yields audio chunks for a parsed
:class:`~tts_gateway.models.request_parsing.SynthesisRequest`; this class does the rest the
same way for every speech model:

- offline deployment: one response with the whole waveform;
- decoupled deployment (``NAME_stream``): each request runs on a bounded worker pool
  so that ``execute`` returns at once, one response per chunk, then the final flag (an
  error is sent as the final response itself);
- cancellation (client gone, or the model unloading) is checked between chunks;
- :class:`ContractError` becomes ``INVALID_ARG``, :class:`DependencyUnavailableError`
  ``UNAVAILABLE`` (logged as a warning); anything else is logged and
  returned as an internal error without details. The code also leads the message
  (``[INVALID_ARG] ...``): a decoupled model's error reaches gRPC clients as a message only.
"""

from __future__ import annotations

import dataclasses
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from numpy.typing import NDArray

from tts_gateway.models import contract
from tts_gateway.models.request_parsing import (
    ContractError,
    DependencyUnavailableError,
    SynthesisRequest,
    parse_synthesis_request,
)
from tts_gateway.models.triton_model import TritonModel

Cancelled = Callable[[], bool]


class SpeechContractModel(TritonModel):
    """Subclasses implement :meth:`setup` and :meth:`synthesize`."""

    def initialize(self, args: dict[str, str]) -> None:
        self._unloading = threading.Event()
        self._pool: ThreadPoolExecutor | None = None
        super().initialize(args)
        if self.decoupled:
            workers = int(self.params["stream_workers"])
            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self.name)

    def synthesize(self, speech: SynthesisRequest, cancelled: Cancelled) -> Iterator[NDArray[np.float32]]:
        """Audio chunks for ``speech``; stop early once ``cancelled()`` is true."""
        raise NotImplementedError

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if self._pool is None:
            return [self._answer(request) for request in requests]
        for request in requests:
            self._pool.submit(self._stream, request, request.get_response_sender())
        return None

    def finalize(self) -> None:
        if self._pool is not None:
            # Running and queued streams stop at their next chunk, each with a final response.
            self._unloading.set()
            self._pool.shutdown(wait=True)

    def _answer(self, request: Any) -> Any:
        cancelled = self._watch(request)
        try:
            chunks = list(self._chunks(request, cancelled))
        except Exception as exc:
            return pb_utils.InferenceResponse(error=self._error(exc))
        if cancelled():
            return self.error("cancelled", pb_utils.TritonError.CANCELLED)
        waveform = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
        return pb_utils.InferenceResponse([pb_utils.Tensor(contract.WAVEFORM, waveform)])

    def _stream(self, request: Any, sender: Any) -> None:
        self.send_stream(sender, lambda: self._chunks(request, self._watch(request)))

    def send_stream(self, sender: Any, chunks: Callable[[], Iterator[NDArray[np.float32]]]) -> None:
        """Send the chunks, then end the stream; an error is the final response itself.

        An error followed by a separate final flag crashed Triton 2.51 now and then (SIGSEGV in the
        server, every model's requests lost): a client that sees the error cancels the stream, and
        the cancellation met the server completing it.
        """
        final = None
        try:
            for chunk in chunks():
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(contract.WAVEFORM, chunk)]))
            if self._unloading.is_set():
                error = pb_utils.TritonError(
                    f"[UNAVAILABLE] model {self.name} is unloading", pb_utils.TritonError.UNAVAILABLE
                )
                final = pb_utils.InferenceResponse(error=error)
        except Exception as exc:
            final = pb_utils.InferenceResponse(error=self._error(exc))
        finally:
            # None sends the final flag alone.
            sender.send(final, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _chunks(self, request: Any, cancelled: Cancelled) -> Iterator[NDArray[np.float32]]:
        if cancelled():
            return  # the client left while the request waited for a worker
        arrays = self.arrays(request, self.input_names)
        speech = dataclasses.replace(parse_synthesis_request(arrays), request_id=request.request_id())
        for chunk in self.synthesize(speech, cancelled):
            if cancelled():
                return
            yield chunk

    def _watch(self, request: Any) -> Cancelled:
        """A cancellation check for ``request`` that logs the first time it fires."""
        logged = False

        def cancelled() -> bool:
            nonlocal logged
            if self._unloading.is_set():
                return True
            if not request.is_cancelled():
                return False
            if not logged:
                pb_utils.Logger.log_info(f"{self.name}: request {request.request_id()!r} cancelled")
                logged = True
            return True

        return cancelled

    def _error(self, exc: Exception) -> Any:
        if isinstance(exc, ContractError):
            return pb_utils.TritonError(f"{contract.INVALID_ARG_PREFIX} {exc}", pb_utils.TritonError.INVALID_ARG)
        if isinstance(exc, DependencyUnavailableError):
            pb_utils.Logger.log_warn(f"{self.name}: {exc}")
            # The details (addresses of internal servers) stay in the log.
            message = f"[UNAVAILABLE] model {self.name}: a server it relies on is unavailable; see the server log"
            return pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE)
        pb_utils.Logger.log_error(f"{self.name}: synthesis failed\n{traceback.format_exc()}")
        return pb_utils.TritonError(f"model {self.name} failed; see the server log", pb_utils.TritonError.INTERNAL)
