"""ONNX operator forms stock TVM refuses (``tvm_fusion/frontend/onnx_op_gaps.py``, issue #40),
at other shapes and dtypes than ONNX's node tests, with a symbolic batch dim: MaxPool's
``Indices`` against ONNX Runtime, integer / mixed-dtype ``Pow`` and ``CumSum`` with a run-time
axis against ONNX's reference evaluator; the run-time refusals (a negative integer exponent, an
axis out of range) and an import-time one."""

import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from tvm_fusion import host_target, load_onnx
from tvm_fusion.build import engine
from tvm_fusion.errors import ModelError
from tvm_fusion.models._build import onnx_input, onnx_model


def _compile(model):
    return engine.compile_module(load_onnx(model), host_target(), "tvm_fusion")


def _run(compiled, feeds):
    return engine.TvmRunner(compiled, list(feeds.values())).outputs()


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("storage_order", [0, 1])
def test_maxpool_indices_match_onnxruntime(storage_order):
    ort = pytest.importorskip("onnxruntime")
    node = helper.make_node(
        "MaxPool",
        ["x"],
        ["y", "i"],
        kernel_shape=[3, 2],
        strides=[2, 1],
        pads=[1, 0, 1, 1],
        dilations=[1, 2],
        ceil_mode=1,
        storage_order=storage_order,
    )
    model = onnx_model(
        [node],
        [onnx_input("x", "float32", ["n", 2, 6, 7])],
        [onnx_input("y", "float32", ["n", 2, 4, 6]), onnx_input("i", "int64", ["n", 2, 4, 6])],
        {},
        opset=12,
    )
    compiled = _compile(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(storage_order)
    for batch in (1, 3):
        size = batch * 2 * 6 * 7
        x = (rng.permutation(size).astype("float32") - size / 2).reshape(batch, 2, 6, 7)
        _same(_run(compiled, {"x": x}), session.run(None, {"x": x}))


def test_maxpool_indices_of_symbolic_same_padding_are_refused():
    node = helper.make_node(
        "MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2], auto_pad="SAME_UPPER", name="pool"
    )
    model = onnx_model(
        [node],
        [onnx_input("x", "float32", [1, 1, "h", "w"])],
        [onnx_input("y", "float32", [1, 1, "p", "q"]), onnx_input("i", "int64", [1, 1, "p", "q"])],
        {},
        opset=12,
    )
    with pytest.raises(ModelError, match="MaxPool node 'pool'") as err:
        load_onnx(model)
    assert "\n" not in str(err.value)


def _pow_model(base: str, exponent: str):
    node = helper.make_node("Pow", ["a", "b"], ["z"], name="pow")
    return onnx_model(
        [node],
        [onnx_input("a", base, ["n", 3]), onnx_input("b", exponent, [3])],
        [onnx_input("z", base, ["n", 3])],
        {},
        opset=15,
    )


@pytest.mark.parametrize(
    "base,exponent",
    [("int64", "int32"), ("int32", "int64"), ("float32", "int64"), ("int32", "float32")],
)
def test_pow_of_other_dtypes_matches_onnx_reference(base, exponent):
    model = _pow_model(base, exponent)
    compiled = _compile(model)
    reference = ReferenceEvaluator(model)
    rng = np.random.default_rng(0)
    for batch in (2, 4):
        a = rng.integers(-7, 8, size=(batch, 3)).astype(base)
        # large integer exponents wrap around (numpy's integer arithmetic), exactly
        b = np.array([0, 3, 41] if exponent.startswith("int") else [0.5, 3, 2.5], exponent)
        if base.startswith("float"):
            a = a + np.float32(0.25)
        if exponent.startswith("float"):
            a = np.abs(a)
        feeds = {"a": a, "b": b}
        _same(_run(compiled, feeds), reference.run(None, feeds))


def test_pow_negative_integer_exponent_is_a_runtime_error():
    compiled = _compile(_pow_model("int32", "int32"))
    a = np.array([[2, 3, 4]], "int32")
    with pytest.raises(ValueError, match="negative integer powers"):
        _run(compiled, {"a": a, "b": np.array([1, -1, 2], "int32")})


def _cumsum_model(exclusive: int, reverse: int, axis_shape=(), op="CumSum"):
    node = helper.make_node(
        op, ["x", "axis"], ["y"], exclusive=exclusive, reverse=reverse, name="cs"
    )
    return onnx_model(
        [node],
        [onnx_input("x", "float32", ["n", 3, 4]), onnx_input("axis", "int32", list(axis_shape))],
        [onnx_input("y", "float32", ["n", 3, 4])],
        {},
        opset=14 if op == "CumSum" else 26,
    )


@pytest.mark.parametrize(
    "exclusive,reverse,axis_shape,op",
    [(0, 0, (), "CumSum"), (1, 1, (1,), "CumSum"), (0, 1, (), "CumProd"), (1, 0, (1,), "CumProd")],
)
def test_cumsum_runtime_axis_matches_onnx_reference(exclusive, reverse, axis_shape, op):
    """CumSum and CumProd (opset 26, no stock converter) with the axis given at run time."""
    model = _cumsum_model(exclusive, reverse, axis_shape, op)
    compiled = _compile(model)
    # ONNX's axis is 0-d (the reference refuses others); a one-element axis, as stock and
    # ONNX Runtime take it, means the same
    reference = ReferenceEvaluator(_cumsum_model(exclusive, reverse, op=op))
    rng = np.random.default_rng(1)
    for batch, axis in [(2, 0), (2, 1), (3, 2), (3, -1), (2, -3)]:
        feeds = {
            "x": rng.standard_normal((batch, 3, 4)).astype("float32"),
            "axis": np.array(axis, "int32").reshape(axis_shape),
        }
        want = reference.run(None, {**feeds, "axis": np.array(axis, "int32")})
        _same(_run(compiled, feeds), want)


def test_cumsum_axis_out_of_range_is_a_runtime_error():
    compiled = _compile(_cumsum_model(0, 0))
    x = np.ones((2, 3, 4), "float32")
    with pytest.raises(ValueError, match="axis out of range"):
        _run(compiled, {"x": x, "axis": np.array(3, "int32")})


@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization_symbolic_rows(p):
    """LpNormalization (no stock converter) over a symbolic number of rows: ``x / ||x||_p``
    along the last axis, with |x| for p = 1 (negative entries), a zero row stays zero."""
    node = helper.make_node("LpNormalization", ["x"], ["y"], p=p, axis=-1, name="lp")
    model = onnx_model(
        [node], [onnx_input("x", "float32", ["n", 5])], [onnx_input("y", "float32", ["n", 5])], {}
    )
    compiled = _compile(model)
    for rows in (1, 4):
        x = np.random.default_rng(rows).standard_normal((rows, 5)).astype("float32")
        x[0] = 0.0
        norm = np.linalg.norm(x, ord=p, axis=-1, keepdims=True)
        want = np.where(norm == 0, 0, x / np.where(norm == 0, 1, norm))
        (got,) = _run(compiled, {"x": x})
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_rms_normalization_over_every_axis_symbolic():
    """RMSNormalization with axis 0 (stock's rms_norm failed in LegalizeOps), symbolic rows."""
    node = helper.make_node("RMSNormalization", ["x", "scale"], ["y"], axis=0, epsilon=1e-3)
    scale = np.linspace(0.5, 2.0, 6).astype("float32").reshape(1, 6)
    model = onnx_model(
        [node],
        [onnx_input("x", "float32", ["n", 6])],
        [onnx_input("y", "float32", ["n", 6])],
        {"scale": scale},
        opset=23,
    )
    compiled = _compile(model)
    for rows in (1, 3):
        x = np.random.default_rng(rows).standard_normal((rows, 6)).astype("float32")
        want = x / np.sqrt(np.mean(x * x) + 1e-3) * scale
        (got,) = _run(compiled, {"x": x})
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_reverse_sequence_symbolic_steps_and_lengths_out_of_range():
    """ReverseSequence (no stock converter) with a symbolic number of steps: each batch
    entry's first ``len`` steps reversed; lengths above the steps (or negative) clipped, never
    an index outside the tensor."""
    node = helper.make_node("ReverseSequence", ["x", "lens"], ["y"], time_axis=0, batch_axis=1)
    model = onnx_model(
        [node],
        [onnx_input("x", "float32", ["t", 3, 2]), onnx_input("lens", "int64", [3])],
        [onnx_input("y", "float32", ["t", 3, 2])],
        {},
        opset=10,
    )
    compiled = _compile(model)
    for steps, lens in ((4, [1, 3, 4]), (2, [0, 5, -1])):
        x = np.arange(steps * 6, dtype="float32").reshape(steps, 3, 2)
        want = x.copy()
        for b, n in enumerate(np.clip(lens, 0, steps)):
            want[:n, b] = x[:n, b][::-1]
        (got,) = _run(compiled, {"x": x, "lens": np.array(lens, "int64")})
        np.testing.assert_array_equal(got, want)
