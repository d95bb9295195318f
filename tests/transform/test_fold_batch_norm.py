"""FoldBatchNorm: conv [+ bias] -> batch_norm (inference) becomes conv(x, W * s) + bias.

Must not fire: training mode, a weight that is a parameter, a convolution with a second use, a
batch-norm whose running statistics are used, a batch-norm along another axis, a blocked
layout. Numbers: ONNX Conv (+ bias) -> BatchNormalization -> Relu against ONNX Runtime, static
and with symbolic batch / image sizes; NHWC, grouped and 1-D convolutions against the unfolded
build.
"""

import numpy as np
import pytest
import tvm
from helpers import matches_reference
from tvm import relax

from tvm_fusion.build import engine
from tvm_fusion.target import host_target
from tvm_fusion.transform import FoldBatchNorm, collect_rewrites

RNG = np.random.default_rng(0)
EPS = 1e-5


def _stats(c):
    return (
        RNG.uniform(0.5, 1.5, c).astype("float32"),  # gamma
        RNG.uniform(-1, 1, c).astype("float32"),  # beta
        RNG.uniform(-1, 1, c).astype("float32"),  # mean
        RNG.uniform(0.1, 2, c).astype("float32"),  # var
    )


def conv_bn(
    x_shape=(1, 4, 8, 8),
    w_shape=(6, 4, 3, 3),
    *,
    bias=None,
    stats=None,
    layout=("NCHW", "OIHW"),
    axis=1,
    training=False,
    weight_param=False,
    extra_use=False,
    use_stats=False,
    groups=1,
    op=relax.op.nn.conv2d,
    w=None,
):
    """main(x) = relu(batch_norm(conv(x, W) [+ bias])[0]) [+ conv(x, W) when extra_use]."""
    w = RNG.standard_normal(w_shape).astype("float32") if w is None else w
    stats = _stats(w_shape[layout[1].index("O")]) if stats is None else stats
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    params = [x]
    weight = relax.const(w)
    if weight_param:
        weight = relax.Var("w", relax.TensorType(w_shape, "float32"))
        params.append(weight)
    with bb.function("main", params):
        with bb.dataflow():
            kw = {"data_layout": layout[0], "kernel_layout": layout[1]}
            if op is relax.op.nn.conv1d:
                kw = {}
            y = bb.emit(op(x, weight, padding=1, groups=groups, **kw))
            z = bb.emit(relax.op.add(y, relax.const(bias))) if bias is not None else y
            bn = bb.emit(
                relax.op.nn.batch_norm(
                    z, *map(relax.const, stats), axis=axis, epsilon=EPS, training=training
                )  # fmt: skip
            )
            out = bb.emit(relax.op.nn.relu(bb.emit(relax.TupleGetItem(bn, 0))))
            if extra_use:
                out = bb.emit(relax.op.add(out, y))
            if use_stats:
                out = relax.Tuple([out, bb.emit(relax.TupleGetItem(bn, 1))])
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get(), w, stats


def folded(w, stats, bias=None, o_axis=0):
    gamma, beta, mean, var = (s.astype("float64") for s in stats)
    scale = gamma / np.sqrt(var + EPS)
    shape = [1] * w.ndim
    shape[o_axis] = -1
    b = np.zeros_like(scale) if bias is None else bias.reshape(-1).astype("float64")
    return (w * scale.reshape(shape)).astype("float32"), ((b - mean) * scale + beta)


def _fold(mod):
    with collect_rewrites() as counts:
        out = FoldBatchNorm()(mod)
    return out, counts.get("FoldBatchNorm", 0)


def test_structure_conv_bias_bn():
    """conv2d + bias -> batch_norm[0] -> relu becomes conv2d(W') + b' -> relu."""
    bias = RNG.standard_normal((1, 6, 1, 1)).astype("float32")
    before, w, stats = conv_bn(bias=bias)
    new_w, new_b = folded(w, stats, bias)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(new_w), padding=1))
            z = bb.emit(relax.op.add(y, relax.const(new_b.astype("float32").reshape(1, 6, 1, 1))))
            gv = bb.emit_output(bb.emit(relax.op.nn.relu(z)))
        bb.emit_func_output(gv)
    after, n = _fold(before)
    assert n == 1
    tvm.ir.assert_structural_equal(after, bb.get(), map_free_vars=True)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"training": True},
        {"weight_param": True},
        {"extra_use": True},
        {"use_stats": True},
        {"axis": 2, "x_shape": (1, 4, 6, 6)},  # over H (6 rows, as many as the channels)
        {"bias": RNG.standard_normal((1, 1, 8, 1)).astype("float32")},  # a bias along H
        # 1-D of the channels' length: numpy broadcasting puts it along W (6 = W = channels)
        {"bias": RNG.standard_normal(6).astype("float32"), "x_shape": (1, 4, 6, 6)},
        {"bias": RNG.standard_normal((2, 6, 1, 1)).astype("float32")},  # a bias that adds a batch
    ],
    ids=[
        "training",
        "weight_param",
        "conv_used_twice",
        "stats_used",
        "other_axis",
        "bias_h",
        "bias_1d_along_w",
        "bias_adds_batch",
    ],
)
def test_must_not_fire(kwargs):
    before, _, _ = conv_bn(**kwargs)
    after, n = _fold(before)
    assert n == 0
    assert "batch_norm" in after.script()


def test_blocked_layout_left_alone():
    mod, _, _ = conv_bn()
    blocked = relax.transform.ConvertLayout({"relax.nn.conv2d": ["NCHW2c", "OIHW2i2o"]})(mod)
    if "NCHW2c" not in blocked.script():
        pytest.skip("ConvertLayout left the convolution in NCHW")
    _, n = _fold(blocked)
    assert n == 0


def _onnx_model(bias: bool, dims):
    from onnx import TensorProto, helper, numpy_helper

    w = RNG.standard_normal((8, 3, 3, 3)).astype("float32")
    inits = [numpy_helper.from_array(w, "W")]
    conv_in = ["x", "W"]
    if bias:
        inits.append(numpy_helper.from_array(RNG.standard_normal(8).astype("float32"), "B"))
        conv_in.append("B")
    for name, value in zip(("g", "b", "m", "v"), _stats(8), strict=True):
        inits.append(numpy_helper.from_array(value, name))
    nodes = [
        helper.make_node("Conv", conv_in, ["y"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("BatchNormalization", ["y", "g", "b", "m", "v"], ["z"], epsilon=EPS),
        helper.make_node("Relu", ["z"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [None] * 4)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)


def _ort(model, x):
    return engine.onnxruntime_runner(model, {"x": x}, 1)()


@pytest.mark.parametrize("bias", [False, True])
def test_onnx_conv_bn_relu_matches_ort(bias):
    from tvm_fusion import load_onnx

    model = _onnx_model(bias, [2, 3, 11, 9])
    with collect_rewrites() as counts:
        x = RNG.standard_normal((2, 3, 11, 9)).astype("float32")
        matches_reference(load_onnx(model), [([x], _ort(model, x))], rtol=1e-4, atol=1e-4)
    assert counts.get("FoldBatchNorm", 0) == 1


def test_onnx_symbolic_batch_and_image():
    from tvm_fusion import load_onnx

    model = _onnx_model(True, ["n", 3, "h", "w"])
    cases = []
    for shape in ((1, 3, 7, 7), (3, 3, 10, 13)):
        x = RNG.standard_normal(shape).astype("float32")
        cases.append(([x], _ort(model, x)))
    with collect_rewrites() as counts:
        matches_reference(load_onnx(model), cases, rtol=1e-4, atol=1e-4)
    assert counts.get("FoldBatchNorm", 0) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"layout": ("NHWC", "OHWI"), "axis": 3, "x_shape": (2, 7, 5, 4), "w_shape": (6, 3, 3, 4)},
        {"layout": ("NCHW", "OIHW"), "groups": 2, "x_shape": (1, 4, 5, 5), "w_shape": (6, 2, 3, 3)},
        {
            "op": relax.op.nn.conv1d,
            "layout": ("NCW", "OIW"),
            "x_shape": (2, 4, 9),
            "w_shape": (6, 4, 3),
        },  # fmt: skip
    ],
    ids=["nhwc", "grouped", "conv1d"],
)
def test_layouts_match_the_unfolded_build(kwargs):
    mod, _, _ = conv_bn(**kwargs)
    x = RNG.standard_normal(kwargs["x_shape"]).astype("float32")
    target = host_target()
    plain = engine.compile_module(mod, target, "tvm_fusion", fold_batch_norm=False)
    expected = engine.TvmRunner(plain, [x]).outputs()
    assert "batch_norm" not in FoldBatchNorm()(mod).script()
    matches_reference(mod, [([x], expected)], rtol=1e-4, atol=1e-4)
