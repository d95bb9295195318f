"""ONNX Sum / Mean of tensors as elementwise adds (frontend/onnx_variadic.py), against ONNX
Runtime: broadcasting inputs, symbolic dims, and ResNet's ``Conv -> Sum(., shortcut) -> Relu``
as one kernel (stock's stack + sum kept the residual add and the ReLU apart)."""

import numpy as np
import pytest
from helpers import matches_reference
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion import load_onnx
from tvm_fusion.build import engine
from tvm_fusion.target import host_target
from tvm_fusion.tools import analysis

RNG = np.random.default_rng(3)


def _model(op, shapes, out_shape):
    names = [f"x{i}" for i in range(len(shapes))]
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"])],
        op.lower(),
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
            for n, s in zip(names, shapes, strict=True)
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _ort(model, feeds):
    return engine.onnxruntime_runner(model, feeds, 1)()


@pytest.mark.parametrize("op", ["Sum", "Mean"])
def test_broadcasting_inputs_match_ort(op):
    shapes = [(2, 3, 4), (3, 1), (4,)]
    model = _model(op, shapes, [2, 3, 4])
    mod = load_onnx(model)
    text = mod.script()
    assert "R.stack" not in text and "R.add" in text
    feeds = {f"x{i}": RNG.standard_normal(s).astype("float32") for i, s in enumerate(shapes)}
    matches_reference(mod, [(list(feeds.values()), _ort(model, feeds))], rtol=1e-6, atol=1e-6)


def test_symbolic_dims_match_ort():
    shapes = [["n", 5], ["n", 5], [1, 5], ["n", 5]]
    model = _model("Sum", shapes, ["n", 5])
    cases = []
    for n in (1, 7):
        feeds = {f"x{i}": RNG.standard_normal((n if s[0] == "n" else 1, 5)).astype("float32")
                 for i, s in enumerate(shapes)}  # fmt: skip
        cases.append((list(feeds.values()), _ort(model, feeds)))
    matches_reference(load_onnx(model), cases, rtol=1e-6, atol=1e-6)


def test_residual_sum_joins_the_conv_kernel():
    w = RNG.standard_normal((8, 8, 3, 3)).astype("float32")
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Sum", ["c", "x"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 6, 6])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    x = RNG.standard_normal((1, 8, 6, 6)).astype("float32")
    compiled = matches_reference(load_onnx(model), [([x], _ort(model, {"x": x}))], rtol=1e-4,
                                 atol=1e-4, target=host_target())  # fmt: skip
    assert analysis.kernel_count(compiled.lowered) == 1
