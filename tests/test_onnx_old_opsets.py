"""Models below opset 11 whose old operator forms stock refuses (Resize 10, Upsample 9, Slice
with attributes) import after ONNX's version converter (``load._newer_opset``, with opset 10's
asymmetric coordinates and floor for nearest made explicit), against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import run
from onnx import helper, numpy_helper

from tvm_fusion import load_onnx
from tvm_fusion.errors import ModelError
from tvm_fusion.frontend import load

ort = pytest.importorskip("onnxruntime")


def _model(node, shape, out, opset, scales=None):
    inits = [] if scales is None else [numpy_helper.from_array(np.array(scales, np.float32), "s")]
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", 1, shape)],
        [helper.make_tensor_value_info("y", 1, out)],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    return model


CASES = {
    "resize10_nearest_x3": (
        lambda: _model(helper.make_node("Resize", ["x", "s"], ["y"]), [1, 1, 5, 7], [1, 1, 15, 7],
                       10, [1, 1, 3, 1]),
        (1, 1, 5, 7),
    ),
    "resize10_linear_x2": (
        lambda: _model(helper.make_node("Resize", ["x", "s"], ["y"], mode="linear"),
                       [1, 2, 3, 4], [1, 2, 6, 8], 10, [1, 1, 2, 2]),
        (1, 2, 3, 4),
    ),
    "upsample9_nearest": (
        lambda: _model(helper.make_node("Upsample", ["x", "s"], ["y"]), [1, 2, 3, 4],
                       [1, 2, 6, 8], 9, [1, 1, 2, 2]),
        (1, 2, 3, 4),
    ),
    "upsample9_linear": (
        lambda: _model(helper.make_node("Upsample", ["x", "s"], ["y"], mode="linear"),
                       [1, 1, 5, 7], [1, 1, 15, 7], 9, [1, 1, 3, 1]),
        (1, 1, 5, 7),
    ),
    "slice9": (
        lambda: _model(helper.make_node("Slice", ["x"], ["y"], starts=[1], ends=[4], axes=[1]),
                       [2, 5], [2, 3], 9),
        (2, 5),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_old_forms_match_onnxruntime(name):
    build, shape = CASES[name]
    model = build()
    assert load._newer_opset(model) is not None
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"x": x})
    (got,), _ = run(load_onnx(model), [x])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_newer_opsets_are_not_converted_and_refusals_stay_one_line():
    """Must not fire at opset 11 on; a converted model still refused says why (a Resize by
    1.5 of 5 pixels: not a whole extent)."""
    build, _ = CASES["resize10_linear_x2"]
    model = build()
    model.opset_import[0].version = 11
    assert load._newer_opset(model) is None
    node = helper.make_node("Resize", ["x", "s"], ["y"], name="up")
    odd = _model(node, [1, 1, 5, 7], [1, 1, 7, 7], 10, [1, 1, 1.5, 1])
    with pytest.raises(ModelError, match="scale 1.5 on axis 2"):
        load_onnx(odd)
