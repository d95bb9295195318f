"""The CPU GroupedConv rule: grouped convolutions (groups 2 to 8, 1 x 1 and 3 x 3, stride 1 and 2,
padding, odd sizes, fused epilogues) as a GEMM per group, numbers against torch at a symbolic
batch of 1 and 3; every target of the matrix schedules them with the rule, no fallback kernel.

Must not fire: a regular convolution (the Matmul rule's), a depthwise one (the window rule's).
The pipeline's GroupedConvToGemm (which makes the 1 x 1 ones einsums for the Matmul rule) is off
here: these tests are the rule's.
"""

import numpy as np
import pytest
import tvm
from helpers import run
from tvm import relax, s_tir
from tvm.relax import op as R

from tvm_fusion import analysis, build_pipeline
from tvm_fusion.build import engine
from tvm_fusion.target import vector_lanes
from tvm_fusion.tir_util import iter_stmts

torch = pytest.importorskip("torch")
F = torch.nn.functional

RNG = np.random.default_rng(39)


def _w(*shape):
    return (RNG.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype("float32")


W_G3 = _w(24, 4, 1, 1)
W_G4 = _w(32, 4, 1, 1)
W_G8 = _w(16, 2, 3, 3)
W_G4_3 = _w(12, 2, 3, 3)
W_G2 = _w(6, 3, 1, 1)
BIAS = RNG.standard_normal(24).astype("float32")


def _t(a):
    return torch.from_numpy(a)


CASES = {
    # ShuffleNet's grouped 1 x 1 (groups 3) at 7 x 7: a vector of 7 positions
    "g3_1x1": (
        lambda x: R.nn.conv2d(x, relax.const(W_G3), groups=3),
        (12, 7, 7),
        lambda x: F.conv2d(_t(x), _t(W_G3), groups=3),
    ),
    # with a bias and a ReLU folded into the write-back
    "g3_1x1_bias_relu": (
        lambda x: R.nn.relu(
            R.add(
                R.nn.conv2d(x, relax.const(W_G3), groups=3),
                relax.const(BIAS.reshape(1, 24, 1, 1)),
            )
        ),
        (12, 5, 12),
        lambda x: F.relu(F.conv2d(_t(x), _t(W_G3), _t(BIAS), groups=3)),
    ),
    # groups 4 at 14 x 14 (ShuffleNet's stage 3 shape, fewer channels)
    "g4_1x1_14": (
        lambda x: R.nn.conv2d(x, relax.const(W_G4), groups=4),
        (16, 14, 14),
        lambda x: F.conv2d(_t(x), _t(W_G4), groups=4),
    ),
    # groups 8, 3 x 3, stride 2, padding 1, odd sizes: a padded copy, rows of positions
    "g8_3x3_s2_pad": (
        lambda x: R.nn.conv2d(x, relax.const(W_G8), strides=[2, 2], padding=[1, 1, 1, 1], groups=8),
        (16, 11, 23),
        lambda x: F.conv2d(_t(x), _t(W_G8), stride=2, padding=1, groups=8),
    ),
    # groups 4, 3 x 3, stride 1, padding 1: 3 output channels per group
    "g4_3x3_pad": (
        lambda x: R.nn.conv2d(x, relax.const(W_G4_3), padding=[1, 1, 1, 1], groups=4),
        (8, 9, 12),
        lambda x: F.conv2d(_t(x), _t(W_G4_3), padding=1, groups=4),
    ),
    # groups 2, 1 x 1, stride 2: the input read with a stride
    "g2_1x1_s2": (
        lambda x: R.nn.conv2d(x, relax.const(W_G2), strides=[2, 2], groups=2),
        (6, 9, 10),
        lambda x: F.conv2d(_t(x), _t(W_G2), stride=2, groups=2),
    ),
}

# rows of 13 and 11 (prime): one vector of the row where it fits (AVX-512's 16 lanes: 13 or 11
# of them), else no vector tail in the rule: the window rule's (AVX2, NEON; numbers still right)
DECLINED = {
    "g3_1x1_13": (
        lambda x: R.nn.conv2d(x, relax.const(W_G3), groups=3),
        (12, 13, 13),
        lambda x: F.conv2d(_t(x), _t(W_G3), groups=3),
    ),
    "g4_3x3_11": (
        lambda x: R.nn.conv2d(x, relax.const(W_G4_3), padding=[1, 1, 1, 1], groups=4),
        (8, 5, 11),
        lambda x: F.conv2d(_t(x), _t(W_G4_3), padding=1, groups=4),
    ),
}


ROWS = {"g3_1x1_13": 13, "g4_3x3_11": 11}


def _takes(name: str, target) -> bool:
    """Whether the rule takes case ``name`` on ``target``: a prime row only as one vector."""
    return name in CASES or ROWS[name] <= vector_lanes(target, "float32")


def _module(build, shape):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(build(x))
        bb.emit_func_output(out)
    return bb.get()


def _rules(lowered) -> dict:
    return {i.name: i.rule for i in analysis.schedule_info(lowered)}


@pytest.mark.parametrize("name", list(CASES) + list(DECLINED))
def test_grouped_conv_numbers(name, target):
    build, shape, reference = {**CASES, **DECLINED}[name]
    mod = _module(build, (tvm.tirx.Var("batch", "int64"), *shape))
    compiled = None
    for batch in (1, 3):
        x = RNG.standard_normal((batch, *shape)).astype("float32")
        if compiled is None:
            (got,), compiled = run(mod, [x], target=target, grouped_conv_to_gemm=False)
        else:
            (got,) = engine.TvmRunner(compiled, [x]).outputs()
        np.testing.assert_allclose(got, reference(x).numpy(), rtol=1e-5, atol=1e-5)
    rules = _rules(compiled.lowered)
    assert ("GroupedConv" in rules.values()) == _takes(name, target), rules
    assert not analysis.fallback_kernels(compiled.lowered)


@pytest.mark.parametrize("name", list(DECLINED))
def test_prime_rows_follow_the_lanes(cpu_target, name):
    """Compile-only: rows of 13 and 11 are the rule's where one vector holds them (16 lanes),
    the window rule's where they do not (8 and 4 lanes); no fallback kernel either way."""
    build, shape, _ = DECLINED[name]
    with cpu_target:
        lowered = build_pipeline(cpu_target, grouped_conv_to_gemm=False)(
            _module(build, (1, *shape))
        )
    rules = _rules(lowered)
    assert ("GroupedConv" in rules.values()) == _takes(name, cpu_target), rules
    assert not analysis.fallback_kernels(lowered), rules


# rows of 12: 3/4 of a vector or more on every target of the matrix (4, 8, 16 lanes)
@pytest.mark.parametrize("name", ["g3_1x1_bias_relu", "g8_3x3_s2_pad"])
def test_grouped_conv_on_every_target(cpu_target, name):
    """Compile-only: each target of the matrix schedules it with the rule, none falls back."""
    build, shape, _ = CASES[name]
    with cpu_target:
        lowered = build_pipeline(cpu_target, grouped_conv_to_gemm=False)(
            _module(build, (1, *shape))
        )
    rules = _rules(lowered)
    assert "GroupedConv" in rules.values(), rules
    assert not analysis.fallback_kernels(lowered), rules


def test_grouped_conv_must_not_fire(target):
    """Groups 1 (a GEMM of the Matmul rule) and depthwise (a window of the window rule)."""
    dense = _module(lambda x: R.nn.conv2d(x, relax.const(_w(4, 3, 3, 3))), (1, 3, 9, 11))
    depthwise = _module(
        lambda x: R.nn.conv2d(x, relax.const(_w(6, 1, 3, 3)), padding=[1, 1, 1, 1], groups=6),
        (1, 6, 9, 11),
    )
    for mod in (dense, depthwise):
        with target:
            lowered = build_pipeline(target)(mod)
        assert "GroupedConv" not in _rules(lowered).values(), _rules(lowered)


def test_grouped_conv_padding_is_a_copy(target):
    """A padded convolution reads a padded copy: no ``if_then_else`` in the tile's loads (TVM's
    vectoriser would load lane by lane)."""
    build, shape, _ = CASES["g4_3x3_pad"]
    with target:
        lowered = build_pipeline(target)(_module(build, (1, *shape)))
    (func,) = [
        f
        for f in lowered.functions.values()
        if isinstance(f, tvm.tirx.PrimFunc)
        and str(f.attrs.get("tvm_fusion.schedule_rule", "")) == "GroupedConv"
    ]
    updates = [
        s
        for s in iter_stmts(func.body)
        if isinstance(s, s_tir.SBlock) and s.name_hint.endswith("_update")
    ]
    assert updates
    assert all("if_then_else" not in s.body.script() for s in updates)
