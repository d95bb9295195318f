"""Operands known at run time only (issue #40, ``tvm_fusion/frontend/onnx_dynamic.py``), each
against ONNX Runtime at several sizes of a dynamic dim: ``Pad`` with ``pads`` / ``axes`` /
``constant_value`` as graph inputs or computed from ``Shape`` (modes constant / edge / reflect
/ wrap, negative pads), ``Split`` with run-time sizes (zero-sized parts), the function-expanded
``LayerNormalization`` (``Size(Shape(x))``) at a dynamic batch; and the run-time checks that
refuse what would read out of bounds (a reflect pad as wide as the axis, sizes that do not add
up) with a ``ValueError`` naming the node, never a wrong number."""

import numpy as np
import onnx
import pytest
from onnx import helper

from tvm_fusion import host_target, load_onnx
from tvm_fusion.build import engine
from tvm_fusion.models._build import onnx_input, onnx_model

ort = pytest.importorskip("onnxruntime")


def _out(name, rank=3):
    return onnx_input(name, "float32", [f"{name}_{i}" for i in range(rank)])


def _compiled(model):
    return engine.compile_module(load_onnx(model), host_target(), "tvm_fusion")


def _check(model, feeds_list):
    compiled = _compiled(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for feeds in feeds_list:
        want = session.run(None, feeds)
        got = engine.TvmRunner(compiled, list(feeds.values())).outputs()
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    return compiled


def _pad_model(mode: str, axes: bool = False, value: bool = False):
    """``Pad(x, pads[, value][, axes])`` of x (n, 5, 3), every operand a graph input."""
    inputs = [
        onnx_input("x", "float32", ["n", 5, 3]),
        onnx_input("pads", "int64", [4 if axes else 6]),
    ]
    names = ["x", "pads", "value" if value else ""]
    if value:
        inputs.append(onnx_input("value", "float32", []))
    if axes:
        inputs.append(onnx_input("axes", "int64", [2]))
        names.append("axes")
    node = helper.make_node("Pad", names, ["y"], mode=mode, name="the_pad")
    return onnx_model([node], inputs, [_out("y")], {}, opset=19)


def _x(n, rng):
    return rng.standard_normal((n, 5, 3)).astype("float32")


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect", "wrap"])
def test_pad_with_runtime_pads_matches_onnxruntime(mode):
    rng = np.random.default_rng(0)
    pads = [[0, 2, 1, 1, 3, 2], [1, -1, 0, 0, 2, -1], [0, -2, 2, 0, 1, 0]]
    feeds = [
        {"x": _x(n, rng), "pads": np.array(p, "int64")}
        for n, p in zip((2, 3, 1), pads, strict=True)
    ]
    _check(_pad_model(mode), feeds)


def test_pad_with_runtime_axes_and_value_matches_onnxruntime():
    rng = np.random.default_rng(1)
    feeds = [
        {
            "x": _x(n, rng),
            "pads": np.array(p, "int64"),
            "value": np.array(v, "float32"),
            "axes": np.array(a, "int64"),
        }
        for n, p, v, a in [(2, [1, 0, 2, 3], 1.5, [-1, 0]), (3, [0, 2, -1, 1], -2.0, [1, 2])]
    ]
    _check(_pad_model("constant", axes=True, value=True), feeds)


def test_pad_with_pads_from_shape_matches_onnxruntime():
    """pads = [0, n // 2, 0, 0, n, 0] with n from ``Shape(x)``: the fuzzer's shape-chain pads."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "zero", "one"], ["n"]),
        helper.make_node("Div", ["n", "two"], ["half"]),
        helper.make_node("Concat", ["zero", "half", "zero", "zero", "n", "zero"], ["pads"], axis=0),
        helper.make_node("Pad", ["x", "pads"], ["y"], mode="edge"),
    ]
    inits = {k: np.array([v], "int64") for k, v in (("zero", 0), ("one", 1), ("two", 2))}
    model = onnx_model(
        nodes,
        [onnx_input("x", "float32", ["n", 5, 3])],
        [_out("y")],
        inits,
        opset=19,
    )
    rng = np.random.default_rng(2)
    _check(model, [{"x": _x(n, rng)} for n in (2, 3)])


@pytest.mark.parametrize(
    "mode,pads",
    [
        ("reflect", [0, 5, 0, 0, 0, 0]),
        ("reflect", [0, 0, 0, 0, 0, 3]),
        ("edge", [0, -5, 0, 0, 1, 0]),
        ("constant", [0, -3, 0, 0, -3, 0]),
    ],
)
def test_pad_out_of_range_is_an_error_not_a_number(mode, pads):
    """A reflect width of the axis' extent or more, an edge pad of an emptied axis, a crop past
    the axis: ValueError naming the node (no read outside the input, no wrong number)."""
    compiled = _compiled(_pad_model(mode))
    x = _x(2, np.random.default_rng(3))
    with pytest.raises(ValueError, match="Pad 'the_pad'"):
        engine.TvmRunner(compiled, [x, np.array(pads, "int64")]).outputs()


def test_pad_with_runtime_axes_out_of_range_is_an_error():
    compiled = _compiled(_pad_model("constant", axes=True, value=True))
    x = _x(2, np.random.default_rng(4))
    args = [x, np.array([1, 1, 1, 1], "int64"), np.array(0, "float32")]
    for axes in ([0, 3], [1, -4], [2, -1]):  # out of range, out of range, the same axis twice
        with pytest.raises(ValueError, match="Pad 'the_pad'"):
            engine.TvmRunner(compiled, [*args, np.array(axes, "int64")]).outputs()


def _split_model(parts: int, axis: int):
    node = helper.make_node(
        "Split", ["x", "split"], [f"y{i}" for i in range(parts)], axis=axis, name="the_split"
    )
    inputs = [onnx_input("x", "float32", ["n", 7]), onnx_input("split", "int64", [parts])]
    outputs = [_out(f"y{i}", 2) for i in range(parts)]
    return onnx_model([node], inputs, outputs, {}, opset=18)


def test_split_with_runtime_sizes_matches_onnxruntime():
    rng = np.random.default_rng(5)
    x = lambda n: rng.standard_normal((n, 7)).astype("float32")  # noqa: E731
    _check(
        _split_model(3, 1),
        [{"x": x(n), "split": np.array(s, "int64")} for n, s in [(2, [3, 0, 4]), (3, [0, 7, 0])]],
    )
    _check(
        _split_model(2, 0),
        [{"x": x(n), "split": np.array(s, "int64")} for n, s in [(5, [2, 3]), (3, [3, 0])]],
    )


@pytest.mark.parametrize("sizes", [[3, 3, 3], [3, 3, 0], [8, -1, 0]])
def test_split_sizes_that_do_not_add_up_are_an_error(sizes):
    compiled = _compiled(_split_model(3, 1))
    x = np.zeros((2, 7), "float32")
    with pytest.raises(ValueError, match="Split 'the_split'"):
        engine.TvmRunner(compiled, [x, np.array(sizes, "int64")]).outputs()


@pytest.mark.parametrize(
    "name",
    [
        "test_layer_normalization_3d_axis1_epsilon_expanded",
        "test_layer_normalization_3d_axis2_epsilon_expanded_ver18",
        "test_layer_normalization_3d_axis_negative_1_epsilon_expanded",
    ],
)
def test_expanded_layer_norm_at_a_dynamic_batch_matches_onnxruntime(name):
    """ONNX's function-expanded LayerNormalization (``Size(Shape(x))``, ``Slice`` of the shape
    to the axis, ``ConstantOfShape``, ``Concat``, ``Reshape``) with the batch made dynamic."""
    from onnx_node_cases import case

    model = onnx.ModelProto()
    model.CopyFrom(case(name).model)
    assert any(n.op_type == "Size" for n in model.graph.node)
    del model.graph.value_info[:]
    for value in [model.graph.input[0], *model.graph.output]:
        value.type.tensor_type.shape.dim[0].dim_param = "n"
    rng = np.random.default_rng(6)
    shapes = {
        i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
    }
    feeds = [
        {
            k: rng.standard_normal([n, *v[1:]] if k == "X" else v).astype("float32")
            for k, v in shapes.items()
        }
        for n in (1, 5)
    ]
    _check(model, feeds)
