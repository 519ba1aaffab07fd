"""The base of every Triton Python model of the package: what each ``triton_repo/*/1/model.py`` builds on.

Imported only inside Triton (it needs ``triton_python_backend_utils``). It keeps the backend's
contract (``initialize``/``execute``/``finalize``) and does what every model does on loading: stack
dumps on a signal and the allocator's heap settings (before the model's own setup, so that a model
with thresholds of its own sets them last), the model's name and string parameters read from the
config, and its Python log records forwarded to Triton's log. A model implements :meth:`setup` and
:meth:`execute`; the speech contract's models extend
:class:`~tts_gateway.models.triton_speech_model.SpeechContractModel` instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from tts_gateway.allocator import keep_tensors_in_heap
from tts_gateway.models.triton_logging import enable_stack_dumps, forward_to_triton


class TritonModel:
    """Subclasses implement :meth:`setup` and :meth:`execute`, and :meth:`finalize` if they hold threads."""

    def initialize(self, args: dict[str, str]) -> None:
        enable_stack_dumps()
        keep_tensors_in_heap()
        self.args = args
        self.config: dict[str, Any] = json.loads(args["model_config"])
        # Triton's JSON leaves out empty string values, hence the default.
        self.params = {key: value.get("string_value", "") for key, value in self.config["parameters"].items()}
        self.name = args["model_name"]
        self.decoupled = bool(pb_utils.using_decoupled_model_transaction_policy(self.config))
        self.input_names = [spec["name"] for spec in self.config["input"]]
        forward_to_triton(pb_utils.Logger, self.name)
        self.setup(self.params)

    def setup(self, params: dict[str, str]) -> None:
        """Load the model from the config's string parameters."""
        raise NotImplementedError

    def execute(self, requests: list[Any]) -> list[Any] | None:
        raise NotImplementedError

    def finalize(self) -> None:
        """Nothing to release unless a subclass holds threads or files."""

    @property
    def instances(self) -> int:
        """Instances of this model in the server (one process each): state kept in one is not in the others."""
        return sum(int(group.get("count", 1)) for group in self.config.get("instance_group", []))

    @staticmethod
    def arrays(request: Any, names: Iterable[str]) -> dict[str, np.ndarray]:
        """The request's inputs among ``names`` as arrays; an optional input it leaves out is absent."""
        arrays = {}
        for name in names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                arrays[name] = tensor.as_numpy()
        return arrays

    @staticmethod
    def error(message: str, code: Any) -> Any:
        """A response that fails with ``code`` (a ``TritonError`` code)."""
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
