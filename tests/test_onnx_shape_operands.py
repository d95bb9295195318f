"""Importer fixes found by the encoder exports of issue #27 (DeBERTa-v2), each against ONNX
Runtime at several sizes of the dynamic dims:

- ``Tile`` whose repeats are a shape value (``Concat(Shape(y)[:1], [1])``): the importer
  refused it ("cannot handle ShapeExpr inputs"); ``cast_shape_operands`` hands it over as an
  int64 tensor and our ``Tile`` converter tiles with symbolic dims (a graph input as repeats, a
  must-not-fire case, keeps stock's dynamic tile);
- ``Clip`` of a ``Range`` over a dynamic axis, next to elementwise ops: stock's ``emit_te``
  kernels kept the import's ``range_len_0`` and FuseTIR refused them once PlaceShapeOnHost had
  bound it ("Inconsistent buffers");
- ``Concat`` of a shape value with an int64 tensor that is not a constant (issue #40, CLIP's
  TorchScript export with a dynamic batch): stock handed ``relax.concat`` the shape ("expects
  the input to be a Tuple of Tensors").
"""

import numpy as np
import pytest
from onnx import helper

from tvm_fusion import analysis, host_target, load_onnx
from tvm_fusion.build import engine
from tvm_fusion.frontend.onnx_shape_operands import cast_operands_of, cast_shape_operands
from tvm_fusion.models._build import onnx_input, onnx_model

ort = pytest.importorskip("onnxruntime")


def _check(model, feeds_list):
    compiled = engine.compile_module(load_onnx(model), host_target(), "tvm_fusion")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for feeds in feeds_list:
        want = session.run(None, feeds)
        got = engine.TvmRunner(compiled, list(feeds.values())).outputs()
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    return compiled


def _tile_model(reps_from_shape: bool):
    """``Tile(x, [len(y), 1])`` with x (n, 4): repeats from ``Shape(y)`` or a graph input."""
    nodes = [helper.make_node("Tile", ["x", "reps"], ["t"]), helper.make_node("Relu", ["t"], ["z"])]
    inputs = [onnx_input("x", "float32", ["n", 4])]
    inits = {}
    if reps_from_shape:
        nodes[:0] = [
            helper.make_node("Shape", ["y"], ["shp"]),
            helper.make_node("Slice", ["shp", "zero", "one"], ["b"]),
            helper.make_node("Concat", ["b", "one"], ["reps"], axis=0),
        ]
        inputs.append(onnx_input("y", "float32", ["b", 2]))
        inits = {"zero": np.array([0], "int64"), "one": np.array([1], "int64")}
    else:
        inputs.append(onnx_input("reps", "int64", [2]))
    return onnx_model(nodes, inputs, [onnx_input("z", "float32", ["m", 4])], inits, opset=17)


def test_tile_repeats_from_a_shape_match_onnxruntime():
    model = _tile_model(reps_from_shape=True)
    assert cast_shape_operands(model)[1] == 1
    rng = np.random.default_rng(0)
    feeds = [
        {"x": rng.standard_normal((n, 4)).astype("float32"), "y": np.zeros((b, 2), "float32")}
        for n, b in [(2, 3), (5, 1), (1, 4)]
    ]
    compiled = _check(model, feeds)
    # tiled as reshape / broadcast_to / reshape with symbolic dims: no dyn_tile kernel
    assert "dyn_tile" not in compiled.lowered.script()


def test_tile_repeats_from_a_graph_input_left_to_stock():
    """Repeats that are data (a graph input): no Cast inserted, stock's dynamic tile."""
    model = _tile_model(reps_from_shape=False)
    assert cast_shape_operands(model)[1] == 1  # a graph input is not a constant: cast (no-op)
    mod = load_onnx(model)
    assert "tile" in mod.script()


def test_constant_tile_repeats_get_no_cast():
    model = _tile_model(reps_from_shape=False)
    model.graph.ClearField("input")
    model.graph.input.append(onnx_input("x", "float32", ["n", 4]))
    from onnx import numpy_helper

    model.graph.initializer.append(numpy_helper.from_array(np.array([2, 1], "int64"), "reps"))
    assert cast_shape_operands(model) == (model, 0)


def test_clip_of_a_dynamic_range_fuses_and_matches_onnxruntime():
    """DeBERTa's relative positions: ``clip(i - j + 1, 0, 5)``, i over ``Range(0, Shape(x)[0])``
    and j over ``Range(0, int64(squeeze(Shape(x)[1:2])))`` (a ``range_len_0`` at import), then
    cast and multiplied into x (n, n)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"]),
        helper.make_node("Slice", ["shp", "one", "two"], ["n1"]),
        helper.make_node("Squeeze", ["n1", "zero"], ["n0"]),
        helper.make_node("Cast", ["n0"], ["n"], to=7),
        helper.make_node("Range", ["zero_s", "n", "one_s"], ["r"]),
        helper.make_node("Gather", ["shp", "zero_s"], ["m"], axis=0),
        helper.make_node("Range", ["zero_s", "m", "one_s"], ["q"]),
        helper.make_node("Unsqueeze", ["r", "zero"], ["row"]),
        helper.make_node("Unsqueeze", ["q", "one"], ["col"]),
        helper.make_node("Sub", ["col", "row"], ["d"]),
        helper.make_node("Add", ["d", "one_s"], ["d1"]),
        helper.make_node("Clip", ["d1", "zero_s", "five"], ["c"]),
        helper.make_node("Cast", ["c"], ["cf"], to=1),
        helper.make_node("Mul", ["x", "cf"], ["y"]),
    ]
    inits = {
        "zero_s": np.array(0, "int64"),
        "one_s": np.array(1, "int64"),
        "five": np.array(5, "int64"),
        "zero": np.array([0], "int64"),
        "one": np.array([1], "int64"),
        "two": np.array([2], "int64"),
    }
    model = onnx_model(
        nodes,
        [onnx_input("x", "float32", ["n", "n"])],
        [onnx_input("y", "float32", ["n", "n"])],
        inits,
        opset=17,
    )
    rng = np.random.default_rng(1)
    _check(model, [{"x": rng.standard_normal((n, n)).astype("float32")} for n in (7, 3, 1)])


def _scaled_reshape_model():
    """``Reshape(x, [Shape(x)[0] * 2, 2])`` with x (n, 4): the product of a shape number is
    a ``Mul`` of a shape value, which the importer refused ("Node twice cannot handle ShapeExpr
    inputs"; stock TVM fails the same way)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"], name="shape"),
        helper.make_node("Gather", ["shp", "zero"], ["n"], name="rows", axis=0),
        helper.make_node("Mul", ["n", "two"], ["n2"], name="twice"),
        helper.make_node("Concat", ["n2", "two"], ["target"], name="target", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"], name="reshape"),
        helper.make_node("Relu", ["r"], ["z"], name="relu"),
    ]
    inits = {"zero": np.array([0], "int64"), "two": np.array([2], "int64")}
    inputs = [onnx_input("x", "float32", ["n", 4])]
    return onnx_model(nodes, inputs, [onnx_input("z", "float32", ["m", 2])], inits, opset=17)


def test_arithmetic_on_a_shape_value_is_imported_and_matches_onnxruntime():
    """load_onnx casts the refused node's shape operands to int64 tensors and imports again;
    PlaceShapeOnHost folds the product back into a symbolic reshape (no shape kernel)."""
    model = _scaled_reshape_model()
    assert cast_operands_of(model, "twice")[1] == 1
    assert cast_operands_of(model, "relu") == (model, 0)  # no shape operand: unchanged
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((n, 4)).astype("float32")} for n in (3, 1, 8)]
    compiled = _check(model, feeds)
    assert analysis.shape_work(compiled.lowered, host_target()).kernels == []


def _concat_model(tensor_from: str):
    """``Concat(Shape(x), t)`` with x (n, 4) and t an int64 tensor that is not a constant:
    ``Unsqueeze(Cast(Shape(x)[0]))`` (CLIP's TorchScript export, the causal mask's shape), or
    a graph input; the result times 2, and a ``ConstantOfShape`` of it."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Concat", ["s", "t"], ["cat"], axis=0),
        helper.make_node("Mul", ["cat", "two"], ["twice"]),
        helper.make_node("ConstantOfShape", ["cat"], ["z"]),
    ]
    inputs = [onnx_input("x", "float32", ["n", 4])]
    if tensor_from == "shape":
        nodes[1:1] = [
            helper.make_node("Shape", ["x"], ["s2"]),
            helper.make_node("Gather", ["s2", "zero"], ["b"], axis=0),
            helper.make_node("Unsqueeze", ["b", "ax0"], ["b1"]),
            helper.make_node("Cast", ["b1"], ["t"], to=7),  # INT64
        ]
    else:
        inputs.append(onnx_input("t", "int64", [1]))
    inits = {
        "zero": np.array(0, "int64"),
        "ax0": np.array([0], "int64"),
        "two": np.array(2, "int64"),
    }
    outputs = [onnx_input("twice", "int64", [3]), onnx_input("z", "float32", ["a", "b", "c"])]
    return onnx_model(nodes, inputs, outputs, inits, opset=17)


@pytest.mark.parametrize("tensor_from", ["shape", "input"])
def test_concat_of_a_shape_value_and_an_int64_tensor_matches_onnxruntime(tensor_from):
    """Stock hands ``relax.concat`` the shape value ("expects the input to be a Tuple of
    Tensors"); ours concatenates the shape as an int64 tensor; dynamic n at two sizes."""
    model = _concat_model(tensor_from)
    feeds = []
    for n, k in ((2, 3), (5, 1)):
        feed = {"x": np.random.default_rng(n).standard_normal((n, 4)).astype("float32")}
        if tensor_from == "input":
            feed["t"] = np.array([k], "int64")
        feeds.append(feed)
    _check(model, feeds)
