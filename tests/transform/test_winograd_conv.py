"""WinogradConv: a 3 x 3 stride-1 NCHW convolution -> input transform, batched GEMM against the
transformed weight (a constant), output transform; bias + ReLU fused after it.

Must not fire: stride 2, dilation 2, groups 2, a weight that is a parameter, 1 x 1 and 5 x 5
kernels, NHWC with an IHWO weight, symbolic shapes, too few channels, a CUDA target. Numbers:
NHWC / OHWI (ChannelsLast's form: padded in place, the output written NHWC) at 13 x 13 and
batch 2 x 7 x 5, both tiles, the weight a constant or ChannelsLast's permute_dims of one; and
against a float64
NumPy convolution at odd sizes (13 x 7, 5 x 5, 1 x 1, 7 x 13), padding 1, 0 and asymmetric,
batch 3, both tile sizes; float32 accuracy at 512 input channels; an ONNX Conv + BatchNorm +
residual Add + Relu against ONNX Runtime (FoldBatchNorm first) and the pipeline flag.
"""

import numpy as np
import pytest
import tvm
from helpers import matches_reference
from tvm import relax
from tvm.ir.expr import GenericConst

from tvm_fusion.build import engine
from tvm_fusion.target import host_target, parse_target
from tvm_fusion.transform import WinogradConv, collect_rewrites, winograd_conv

RNG = np.random.default_rng(3)
CPU = parse_target("llvm")


def conv_relu(x_shape, w_shape, *, padding=1, param=False, layout=("NCHW", "OIHW"), **conv_kw):
    """``relu(conv2d(x, W) + b)`` and its weight and bias."""
    w = (RNG.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype("float32")
    b = RNG.standard_normal(w_shape[0]).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    weight = relax.Var("w", relax.TensorType(w_shape, "float32")) if param else relax.const(w)
    bias_shape = (1, w_shape[0], 1, 1) if layout[0] == "NCHW" else (1, 1, 1, w_shape[0])
    with bb.function("main", [x, weight] if param else [x]):
        with bb.dataflow():
            kw = {"data_layout": layout[0], "kernel_layout": layout[1], **conv_kw}
            y = bb.emit(relax.op.nn.conv2d(x, weight, padding=padding, **kw))
            y = bb.emit(relax.op.add(y, relax.const(b.reshape(bias_shape))))
            gv = bb.emit_output(bb.emit(relax.op.nn.relu(y)))
        bb.emit_func_output(gv)
    return bb.get(), w, b


def reference(x, w, b, padding):
    """relu(conv2d + b) in float64; ``padding`` = (top, left, bottom, right)."""
    top, left, bottom, right = padding
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (top, bottom), (left, right)))
    windows = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))
    y = np.einsum("nchwij,kcij->nkhw", windows, w.astype(np.float64))
    return np.maximum(y + b.reshape(1, -1, 1, 1), 0)


def _rewrite(mod, target=CPU):
    with collect_rewrites() as counts:
        out = WinogradConv(target)(mod)
    return out, counts.get("WinogradConv", 0)


def _calls(func) -> list[str]:
    names = []

    def visit(expr):
        if isinstance(expr, relax.Call):
            op = expr.op
            if isinstance(op, tvm.ir.Op) and op.name == "relax.call_tir":
                names.append(expr.args[0].name_hint)
            elif isinstance(op, tvm.ir.Op):
                names.append(op.name)

    relax.analysis.post_order_visit(func.body, visit)
    return names


def test_structure_and_fused_epilogue():
    mod, _, _ = conv_relu((1, 64, 13, 13), (64, 64, 3, 3))  # F(4,3): 16 tiles, F(2,3): 49
    out, n = _rewrite(mod)
    assert n == 1
    calls = _calls(out["main"])
    assert "relax.nn.conv2d" not in calls
    assert calls.count("relax.matmul") == 1
    assert sum(c.startswith("winograd_input_f2") for c in calls) == 1
    assert sum(c.startswith("winograd_output_f2") for c in calls) == 1
    (matmul,) = [
        b.value
        for block in out["main"].body.blocks
        for b in block.bindings
        if isinstance(b.value, relax.Call) and b.value.op.name == "relax.matmul"
    ]
    assert isinstance(matmul.args[1], GenericConst)
    # padding, input transform, GEMM, output transform, one kernel for slice + bias + ReLU
    compiled = engine.compile_module(out, host_target(), "tvm_fusion", winograd_conv=False)
    kernels = [
        gv.name_hint
        for gv, f in compiled.lowered.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc)
    ]
    assert len(kernels) == 5, kernels
    (epilogue,) = [k for k in kernels if "relu" in k]
    assert "add" in epilogue and "strided_slice" in epilogue


@pytest.mark.parametrize(
    "x_shape, w_shape, kwargs",
    [
        ((1, 64, 28, 28), (64, 64, 3, 3), {"strides": 2}),
        ((1, 64, 28, 28), (64, 64, 3, 3), {"dilation": 2}),
        ((1, 64, 28, 28), (64, 32, 3, 3), {"groups": 2}),
        ((1, 64, 28, 28), (64, 64, 3, 3), {"param": True}),
        ((1, 64, 28, 28), (64, 64, 1, 1), {"padding": 0}),
        ((1, 64, 28, 28), (64, 64, 5, 5), {"padding": 2}),
        ((1, 28, 28, 64), (64, 3, 3, 64), {"layout": ("NHWC", "IHWO")}),
        ((1, 8, 55, 55), (64, 8, 3, 3), {}),  # too few input channels
        ((1, 512, 7, 7), (512, 512, 3, 3), {}),  # ResNet's last: 16 tiles of F(2, 3)
    ],
    ids=["stride2", "dilation2", "groups2", "weight_param", "1x1", "5x5", "ihwo", "8ch", "7x7"],
)
def test_must_not_fire(x_shape, w_shape, kwargs):
    mod, _, _ = conv_relu(x_shape, w_shape, **kwargs)
    _, n = _rewrite(mod)
    assert n == 0


def test_symbolic_shape_left_alone():
    mod, _, _ = conv_relu((tvm.tirx.Var("n", "int64"), 64, 28, 28), (64, 64, 3, 3))
    _, n = _rewrite(mod)
    assert n == 0


def test_cuda_left_alone():
    mod, _, _ = conv_relu((1, 64, 28, 28), (64, 64, 3, 3))
    _, n = _rewrite(mod, parse_target("cuda"))
    assert n == 0
    _, n = _rewrite(mod)  # fires on the CPU
    assert n == 1


@pytest.mark.parametrize(
    "x_shape, padding, m",
    [
        ((1, 32, 13, 7), (1, 1, 1, 1), 2),
        ((1, 32, 13, 7), (1, 1, 1, 1), 4),
        ((3, 32, 5, 5), (0, 0, 0, 0), 2),
        ((1, 32, 5, 5), (0, 0, 0, 0), 4),
        ((1, 32, 1, 1), (1, 1, 1, 1), 4),
        ((2, 32, 7, 13), (0, 2, 1, 0), 4),
        ((3, 32, 7, 13), (2, 0, 0, 1), 2),
    ],
    ids=["13x7_f2", "13x7_f4", "pad0_batch3_f2", "pad0_f4", "1x1_f4", "asym_f4", "asym_f2"],
)
def test_matches_numpy(x_shape, padding, m, monkeypatch):
    monkeypatch.setattr(winograd_conv, "MIN_TILES", 0)
    monkeypatch.setattr(winograd_conv, "TILE_SIZES", (m,))
    mod, w, b = conv_relu(x_shape, (72, 32, 3, 3), padding=padding)
    x = RNG.standard_normal(x_shape).astype("float32")
    expected = reference(x, w, b, padding)
    with collect_rewrites() as counts:
        compiled = matches_reference(mod, [([x], [expected])], rtol=1e-4, atol=1e-4)
    assert counts.get("WinogradConv", 0) == 1
    assert any(f"winograd_input_f{m}" in gv.name_hint for gv in compiled.lowered.functions)


@pytest.mark.parametrize("m", [2, 4])
def test_float32_accuracy_at_512_channels(m, monkeypatch):
    monkeypatch.setattr(winograd_conv, "MIN_TILES", 0)
    monkeypatch.setattr(winograd_conv, "TILE_SIZES", (m,))
    mod, w, b = conv_relu((1, 512, 8, 8), (64, 512, 3, 3))
    x = RNG.standard_normal((1, 512, 8, 8)).astype("float32")
    expected = reference(x, w, b, (1, 1, 1, 1))
    with collect_rewrites() as counts:
        compiled = engine.compile_module(mod, host_target(), "tvm_fusion")
    assert counts.get("WinogradConv", 0) == 1
    (got,) = engine.TvmRunner(compiled, [x]).outputs()
    error = np.abs(got - expected).max() / np.abs(expected).max()
    assert error < 2e-5, error  # float32 rounding: 1e-7 per operation, 4608-term sums


def _onnx_conv_bn_add_relu(c, k, size):
    from onnx import TensorProto, helper, numpy_helper

    arrays = {
        "W": RNG.standard_normal((k, c, 3, 3)) / np.sqrt(9 * c),
        "B": RNG.standard_normal(k),
        "gamma": RNG.uniform(0.5, 1.5, k),
        "beta": RNG.standard_normal(k),
        "mean": RNG.standard_normal(k) * 0.1,
        "var": RNG.uniform(0.5, 1.5, k),
    }
    inits = [numpy_helper.from_array(v.astype("float32"), name) for name, v in arrays.items()]
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["bn"]),
        helper.make_node("Add", ["bn", "x"], ["res"]),  # a residual add (c == k)
        helper.make_node("Relu", ["res"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_bn_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, size, size])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, k, size, size])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)


def test_onnx_conv_bn_add_relu_matches_ort_and_flag():
    from tvm_fusion import load_onnx

    model = _onnx_conv_bn_add_relu(64, 64, 11)
    x = RNG.standard_normal((1, 64, 11, 11)).astype("float32")
    expected = engine.onnxruntime_runner(model, {"x": x}, 1)()
    with collect_rewrites() as counts:
        compiled = matches_reference(load_onnx(model), [([x], expected)], rtol=1e-4, atol=1e-4)
    assert counts.get("FoldBatchNorm", 0) == 1
    # the bias, residual add and ReLU in one kernel after the output transform
    assert any(
        "add" in gv.name_hint and "relu" in gv.name_hint for gv in compiled.lowered.functions
    )
    assert counts.get("WinogradConv", 0) == 1
    with collect_rewrites() as counts:
        engine.compile_module(load_onnx(model), host_target(), "tvm_fusion", winograd_conv=False)
    assert counts.get("WinogradConv", 0) == 0


@pytest.mark.parametrize(
    "x_shape, padding, m, via",
    [
        ((1, 13, 13, 32), (1, 1, 1, 1), 2, "const"),
        ((1, 13, 13, 32), (1, 1, 1, 1), 4, "const"),
        ((2, 7, 5, 32), (0, 2, 1, 0), 4, "const"),
        ((1, 13, 13, 32), (1, 1, 1, 1), 2, "convert_layout"),
    ],
    ids=["13x13_f2", "13x13_f4", "asym_batch2_f4", "convert_layout_f2"],
)
def test_nhwc_matches_numpy(x_shape, padding, m, via, monkeypatch):
    """NHWC / OHWI: the input padded in place (no transpose), the output transform writing
    NHWC, the overhang sliced on (H, W); ``convert_layout``: the NCHW module through stock
    ConvertLayout, whose weight is a permute_dims of the constant (read at compile time)."""
    monkeypatch.setattr(winograd_conv, "MIN_TILES", 0)
    monkeypatch.setattr(winograd_conv, "TILE_SIZES", (m,))
    n_, h_, w_, c_ = x_shape
    if via == "const":
        mod, w, b = conv_relu(x_shape, (72, 3, 3, c_), padding=padding, layout=("NHWC", "OHWI"))
        w_oihw = w.transpose(0, 3, 1, 2)
    else:
        mod, w_oihw, b = conv_relu((n_, c_, h_, w_), (72, c_, 3, 3), padding=padding)
        mod = relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})(mod)
    x = RNG.standard_normal(x_shape).astype("float32")
    expected = reference(x.transpose(0, 3, 1, 2), w_oihw, b, padding).transpose(0, 2, 3, 1)
    if via != "const":  # ConvertLayout's module takes and returns NCHW
        x, expected = x.transpose(0, 3, 1, 2), expected.transpose(0, 3, 1, 2)
    with collect_rewrites() as counts:
        compiled = matches_reference(mod, [([x], [expected])], rtol=1e-4, atol=1e-4)
    assert counts.get("WinogradConv", 0) == 1
    names = [gv.name_hint for gv in compiled.lowered.functions]
    assert any(f"winograd_output_f{m}" in n for n in names)
    assert not any("transpose" in n for n in names if via == "const")  # NHWC in, NHWC out
