"""The CPU WindowReduction rule: depthwise convolution and pooling (1d, 2d, 3d) as the importers
emit them in NCHW, scheduled by the rule instead of the fallback, at odd sizes (a vector tail),
with a symbolic batch (and symbolic spatial axes), numbers against torch; also a channel
multiplier (groups < output channels) and dilation.

Must not fire: a regular convolution (a reduction over input channels: the Matmul rule's), a
GEMM, a row sum.
"""

import numpy as np
import pytest
import tvm
from helpers import fused_prim_funcs, run
from tvm import relax
from tvm.relax import op as R
from tvm.script import tirx as T

from tvm_fusion import analysis
from tvm_fusion.schedule import cpu

torch = pytest.importorskip("torch")
F = torch.nn.functional

RNG = np.random.default_rng(35)
DW = RNG.standard_normal((5, 1, 3, 3)).astype("float32") / 3
DW_BIAS = RNG.standard_normal(5).astype("float32")
DW2 = RNG.standard_normal((8, 1, 3, 3)).astype("float32") / 3
DW7 = RNG.standard_normal((3, 1, 7, 7)).astype("float32") / 7
CONV = RNG.standard_normal((4, 3, 3, 3)).astype("float32") / 3


def _t(a):
    return torch.from_numpy(a)


CASES = {
    # (b, 5, 9, 19): a row of 19 outputs, 2 vectors and a tail of 3; bias as an epilogue
    "depthwise_bias": (
        lambda x: R.add(
            R.nn.conv2d(x, relax.const(DW), padding=[1, 1, 1, 1], groups=5),
            relax.const(DW_BIAS.reshape(1, 5, 1, 1)),
        ),
        (5, 9, 19),
        lambda x: F.conv2d(_t(x), _t(DW), _t(DW_BIAS), padding=1, groups=5),
    ),
    # (b, 4, 10, 24): whole vectors, no tail; a fused activation
    "depthwise_tile": (
        lambda x: R.nn.relu(R.nn.conv2d(x, relax.const(DW[:4]), padding=[1, 1, 1, 1], groups=4)),
        (4, 10, 24),
        lambda x: F.relu(F.conv2d(_t(x), _t(DW[:4]), padding=1, groups=4)),
    ),
    # ConvNeXt's 7 x 7, stride 2 and a row narrower than a vector
    "depthwise_k7_s2": (
        lambda x: R.nn.conv2d(x, relax.const(DW7), strides=[2, 2], padding=[3, 3, 3, 3], groups=3),
        (3, 11, 13),
        lambda x: F.conv2d(_t(x), _t(DW7), stride=2, padding=3, groups=3),
    ),
    # a channel multiplier of 2 (8 output channels from 4 groups)
    "depthwise_multiplier": (
        lambda x: R.nn.conv2d(x, relax.const(DW2), padding=[1, 1, 1, 1], groups=4),
        (4, 9, 11),
        lambda x: F.conv2d(_t(x), _t(DW2), padding=1, groups=4),
    ),
    "maxpool2d_dilated": (
        lambda x: R.nn.max_pool2d(x, pool_size=[3, 3], dilation=[2, 2], padding=[1, 1, 1, 1]),
        (4, 9, 11),
        lambda x: F.max_pool2d(_t(x), 3, 1, 1, dilation=2),
    ),
    # ResNet's stem pooling at odd sizes
    "maxpool2d": (
        lambda x: R.nn.max_pool2d(x, pool_size=[3, 3], strides=[2, 2], padding=[1, 1, 1, 1]),
        (3, 13, 37),
        lambda x: F.max_pool2d(_t(x), 3, 2, 1),
    ),
    "avgpool2d": (
        lambda x: R.nn.avg_pool2d(
            x, pool_size=[3, 3], strides=[2, 2], padding=[1, 1, 1, 1], count_include_pad=False
        ),
        (2, 11, 35),
        lambda x: F.avg_pool2d(_t(x), 3, 2, 1, count_include_pad=False),
    ),
    "maxpool1d": (
        lambda x: R.nn.max_pool1d(x, pool_size=[3], strides=[2], padding=[1, 1]),
        (4, 41),
        lambda x: F.max_pool1d(_t(x), 3, 2, 1),
    ),
    "avgpool3d": (
        lambda x: R.nn.avg_pool3d(x, pool_size=[3, 3, 3], strides=[2, 2, 2], padding=[1] * 6),
        (2, 5, 7, 9),
        lambda x: F.avg_pool3d(_t(x), 3, 2, 1),
    ),
    # a window as wide as the input: rows of one output
    "maxpool2d_width_1": (
        lambda x: R.nn.max_pool2d(x, pool_size=[3, 5], padding=[1, 0, 1, 0]),
        (3, 7, 5),
        lambda x: F.max_pool2d(_t(x), (3, 5), 1, (1, 0)),
    ),
}


def _module(build, shape):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(build(x))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("name", list(CASES))
def test_window_rule_numbers(name, target):
    build, shape, reference = CASES[name]
    mod = _module(build, (tvm.tirx.Var("batch", "int64"), *shape))
    compiled = None
    for batch in (1, 3):
        x = RNG.standard_normal((batch, *shape)).astype("float32")
        if compiled is None:
            (got,), compiled = run(mod, [x], target=target)
        else:
            from tvm_fusion.build import engine

            (got,) = engine.TvmRunner(compiled, [x]).outputs()
        np.testing.assert_allclose(got, reference(x).numpy(), rtol=1e-5, atol=1e-5)
    rules = {i.name: i.rule for i in analysis.schedule_info(compiled.lowered)}
    assert set(rules.values()) == {"WindowReduction"}, rules
    assert not analysis.fallback_kernels(compiled.lowered)


def test_window_rule_symbolic_spatial(target):
    """Symbolic batch, height and width: the rows and the innermost loop stay whole."""
    n, h, w = (tvm.tirx.Var(v, "int64") for v in ("n", "h", "w"))
    build = CASES["maxpool2d"][0]
    mod = _module(build, (n, 3, h, w))
    x = RNG.standard_normal((2, 3, 10, 23)).astype("float32")
    (got,), compiled = run(mod, [x], target=target)
    np.testing.assert_allclose(got, F.max_pool2d(_t(x), 3, 2, 1).numpy(), rtol=1e-6)
    rules = {i.name: i.rule for i in analysis.schedule_info(compiled.lowered)}
    assert set(rules.values()) == {"WindowReduction"}, rules


def _prim_func(mod, target):
    (func,) = fused_prim_funcs(mod, target, layout_free=False)
    return func


@T.prim_func(s_tir=True)
def _gemm(a: T.Buffer((7, 9), "float32"), b: T.Buffer((9, 5), "float32"), c: T.Buffer((7, 5))):
    for i, j, k in T.grid(7, 5, 9):
        with T.sblock("gemm"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                c[vi, vj] = T.float32(0)
            c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]


@T.prim_func(s_tir=True)
def _row_sum(a: T.Buffer((7, 9), "float32"), c: T.Buffer((7,), "float32")):
    for i, k in T.grid(7, 9):
        with T.sblock("sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                c[vi] = T.float32(0)
            c[vi] = c[vi] + a[vi, vk]


def test_window_rule_must_not_fire(target):
    """A regular convolution reduces over input channels too: not a window reduction."""
    conv = _prim_func(
        _module(lambda x: R.nn.conv2d(x, relax.const(CONV), padding=[1, 1, 1, 1]), (1, 3, 9, 11)),
        target,
    )
    for func in (conv, _gemm, _row_sum):
        assert cpu.WindowReduction().apply(func, target, False) is None
