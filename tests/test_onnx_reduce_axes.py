"""ONNX reductions with ``axes`` given at run time (``tvm_fusion/frontend/onnx_reduce_axes.py``;
stock: "Only constant axes currently supported"), against ONNX's reference implementation at
symbolic sizes, with the run-time checks and the empty-set identities."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import run
from onnx import helper
from onnx.reference import ReferenceEvaluator

from tvm_fusion import load_onnx
from tvm_fusion.build import engine
from tvm_fusion.models._build import onnx_input, onnx_model
from tvm_fusion.target import host_target

OPS = [
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceSumSquare",
    "ReduceLogSum",
    "ReduceLogSumExp",
]


def _model(op: str, keepdims: int, axes_len: int, dtype="float32", axes_const=None):
    inputs = [onnx_input("x", dtype, ["n", 3, "m"])]
    inits = {}
    if axes_const is None:
        inputs.append(onnx_input("axes", "int64", [axes_len]))
    else:
        inits["axes"] = np.array(axes_const, np.int64)
    node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims, name="r")
    rank = 3 if keepdims else 3 - axes_len
    out = [onnx_input("y", dtype, [f"o{i}" for i in range(rank)])]
    return onnx_model([node], inputs, out, inits, opset=18)


def _runtime_kernels(mod) -> list[str]:
    return [gv.name_hint for gv in mod.functions if "runtime_axes" in gv.name_hint]


@pytest.mark.parametrize("op,keepdims", [(op, i % 2) for i, op in enumerate(OPS)])
def test_runtime_axes_match_onnx_reference(op, keepdims):
    model = _model(op, keepdims, 2)
    mod = load_onnx(model)
    assert _runtime_kernels(mod) == [op.lower() + "_runtime_axes"]
    compiled = engine.compile_module(mod, host_target(), "tvm_fusion")
    reference = ReferenceEvaluator(model)
    rng = np.random.default_rng(0)
    for (n, m), axes in (((2, 5), [0, 2]), ((4, 1), [-1, 1]), ((1, 3), [1, 0])):
        x = rng.uniform(0.5, 2.0, (n, 3, m)).astype(np.float32)
        feeds = {"x": x, "axes": np.array(axes, np.int64)}
        (want,) = reference.run(None, feeds)
        (got,) = engine.TvmRunner(compiled, [x, feeds["axes"]]).outputs()
        assert got.shape == want.shape, (got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_constant_axes_keep_the_stock_converter():
    """Must not fire: constant axes import as stock's reduction (no run-time kernel)."""
    mod = load_onnx(_model("ReduceSum", 1, 1, axes_const=[1]))
    assert _runtime_kernels(mod) == []


@pytest.mark.parametrize("axes", [[3], [1, -2]])
def test_axes_out_of_range_or_repeated_raise(axes):
    model = _model("ReduceSum", 1, len(axes))
    x = np.ones((2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="axes out of"):
        run(load_onnx(model), [x, np.array(axes, np.int64)])


@pytest.mark.parametrize(
    "op,dtype", [("ReduceProd", "float32"), ("ReduceMax", "float32"), ("ReduceMax", "bool")]
)
def test_empty_set_gives_the_identity(op, dtype):
    """A reduced extent of 0: TIR's init never runs for an empty reduction loop; the kernel's
    loops run once with the identity (1, -inf, False) instead."""
    model = _model(op, 1, 1, dtype=dtype)
    x = np.zeros((2, 3, 0), dtype)
    (got,), _ = run(load_onnx(model), [x, np.array([2], np.int64)])
    want = ReferenceEvaluator(model).run(None, {"x": x, "axes": np.array([2], np.int64)})[0]
    assert got.shape == want.shape == (2, 3, 1)
    np.testing.assert_array_equal(got, want)
