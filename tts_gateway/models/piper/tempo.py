"""A Piper voice graph whose ``length_scale`` changes every duration in proportion.

A Piper (VITS) voice predicts a duration per phoneme id, multiplies it by ``length_scale``
and rounds each one up to whole frames (``Ceil``) before expanding the phonemes into frames.
Rounding each phoneme after scaling is what bends the tempo: at 4 times the speed every short
phoneme (and the pad between phonemes) still takes a whole frame, so a request came out at
about half its length instead of a quarter; at a quarter of the speed the frames rounded up
at the natural tempo are not there to be multiplied, so it came out 3.3 times longer, not 4.

The patched graph rounds at the voice's natural ``length_scale``, exactly as at speed 1, and
only then scales the whole frames by ``length_scale / natural``. The frame expansion compares
the running sum of durations with the frame index, so fractional durations share frames
between neighbours and the total stays proportional. At speed 1 the scale is 1 and the graph
computes what the original does.

Slowing down leaves the sentence's leading silence (the start marker and the pad after it)
as long as at speed 1, and adds the time it would have taken to the trailing silence: the
response starts as soon as at speed 1, and the pause between two sentences (one's trailing
silence, then the next one's leading) still grows by ``1 / speed``.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Phoneme ids of the leading silence: the start marker "^" and the pad that follows it.
LEADING_IDS: Final = 2

_PREFIX: Final = "proportional_tempo/"


def proportional_tempo(model: onnx.ModelProto, natural_length_scale: float) -> onnx.ModelProto:
    """Patch ``model`` (a Piper voice) in place so durations scale exactly; returns it.

    Raises ``ValueError`` when the graph does not have the single ``Ceil`` over the scaled
    durations that Piper's export produces.
    """
    graph = model.graph
    ceils = [node for node in graph.node if node.op_type == "Ceil"]
    if len(ceils) != 1:
        raise ValueError(f"expected one Ceil (the duration rounding) in the voice graph, found {len(ceils)}")
    ceil = ceils[0]
    scaled = ceil.input[0]
    producer = next((node for node in graph.node if scaled in node.output), None)
    if producer is None or producer.op_type != "Mul":
        raise ValueError("the voice graph's durations are not scaled by a Mul before rounding")
    # Durations times the mask, times length_scale (gathered from the "scales" input).
    length_scale = producer.input[1]

    def name(part: str) -> str:
        return _PREFIX + part

    constants = {
        "natural": np.array(natural_length_scale, dtype=np.float32),
        "one": np.array(1.0, dtype=np.float32),
        "axis": np.array([2], dtype=np.int64),
        "start": np.array([0], dtype=np.int64),
        "lead_end": np.array([LEADING_IDS], dtype=np.int64),
        "last": np.array([-1], dtype=np.int64),
        "end": np.array([np.iinfo(np.int64).max], dtype=np.int64),
    }
    graph.initializer.extend(numpy_helper.from_array(value, name(key)) for key, value in constants.items())
    nodes = [
        # ratio = length_scale / natural; frames = ceil(durations at the natural scale)
        helper.make_node("Div", [length_scale, name("natural")], [name("ratio")]),
        helper.make_node("Div", [scaled, name("ratio")], [name("natural_durations")]),
        helper.make_node("Ceil", [name("natural_durations")], [name("frames")]),
        # [1, 1, ids]: leading silence | middle | the end marker
        helper.make_node(
            "Slice", [name("frames"), name("start"), name("lead_end"), name("axis")], [name("lead_frames")]
        ),
        helper.make_node(
            "Slice", [name("frames"), name("lead_end"), name("last"), name("axis")], [name("middle_frames")]
        ),
        helper.make_node("Slice", [name("frames"), name("last"), name("end"), name("axis")], [name("last_frames")]),
        # The leading silence never grows; what slowing down would add to it goes to the end.
        helper.make_node("Min", [name("ratio"), name("one")], [name("lead_ratio")]),
        helper.make_node("Mul", [name("lead_frames"), name("lead_ratio")], [name("lead")]),
        helper.make_node("Mul", [name("middle_frames"), name("ratio")], [name("middle")]),
        helper.make_node("Sub", [name("ratio"), name("lead_ratio")], [name("moved_ratio")]),
        helper.make_node("ReduceSum", [name("lead_frames"), name("axis")], [name("lead_total")], keepdims=1),
        helper.make_node("Mul", [name("lead_total"), name("moved_ratio")], [name("moved")]),
        helper.make_node("Mul", [name("last_frames"), name("ratio")], [name("last_scaled")]),
        helper.make_node("Add", [name("last_scaled"), name("moved")], [name("end_marker")]),
        helper.make_node("Concat", [name("lead"), name("middle"), name("end_marker")], list(ceil.output), axis=2),
    ]
    position = list(graph.node).index(ceil)
    graph.node.remove(ceil)
    for offset, node in enumerate(nodes):
        graph.node.insert(position + offset, node)
    onnx.checker.check_model(model)
    return model
