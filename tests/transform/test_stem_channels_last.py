"""StemChannelsLast: conv2d (few input channels) -> elementwise -> max_pool2d computed in NHWC,
the pooled tensor transposed back to NCHW.

Structure: the rewritten graph against one built by hand (the same TE convolution, the bias
viewed [1, 1, 1, C], the pooling in NHWC, the transpose). Must not fire: a long reduction, a
softmax (a channel-mixing op, as AlexNet's LRN) between convolution and pooling, a ReLU with a
second use, a computed bias, average pooling, a symbolic batch, a weight that is a parameter,
a non-CPU target. Numbers: ONNX stems
(SqueezeNet's, ResNet-50's with a folded batch-norm and padded ceil-mode pooling, a dilated one,
one with Clip) against ONNX Runtime, the kernels the CPU rules scheduled.
"""

import numpy as np
import pytest
import tvm
from helpers import matches_reference
from tvm import relax

from tvm_fusion.build import engine
from tvm_fusion.target import host_target
from tvm_fusion.transform import StemChannelsLast, collect_rewrites
from tvm_fusion.transform.stem_channels_last import conv2d_to_nhwc

RNG = np.random.default_rng(0)


def stem(
    x_shape=(1, 3, 17, 17),
    w_shape=(8, 3, 3, 3),
    *,
    strides=(2, 2),
    padding=(0, 0, 0, 0),
    between="relu",
    bias_param=False,
    weight_param=False,
    relu_used_twice=False,
    pool=relax.op.nn.max_pool2d,
):
    """main(x) = pool(relu(conv2d(x, W) + b)) [+ a second use of the relu]."""
    w = RNG.standard_normal(w_shape).astype("float32")
    b = RNG.standard_normal((1, w_shape[0], 1, 1)).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    params = [x]
    weight, bias = relax.const(w), relax.const(b)
    if weight_param:
        weight = relax.Var("w", relax.TensorType(w_shape, "float32"))
        params.append(weight)
    if bias_param:
        bias = relax.Var("b", relax.TensorType(b.shape, "float32"))
        params.append(bias)
    with bb.function("main", params):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, weight, strides=strides, padding=padding))
            z = bb.emit(relax.op.add(y, bias))
            if between == "relu":
                z = bb.emit(relax.op.nn.relu(z))
            elif between == "softmax":  # mixes the channels, as AlexNet's LRN does
                z = bb.emit(relax.op.nn.softmax(z, axis=1))
            out = bb.emit(pool(z, 3, 2))
            if relu_used_twice:
                out = relax.Tuple([out, z])
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get(), w, b


def _rewrite(mod, target=None):
    with collect_rewrites() as counts:
        out = StemChannelsLast(target or host_target())(mod)
    return out, counts.get("StemChannelsLast", 0)


def test_structure_squeezenet_stem():
    """conv2d + bias -> relu -> max_pool2d becomes the NHWC convolution, bias [1, 1, 1, C],
    relu, max_pool2d in NHWC and a transpose to NCHW."""
    before, w, b = stem()
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 3, 17, 17), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_te(
                conv2d_to_nhwc,
                x,
                relax.const(w),
                [2, 2],
                [0, 0, 0, 0],
                [1, 1],
                primfunc_name_hint="conv2d_nhwc",
            )
            z = bb.emit(relax.op.add(y, relax.const(b.transpose(0, 2, 3, 1))))
            r = bb.emit(relax.op.nn.relu(z))
            p = bb.emit(relax.op.nn.max_pool2d(r, 3, 2, layout="NHWC", out_layout="NHWC"))
            gv = bb.emit_output(bb.emit(relax.op.permute_dims(p, [0, 3, 1, 2])))
        bb.emit_func_output(gv)
    after, n = _rewrite(before)
    assert n == 1
    tvm.ir.assert_structural_equal(after, bb.get(), map_free_vars=True)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"x_shape": (1, 48, 9, 9), "w_shape": (8, 48, 3, 3)},  # 432 products per output
        {"between": "softmax"},
        {"relu_used_twice": True},
        {"bias_param": True},
        {"weight_param": True},
        {"pool": relax.op.nn.avg_pool2d},
        {"x_shape": (tvm.tirx.Var("n", "int64"), 3, 17, 17)},
    ],
    ids=[
        "long_reduction",
        "softmax",
        "relu_used_twice",
        "bias_param",
        "weight_param",
        "avg_pool",
        "symbolic_batch",
    ],  # fmt: skip
)
def test_must_not_fire(kwargs):
    before, _, _ = stem(**kwargs)
    after, n = _rewrite(before)
    assert n == 0
    tvm.ir.assert_structural_equal(after, before)


def test_cuda_left_alone():
    before, _, _ = stem()
    _, n = _rewrite(before, tvm.target.Target("cuda", host="llvm"))
    assert n == 0


def _onnx_stem(cin, cout, k, stride, pads, pool_pads, *, bn=False, clip=False, dil=1,
               ceil=0, hw=19):  # fmt: skip
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        numpy_helper.from_array(RNG.standard_normal((cout, cin, k, k)).astype("float32"), "W"),
        numpy_helper.from_array(RNG.standard_normal(cout).astype("float32"), "B"),
    ]
    nodes = [
        helper.make_node(
            "Conv", ["x", "W", "B"], ["y"], pads=pads, strides=[stride] * 2, dilations=[dil] * 2
        )
    ]
    last = "y"
    if bn:
        for name, lo, hi in (("g", 0.5, 1.5), ("be", -1, 1), ("m", -1, 1), ("v", 0.1, 2)):
            inits.append(numpy_helper.from_array(RNG.uniform(lo, hi, cout).astype("float32"), name))
        nodes.append(helper.make_node("BatchNormalization", ["y", "g", "be", "m", "v"], ["z"]))
        last = "z"
    if clip:
        inits += [
            numpy_helper.from_array(np.array(0, "float32"), "lo"),
            numpy_helper.from_array(np.array(6, "float32"), "hi"),
        ]
        nodes.append(helper.make_node("Clip", [last, "lo", "hi"], ["a"]))
    else:
        nodes.append(helper.make_node("Relu", [last], ["a"]))
    nodes.append(
        helper.make_node(
            "MaxPool",
            ["a"],
            ["out"],
            kernel_shape=[3, 3],
            strides=[2, 2],
            pads=pool_pads,
            ceil_mode=ceil,
        )  # fmt: skip
    )
    graph = helper.make_graph(
        nodes,
        "stem",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, cin, hw, hw])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [None] * 4)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


@pytest.mark.parametrize(
    "spec",
    [
        ((3, 16, 3, 2, [0] * 4, [0] * 4), {}),  # SqueezeNet's
        ((3, 24, 7, 2, [3] * 4, [1] * 4), {"bn": True}),  # ResNet-50's, batch-norm folded
        ((3, 20, 3, 2, [1] * 4, [0] * 4), {"bn": True, "ceil": 1, "hw": 20}),  # ceil mode
        ((1, 17, 3, 1, [2] * 4, [1] * 4), {"clip": True, "dil": 2}),  # dilated, Clip, 17 ch
    ],
    ids=["squeezenet", "resnet_bn", "ceil_mode", "dilated_clip"],
)
def test_onnx_stem_matches_ort(spec):
    from tvm_fusion import load_onnx
    from tvm_fusion.tools.analysis import fallback_kernels

    args, kwargs = spec
    model = _onnx_stem(*args, **kwargs)
    x = RNG.standard_normal((2, args[0], kwargs.get("hw", 19), kwargs.get("hw", 19)))
    x = x.astype("float32")
    ref = engine.onnxruntime_runner(model, {"x": x}, 1)()
    with collect_rewrites() as counts:
        compiled = matches_reference(load_onnx(model), [([x], ref)], rtol=1e-4, atol=1e-4)
    assert counts.get("StemChannelsLast", 0) == 1
    assert fallback_kernels(compiled.lowered) == []
