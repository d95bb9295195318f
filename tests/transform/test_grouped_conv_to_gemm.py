"""GroupedConvToGemm: a grouped 1 x 1 convolution becomes an einsum per group over views of its
input, its elementwise epilogue (bias, ReLU, a residual add) moved before the view back, so that
FuseOps and the Matmul rule make one kernel of it; numbers against onnxruntime at odd shapes
(groups 2 / 3 / 4, channels 68 / 96 / 128 / 136, widths 7 / 13 / 14) and a symbolic batch.

Must not fire: groups 1, a depthwise convolution, fewer than 32 input channels a group, a 3 x 3
or strided grouped one, a weight that is no constant; an epilogue operand that broadcasts other
than per channel stays on the view.
"""

import numpy as np
import pytest
from tvm import relax
from tvm.relax import op as R

from tvm_fusion import analysis
from tvm_fusion.build import engine
from tvm_fusion.transform import GroupedConvToGemm, collect_rewrites

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from tvm_fusion import load_onnx  # noqa: E402

RNG = np.random.default_rng(39)


def _onnx_model(c, k, hw, groups, batch, relu=True, residual=False):
    """``Relu(Conv(x, W, b) [+ x])`` as ONNX, batch ``batch`` (a name: symbolic)."""
    h, w = hw
    wt = (RNG.standard_normal((k, c // groups, 1, 1)) / np.sqrt(c // groups)).astype("float32")
    b = RNG.standard_normal(k).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=groups)]
    last = "c"
    if residual:
        nodes.append(helper.make_node("Add", ["c", "x"], ["s"]))
        last = "s"
    if relu:
        nodes.append(helper.make_node("Relu", [last], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, h, w])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, k, h, w])],
        [numpy_helper.from_array(wt, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _ort(model, x):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _kernels(lowered) -> dict:
    return {i.name: i.rule for i in analysis.schedule_info(lowered)}


CASES = {
    # ShuffleNet's stage 3 / 4 shapes (channels cut), groups 2 / 3 / 4, odd widths; a group
    # of 32 input channels or more (MIN_GROUP_CHANNELS)
    "g2_c68_14": (68, 68, (14, 14), 2, {}),
    "g4_c136_7": (136, 136, (7, 7), 4, {}),
    "g3_c96_13": (96, 48, (13, 7), 3, {}),
    "g3_c96_7_residual": (96, 96, (7, 13), 3, {"residual": True}),
    "g4_c128_no_relu": (128, 128, (5, 14), 4, {"relu": False}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_numbers_against_onnxruntime(name, target):
    """Symbolic batch (1 and 3): the numbers of onnxruntime; the convolution is an einsum of
    the Matmul rule with its epilogue in the same kernel (no separate add / ReLU kernel)."""
    c, k, hw, groups, extra = CASES[name]
    model = _onnx_model(c, k, hw, groups, "n", **extra)
    with collect_rewrites() as counts:
        compiled = engine.compile_module(load_onnx(model), target, "tvm_fusion")
    assert counts["GroupedConvToGemm"] == 1
    for batch in (1, 3):
        x = RNG.standard_normal((batch, c, *hw)).astype("float32")
        (got,) = engine.TvmRunner(compiled, [x]).outputs()
        np.testing.assert_allclose(got, _ort(model, x), rtol=1e-5, atol=1e-5)
    kernels = _kernels(compiled.lowered)
    gemm = [n for n in kernels if "einsum" in n]
    assert len(gemm) == 1 and kernels[gemm[0]] == "Matmul", kernels
    # the epilogue is in the einsum's kernel: at most a copy of the view back remains
    assert all(rule in ("Matmul", "Injective") for rule in kernels.values()), kernels
    assert not any("relu" in n or "add" in n for n in kernels if n not in gemm), kernels
    assert not analysis.fallback_kernels(compiled.lowered)


def _module(build, shape):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(build(x))
        bb.emit_func_output(out)
    return bb.get()


def _w(*shape):
    return relax.const(RNG.standard_normal(shape).astype("float32"))


def _rewrites(mod) -> int:
    with collect_rewrites() as counts:
        GroupedConvToGemm()(mod)
    return counts["GroupedConvToGemm"]


@pytest.mark.parametrize(
    "build",
    [
        lambda x: R.nn.conv2d(x, _w(64, 64, 1, 1)),  # groups 1: a GEMM already
        lambda x: R.nn.conv2d(x, _w(64, 1, 1, 1), groups=64),  # depthwise
        lambda x: R.nn.conv2d(x, _w(64, 16, 1, 1), groups=4),  # 16 channels a group
        lambda x: R.nn.conv2d(x, _w(64, 32, 3, 3), padding=[1, 1, 1, 1], groups=2),  # 3 x 3
        lambda x: R.nn.conv2d(x, _w(64, 32, 1, 1), strides=[2, 2], groups=2),  # strided
    ],
    ids=["groups1", "depthwise", "short_group", "3x3", "stride2"],
)
def test_must_not_fire(build):
    assert _rewrites(_module(build, (1, 64, 6, 7))) == 0


def test_weight_not_constant_must_not_fire():
    x = relax.Var("x", relax.TensorType((1, 64, 6, 7), "float32"))
    w = relax.Var("w", relax.TensorType((64, 32, 1, 1), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(R.nn.conv2d(x, w, groups=2))
        bb.emit_func_output(out)
    assert _rewrites(bb.get()) == 0


def test_epilogue_broadcast_stays_on_the_view(target):
    """An operand of shape (1, 1, 1, W) broadcasts along the positions, not per channel: the
    add reads the NCHW view (numbers still right), the bias before it is sunk."""
    wt = (RNG.standard_normal((64, 32, 1, 1)) / 6).astype("float32")
    bias = RNG.standard_normal((1, 64, 1, 1)).astype("float32")
    row = RNG.standard_normal((1, 1, 1, 7)).astype("float32")

    def build(x):
        y = R.add(R.nn.conv2d(x, relax.const(wt), groups=2), relax.const(bias))
        return R.multiply(y, relax.const(row))

    mod = _module(build, (2, 64, 6, 7))
    after = GroupedConvToGemm()(mod)
    text = after.script()
    assert "einsum" in text and text.count("R.add(") == 1
    x = RNG.standard_normal((2, 64, 6, 7)).astype("float32")
    xt = x.reshape(2, 2, 32, 42)
    ref = np.einsum("ngcp,gjc->ngjp", xt, wt.reshape(2, 32, 32)).reshape(2, 64, 6, 7)
    compiled = engine.compile_module(mod, target, "tvm_fusion")
    (got,) = engine.TvmRunner(compiled, [x]).outputs()
    np.testing.assert_allclose(got, (ref + bias) * row, rtol=1e-5, atol=1e-5)


def test_pipeline_flag_switches_it_off(target):
    model = _onnx_model(96, 96, (7, 7), 3, 1)
    compiled = engine.compile_module(
        load_onnx(model), target, "tvm_fusion", grouped_conv_to_gemm=False
    )
    assert not any("einsum" in n for n in _kernels(compiled.lowered))


def test_epilogue_of_shared_elementwise_ops_sinks(target):
    """The epilogue ops are the elementwise table SinkViewsPastEpilogues uses too
    (``_common.ELEMENTWISE_*``): a per-channel ``where`` and a tanh-GELU move onto the GEMM's
    layout as well (the old table stopped at them: their kernels read the NCHW view)."""
    wt = (RNG.standard_normal((64, 32, 1, 1)) / 6).astype("float32")
    keep = RNG.standard_normal((1, 64, 1, 1)) > 0

    def build(x):
        y = R.nn.conv2d(x, relax.const(wt), groups=2)
        y = R.where(relax.const(keep), y, relax.const(np.float32(0.5)))
        return R.nn.gelu_tanh(y)

    mod = _module(build, (2, 64, 6, 7))
    after = GroupedConvToGemm()(mod)
    text = after.script()
    assert "einsum" in text and text.count("R.reshape(") == 3, text  # x, the mask, the result
    x = RNG.standard_normal((2, 64, 6, 7)).astype("float32")
    xt = x.reshape(2, 2, 32, 42)
    ref = np.einsum("ngcp,gjc->ngjp", xt, wt.reshape(2, 32, 32)).reshape(2, 64, 6, 7)
    ref = np.where(keep, ref, 0.5)
    ref = 0.5 * ref * (1 + np.tanh(np.sqrt(2 / np.pi) * (ref + 0.044715 * ref**3)))
    compiled = engine.compile_module(mod, target, "tvm_fusion")
    (got,) = engine.TvmRunner(compiled, [x]).outputs()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    kernels = _kernels(compiled.lowered)
    assert not any("where" in n or "gelu" in n for n in kernels if "einsum" not in n), kernels
