"""ONNX ``Sum`` imports as pairwise adds (frontend/onnx_variadic.py; not stock's
``sum(stack(inputs))``): the numbers of onnxruntime with broadcasting, 1 to 3 inputs and a
symbolic dim; the ``Sum`` and the ``Relu`` after it are one elementwise kernel; a ``Sum`` of
constants is still folded."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion import analysis, load_onnx
from tvm_fusion.build import engine

ort = pytest.importorskip("onnxruntime")
RNG = np.random.default_rng(7)


def _model(shapes, relu=False, consts=()):
    names = [f"x{i}" for i in range(len(shapes))]
    nodes = [helper.make_node("Sum", names + [c[0] for c in consts], ["s"])]
    nodes.append(helper.make_node("Relu" if relu else "Identity", ["s"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "sum",
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
            for n, s in zip(names, shapes, strict=True)
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, n) for n, v in consts],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize(
    "shapes",
    [[["n", 3, 4]], [["n", 3, 4], [3, 4]], [["n", 3, 4], [1, 1, 4], ["n", 3, 1]]],
    ids=["one", "two_broadcast", "three_broadcast"],
)
def test_sum_numbers_and_kernels(shapes, target):
    model = _model(shapes, relu=True)
    mod = load_onnx(model)
    text = mod.script()
    assert "R.stack" not in text and "R.sum" not in text, text
    compiled = engine.compile_module(mod, target, "tvm_fusion")
    for n in (1, 2):
        dims = [[n if d == "n" else d for d in s] for s in shapes]
        xs = [RNG.standard_normal(d).astype("float32") for d in dims]
        (got,) = engine.TvmRunner(compiled, xs).outputs()
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        (ref,) = sess.run(None, {f"x{i}": x for i, x in enumerate(xs)})
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    # the adds and the ReLU: one elementwise kernel, no reduction
    rules = [i.rule for i in analysis.schedule_info(compiled.lowered)]
    assert len(rules) == 1 and "RowReduction" not in rules, rules


def test_sum_with_a_constant(target):
    c = RNG.standard_normal((3, 4)).astype("float32")
    model = _model([[2, 3, 4]], consts=[("c", c)])
    x = RNG.standard_normal((2, 3, 4)).astype("float32")
    compiled = engine.compile_module(load_onnx(model), target, "tvm_fusion")
    (got,) = engine.TvmRunner(compiled, [x]).outputs()
    np.testing.assert_allclose(got, x + c, rtol=1e-6, atol=1e-6)
