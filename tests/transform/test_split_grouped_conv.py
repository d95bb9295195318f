"""SplitGroupedConv: a convolution of a few wide groups -> split, one conv per group, concat.

Must not fire: many narrow groups (ResNeXt-like), depthwise, a short reduction (ShuffleNet's
1 x 1 groups), a weight that is a parameter, a CUDA target. Numbers: ONNX Conv(group=2) + bias
+ Relu against ONNX Runtime, static and with symbolic batch / image sizes; NHWC and conv1d
against the unsplit build.
"""

import numpy as np
import pytest
import tvm
from helpers import matches_reference
from tvm import relax

from tvm_fusion.build import engine
from tvm_fusion.target import host_target, parse_target
from tvm_fusion.transform import SplitGroupedConv, collect_rewrites

RNG = np.random.default_rng(1)
CPU = parse_target("llvm")


def grouped(x_shape, w_shape, groups, *, layout=("NCHW", "OIHW"), param=False, op=None):
    op = op or relax.op.nn.conv2d
    w = RNG.standard_normal(w_shape).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    weight = relax.Var("w", relax.TensorType(w_shape, "float32")) if param else relax.const(w)
    with bb.function("main", [x, weight] if param else [x]):
        with bb.dataflow():
            kw = {"data_layout": layout[0], "kernel_layout": layout[1]}
            y = bb.emit(op(x, weight, padding=1, groups=groups, **kw))
            gv = bb.emit_output(bb.emit(relax.op.nn.relu(y)))
        bb.emit_func_output(gv)
    return bb.get(), w


def _split(mod, target=CPU):
    with collect_rewrites() as counts:
        out = SplitGroupedConv(target)(mod)
    return out, counts.get("SplitGroupedConv", 0)


def test_structure_two_groups():
    before, w = grouped((1, 64, 9, 9), (64, 32, 3, 3), 2)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 64, 9, 9), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, 2, axis=1))
            outs = []
            for g in range(2):
                piece = bb.emit(relax.TupleGetItem(parts, g))
                w_g = relax.const(np.ascontiguousarray(w[32 * g : 32 * (g + 1)]))
                outs.append(bb.emit(relax.op.nn.conv2d(piece, w_g, padding=1)))
            y = bb.emit(relax.op.concat(outs, axis=1))
            gv = bb.emit_output(bb.emit(relax.op.nn.relu(y)))
        bb.emit_func_output(gv)
    after, n = _split(before)
    assert n == 1
    tvm.ir.assert_structural_equal(after, bb.get(), map_free_vars=True)


@pytest.mark.parametrize(
    "args, kwargs",
    [
        (((1, 64, 8, 8), (64, 2, 3, 3), 32), {}),  # 32 narrow groups
        (((1, 64, 8, 8), (64, 1, 3, 3), 64), {}),  # depthwise
        (((1, 272, 8, 8), (272, 68, 1, 1), 4), {}),  # ShuffleNet's 1 x 1: K = 68
        (((1, 64, 8, 8), (64, 32, 3, 3), 2), {"param": True}),
    ],
    ids=["narrow_groups", "depthwise", "short_reduction", "weight_param"],
)
def test_must_not_fire(args, kwargs):
    before, _ = grouped(*args, **kwargs)
    _, n = _split(before)
    assert n == 0


def test_cuda_left_alone():
    before, _ = grouped((1, 64, 9, 9), (64, 32, 3, 3), 2)
    _, n = _split(before, parse_target("cuda"))
    assert n == 0


def _onnx_model(dims):
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        numpy_helper.from_array(RNG.standard_normal((64, 16, 5, 5)).astype("float32"), "W"),
        numpy_helper.from_array(RNG.standard_normal(64).astype("float32"), "B"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["y"], pads=[2, 2, 2, 2], group=2),
        helper.make_node("Relu", ["y"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "grouped",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [None] * 4)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)


def _ort(model, x):
    return engine.onnxruntime_runner(model, {"x": x}, 1)()


@pytest.mark.parametrize("dims", [[1, 32, 13, 11], ["n", 32, "h", "w"]], ids=["static", "symbolic"])
def test_onnx_grouped_conv_matches_ort(dims):
    from tvm_fusion import load_onnx

    model = _onnx_model(dims)
    shapes = [(1, 32, 13, 11)] if dims[0] == 1 else [(1, 32, 7, 9), (3, 32, 12, 5)]
    cases = []
    for shape in shapes:
        x = RNG.standard_normal(shape).astype("float32")
        cases.append(([x], _ort(model, x)))
    with collect_rewrites() as counts:
        matches_reference(load_onnx(model), cases, rtol=1e-4, atol=1e-4)
    assert counts.get("SplitGroupedConv", 0) == 1


@pytest.mark.parametrize(
    "args, kwargs",
    [
        (((2, 7, 6, 64), (64, 3, 3, 32), 2), {"layout": ("NHWC", "OHWI")}),
        (((2, 96, 11), (96, 32, 9), 3), {"layout": ("NCW", "OIW"), "op": relax.op.nn.conv1d}),
    ],
    ids=["nhwc", "conv1d"],
)
def test_layouts_match_the_grouped_build(args, kwargs):
    mod, _ = grouped(*args, **kwargs)
    _, n = _split(mod)
    assert n == 1
    x = RNG.standard_normal(args[0]).astype("float32")
    plain = engine.compile_module(mod, host_target(), "tvm_fusion", split_grouped_conv=False)
    expected = engine.TvmRunner(plain, [x]).outputs()
    matches_reference(mod, [([x], expected)], rtol=1e-4, atol=1e-4)
