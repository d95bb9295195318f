"""ChannelsLast: a CNN whose 1x1 convolutions all write NCHW a scalar at a time runs NHWC.

Structure: a 1x1 convolution at 5 x 5 (25 pixels: no vector divides them) + ReLU + pooling
against the hand-written NHWC graph, on AVX-512 and AVX2 targets. Must not fire: 1x1 work at
4 x 4 (aligned), a grouped convolution, a symbolic batch, float16, 1x1 work mostly aligned (8 x
8, then 5 x 5 after a pooling) on AVX2 (AVX-512 converts it); nor on NEON (4 lanes, not
measured) or CUDA. Numbers: a SqueezeNet Fire module (squeeze 1x1, expand 1x1 and 3x3,
concatenation, pooling) from ONNX, converted, against ONNX Runtime at batch 1 and 3, no kernel
left to the fallback rule; and one with 64 squeezed channels, whose NHWC 3x3 WinogradConv takes.
"""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion import load_onnx
from tvm_fusion.build import engine
from tvm_fusion.target import cuda_target, host_target
from tvm_fusion.tools.analysis import fallback_kernels
from tvm_fusion.transform import ChannelsLast, collect_rewrites

RNG = np.random.default_rng(0)
AVX512 = host_target(mcpu="skylake-avx512")


def _net(convs, x_shape=(1, 4, 5, 5), dtype="float32", pool=False):
    """x -> relu(conv2d(., W_i, groups_i, padding_i)) for each (O, I, k, groups) in ``convs``
    [-> max_pool2d 2 x 2]; weights are parameters after ``x``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, dtype))
    ws = [
        relax.Var(f"w{i}", relax.TensorType((o, c, k, k), dtype))
        for i, (o, c, k, _g) in enumerate(convs)
    ]
    with bb.function("main", [x, *ws]):
        with bb.dataflow():
            y = x
            for w, (_o, _c, k, g) in zip(ws, convs, strict=True):
                pad = (k // 2,) * 4
                y = bb.emit(
                    relax.op.nn.relu(bb.emit(relax.op.nn.conv2d(y, w, padding=pad, groups=g)))
                )
            if pool:
                y = bb.emit(relax.op.nn.max_pool2d(y, 2, 1))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


@I.ir_module
class Expected:
    @R.function
    def main(
        x: R.Tensor((1, 4, 5, 5), dtype="float32"), w0: R.Tensor((16, 4, 1, 1), dtype="float32")
    ) -> R.Tensor((1, 16, 4, 4), dtype="float32"):
        with R.dataflow():
            lv = R.permute_dims(x, axes=[0, 2, 3, 1])
            lv1 = R.permute_dims(w0, axes=[0, 2, 3, 1])
            lv2 = R.nn.conv2d(lv, lv1, data_layout="NHWC", kernel_layout="OHWI", out_layout="NHWC")
            lv3 = R.nn.relu(lv2)
            lv4 = R.nn.max_pool2d(lv3, pool_size=[2, 2], layout="NHWC", out_layout="NHWC")
            gv = R.permute_dims(lv4, axes=[0, 3, 1, 2])
            R.output(gv)
        return gv


@pytest.mark.parametrize("mcpu", ["skylake-avx512", "znver4", "znver3", "haswell"])
def test_structure(mcpu):
    mod = _net([(16, 4, 1, 1)], pool=True)
    with collect_rewrites() as rewrites:
        got = ChannelsLast(host_target(mcpu=mcpu))(mod)
    assert rewrites["ChannelsLast"] == 1
    tvm.ir.assert_structural_equal(got, Expected)


MUST_NOT_FIRE = {
    "aligned 4x4": lambda: _net([(16, 4, 1, 1)], x_shape=(1, 4, 4, 4)),
    "grouped": lambda: _net([(16, 4, 1, 1), (16, 4, 3, 4)]),
    "symbolic batch": lambda: _net([(16, 4, 1, 1)], x_shape=(tvm.tirx.Var("n", "int64"), 4, 5, 5)),
    "float16": lambda: _net([(16, 4, 1, 1)], dtype="float16"),
    "mostly aligned": lambda: _aligned_then_not(),
}


def _aligned_then_not():
    """conv 1x1 4 -> 16 at 8 x 8 (64 pixels: aligned), max_pool2d 4 x 4 -> 5 x 5, conv 1x1
    16 -> 4 at 5 x 5: 4096 aligned products against 1600 unaligned (29%)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "float32"))
    w1 = relax.Var("w1", relax.TensorType((16, 4, 1, 1), "float32"))
    w2 = relax.Var("w2", relax.TensorType((4, 16, 1, 1), "float32"))
    with bb.function("main", [x, w1, w2]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w1))
            y = bb.emit(relax.op.nn.max_pool2d(y, 4, 1))
            out = bb.emit_output(relax.op.nn.conv2d(y, w2))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("case", list(MUST_NOT_FIRE))
def test_must_not_fire(case):
    mod = MUST_NOT_FIRE[case]()
    # mostly aligned 1x1 work stays NCHW on AVX2 only (AVX-512 converts any unaligned share)
    target = host_target(mcpu="znver3") if case == "mostly aligned" else AVX512
    with collect_rewrites() as rewrites:
        got = ChannelsLast(target)(mod)
    assert not rewrites
    tvm.ir.assert_structural_equal(got, mod)


@pytest.mark.parametrize("mcpu", ["skylake-avx512", "znver4"])
def test_avx512_converts_mostly_aligned_work(mcpu):
    """On 16 lanes NHWC won for ResNet-50, DenseNet-121 and Inception v2, whose 1x1 work is
    38-70% unaligned: any unaligned share converts there (MIN_UNALIGNED_WIDE)."""
    mod = _aligned_then_not()
    with collect_rewrites() as rewrites:
        got = ChannelsLast(host_target(mcpu=mcpu))(mod)
    assert rewrites["ChannelsLast"] == 2
    convs = [
        b.value
        for b in got["main"].body.blocks[0].bindings
        if isinstance(b.value, relax.Call) and b.value.op.name == "relax.nn.conv2d"
    ]
    assert [c.attrs.data_layout for c in convs] == ["NHWC", "NHWC"]


@pytest.mark.parametrize(
    "target",
    [
        cuda_target(),
        tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-v1"}),
    ],
    ids=["cuda", "neon"],
)
def test_fewer_lanes_or_gpu_left_alone(target):
    mod = _net([(16, 4, 1, 1)], pool=True)
    tvm.ir.assert_structural_equal(ChannelsLast(target)(mod), mod)


def _fire_model(batch: int, hw: int = 13, sq: int = 8, ex: int = 16):
    """A SqueezeNet Fire module as ONNX: squeeze 1x1 (32 -> sq) + ReLU, expand 1x1 (sq -> ex)
    and 3x3 (sq -> ex, pad 1) + ReLU, Concat on the channels, MaxPool 3 x 3 stride 2 (ceil)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def w(name, shape):
        return numpy_helper.from_array(
            (RNG.standard_normal(shape) * (2 / np.prod(shape[1:])) ** 0.5).astype("float32"), name
        )

    def b(name, n):
        return numpy_helper.from_array((RNG.standard_normal(n) * 0.1).astype("float32"), name)

    nodes = [
        helper.make_node("Conv", ["x", "ws", "bs"], ["s0"]),
        helper.make_node("Relu", ["s0"], ["s"]),
        helper.make_node("Conv", ["s", "w1", "b1"], ["e10"]),
        helper.make_node("Relu", ["e10"], ["e1"]),
        helper.make_node("Conv", ["s", "w3", "b3"], ["e30"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["e30"], ["e3"]),
        helper.make_node("Concat", ["e1", "e3"], ["c"], axis=1),
        helper.make_node("MaxPool", ["c"], ["y"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
    ]
    inits = [
        w("ws", (sq, 32, 1, 1)),
        b("bs", sq),
        w("w1", (ex, sq, 1, 1)),
        b("b1", ex),
        w("w3", (ex, sq, 3, 3)),
        b("b3", ex),
    ]
    graph = helper.make_graph(
        nodes,
        "fire",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 32, hw, hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize(
    "batch, sq, ex", [(1, 8, 16), (3, 8, 16), (1, 16, 64)], ids=["b1", "b3", "b1_winograd"]
)
def test_fire_module_matches_onnxruntime(batch, sq, ex):
    """Run on the host, built with the host's ISA, the decision taken by an AVX-512 pass
    instance (a host of fewer lanes would leave it NCHW): the numbers of NHWC. 16 -> 64: the
    3x3 convolution by WinogradConv in NHWC (13 x 13: 49 tiles of F(2, 3))."""
    model = _fire_model(batch, sq=sq, ex=ex)
    x = RNG.standard_normal((batch, 32, 13, 13)).astype("float32")
    mod = load_onnx(model)
    with collect_rewrites() as rewrites:
        mod = ChannelsLast(AVX512)(mod)
        compiled = engine.compile_module(mod, host_target(), "tvm_fusion")
    assert rewrites["ChannelsLast"] == 3
    assert rewrites["WinogradConv"] == (sq >= 16)  # 8 input channels: under its minimum
    ours = engine.TvmRunner(compiled, [x]).outputs()[0]
    ref = engine.onnxruntime_runner(model, {"x": x}, 1)()[0]
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    assert fallback_kernels(compiled.lowered) == []


@pytest.mark.parametrize("hw", [13, 3])
def test_torch_export_fire_module(hw):
    """The same block through torch.export (batch 2): squeeze 32 -> 16, expand 16 -> 64 (1x1
    and 3x3), concatenation, ceil-mode pooling, a mean; against torch. At 13 x 13 the 3x3 is
    NHWC Winograd; at 3 x 3 (too few tiles) it stays a direct convolution."""
    import torch

    from tvm_fusion.frontend.load import import_exported_program

    class Fire(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sq = torch.nn.Conv2d(32, 16, 1)
            self.e1 = torch.nn.Conv2d(16, 64, 1)
            self.e3 = torch.nn.Conv2d(16, 64, 3, padding=1)

        def forward(self, x):
            y = torch.relu(self.sq(x))
            y = torch.cat([torch.relu(self.e1(y)), torch.relu(self.e3(y))], 1)
            return torch.nn.functional.max_pool2d(y, 3, 2, ceil_mode=True).mean((2, 3))

    torch.manual_seed(0)
    model = Fire().eval()
    x = torch.randn(2, 32, hw, hw)
    with collect_rewrites() as rewrites:
        mod = ChannelsLast(AVX512)(import_exported_program(torch.export.export(model, (x,))))
        compiled = engine.compile_module(mod, host_target(), "tvm_fusion")
    assert rewrites["ChannelsLast"] == 3
    assert rewrites["WinogradConv"] == (hw == 13)
    with torch.no_grad():
        ref = model(x).numpy()
    np.testing.assert_allclose(
        engine.TvmRunner(compiled, [x.numpy()]).outputs()[0], ref, rtol=1e-4, atol=1e-4
    )
    assert fallback_kernels(compiled.lowered) == []
