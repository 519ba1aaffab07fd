"""The token2wav Triton model (flow + HiFT): speech tokens -> 24 kHz audio, batched across requests.

Imported only inside Triton (it needs ``triton_python_backend_utils``); ``triton_repo/token2wav/1/model.py``
loads the converter from its parameters, this class serves it.

Offline calls omit ``token_offset``/``finalize``. Streaming calls carry them and keep the
request's vocoder state under ``session_id``; a finalising call without tokens abandons
the session (its stream was cancelled).

``execute`` only queues the calls of each batch Triton hands it and returns; the queue's worker
converts them a group at a time, streams' first chunks before everything else, and each call is
answered through its response sender as soon as its group is converted (``token2wav_queue.py``); once the
queue stands idle, the process's free heap goes back to the kernel.
Streaming state lives in this process, so every profile deploys exactly one instance: with two,
Triton would send a session's chunks to either process.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from tts_gateway.allocator import release_free_memory
from tts_gateway.models.cosyvoice2 import tensors
from tts_gateway.models.cosyvoice2.engines.gpu_turns import GpuTurns
from tts_gateway.models.cosyvoice2.engines.playback_guard import PlaybackGuard
from tts_gateway.models.cosyvoice2.engines.token2wav import Conversion, Token2Wav
from tts_gateway.models.cosyvoice2.engines.token2wav_queue import ConversionQueue, Converted, QueueClosed
from tts_gateway.models.cosyvoice2.model.frontend import VoicePrompt
from tts_gateway.models.stage_trace import StageTrace
from tts_gateway.models.triton_model import TritonModel


class Token2WavModel(TritonModel):
    """Subclasses implement :meth:`load`."""

    def load(self, params: dict[str, str], device: str) -> Token2Wav:
        """The converter, on ``device``, from the config's string parameters."""
        raise NotImplementedError

    def setup(self, params: dict[str, str]) -> None:
        device = params["device"]
        if device == "cuda" and self.args.get("model_instance_kind") == "GPU":
            device = f"cuda:{self.args['model_instance_device_id']}"
        self._token2wav = self.load(params, device)
        self._trace = StageTrace.from_env("token2wav")
        self._token2wav.sync_timing = self._trace.enabled
        # First chunks on the GPU are marked, so that the LLM's process leaves it to them (gpu_turns.py).
        gpu = torch.device(device)
        self._turns = GpuTurns.of_server(gpu.index or 0) if gpu.type == "cuda" else None
        turns, slot = self._turns, int(self.args.get("model_instance_device_id", 0) or 0)
        self._queue = ConversionQueue(
            self._token2wav,
            max_rows=int(self.config["max_batch_size"]),
            first_chunks_hold=None if turns is None else lambda: turns.hold(slot),
            log_error=pb_utils.Logger.log_error,
            playback_guard=PlaybackGuard.parse(params["playback_guard_ms"]),
            sample_rate=self._token2wav.sample_rate,
            gather_s=float(params["gather_ms"]) / 1000.0,
            idle_release=release_free_memory,
        )

    def execute(self, requests: list[Any]) -> None:
        """Queues every request's call; each is answered through its response sender once converted."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                call = tensors.parse_token2wav_inputs(self.arrays(request, tensors.TOKEN2WAV_INPUT_DTYPES))
                if call.token_offset is not None and call.speed != 1.0:
                    raise tensors.TensorError("speed is applied offline only; stream at speed 1.0")
            except tensors.TensorError as exc:
                self._send(sender, self.error(str(exc), pb_utils.TritonError.INVALID_ARG))
                continue
            if call.token_offset is not None and call.finalize and call.speech_tokens.size == 0:
                self._token2wav.release(call.session_id)
                self._send(sender, _waveform(np.zeros(0, dtype=np.float32)))
                continue
            prompt = VoicePrompt(
                speech_tokens=call.prompt_speech_tokens, feats=call.prompt_feat, embedding=call.embedding
            )
            conversion = Conversion(
                call.session_id, call.speech_tokens, prompt, call.token_offset, call.finalize, call.speed
            )
            try:
                self._queue.submit(
                    conversion, lambda result, group, c=conversion, s=sender: self._answer(c, s, result, group)
                )
            except QueueClosed as exc:
                self._send(sender, self.error(str(exc), pb_utils.TritonError.UNAVAILABLE))
        return None

    def finalize(self) -> None:
        self._queue.close()
        # Whichever of the two processes ends last leaves no file behind (removing is idempotent).
        if self._turns is not None:
            self._turns.remove()

    def _answer(self, call: Conversion, sender: Any, result: np.ndarray | Exception, group: Converted) -> None:
        """Runs on the queue's worker thread, right after the call's group was converted."""
        if isinstance(result, ValueError):
            self._send(sender, self.error(str(result), pb_utils.TritonError.INVALID_ARG))
        elif isinstance(result, QueueClosed):
            self._send(sender, self.error(str(result), pb_utils.TritonError.UNAVAILABLE))
        elif isinstance(result, Exception):
            self._send(sender, self.error(f"model {self.name} failed: {result}", pb_utils.TritonError.INTERNAL))
        else:
            self._send(sender, _waveform(result))
            try:
                self._record(call, group)
            except Exception:
                pb_utils.Logger.log_error(f"{self.name}: tracing a call failed\n{traceback.format_exc()}")

    def _send(self, sender: Any, response: Any) -> None:
        try:
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            pb_utils.Logger.log_error(f"{self.name}: sending a response failed\n{traceback.format_exc()}")

    def _record(self, call: Conversion, group: Converted) -> None:
        """Trace one answered call: its group's flow and HiFT time (``last_timing`` holds that group's)."""
        if not self._trace.enabled:
            return
        timing = self._token2wav.last_timing
        self._trace.record(
            call.session_id,
            offset=-1 if call.token_offset is None else call.token_offset,
            started=group.started,
            ended=time.monotonic(),
            rows=group.rows,
            frames=timing.get("frames", 0.0),
            flow_s=timing.get("flow_s", 0.0),
            hift_s=timing.get("hift_s", 0.0),
        )


def _waveform(samples: np.ndarray) -> Any:
    return pb_utils.InferenceResponse([pb_utils.Tensor(tensors.WAVEFORM_OUTPUT, samples.reshape(1, -1))])
