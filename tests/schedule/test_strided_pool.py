"""Max pooling with a stride over the width (tvm_fusion.lower.pooling + the window rule).

The input planes are deinterleaved (``d[.., h, p, j] = x[.., h, s * j + p]``) so that the
window rule vectorises the output row with contiguous loads. Checked: the numbers against
torch at odd sizes (a vector tail, rows narrower than a vector, padding, ceil mode, k < s,
k > 2 s, a fused ReLU before the pool), the rule (before, an unpadded pool went to the row rule
as a scalar loop, a padded one to the window rule with its row left plain) and the vectorised
row, on an explicit AVX2 target; and the window rule's row with a vector tail (its init split off
first), which the deinterleaved pool rows take too.
"""

import re

import numpy as np
import pytest
import tvm
from helpers import run
from tvm import relax
from tvm.relax import op as R

from tvm_fusion import analysis
from tvm_fusion.build import engine

torch = pytest.importorskip("torch")
F = torch.nn.functional

RNG = np.random.default_rng(39)
AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})

# (channels, height, width), pool, strides, padding (top, left, bottom, right), ceil mode
CASES = {
    "squeezenet_k3s2_odd": ((5, 27, 27), (3, 3), (2, 2), (0, 0, 0, 0), False),
    "k3s2_tail": ((3, 9, 41), (3, 3), (2, 2), (0, 0, 0, 0), False),
    "k3s2_padded": ((3, 13, 37), (3, 3), (2, 2), (1, 1, 1, 1), False),
    "k3s2_ceil": ((2, 12, 30), (3, 3), (2, 2), (0, 0, 0, 0), True),
    "k2s2_even": ((4, 8, 34), (2, 2), (2, 2), (0, 0, 0, 0), False),
    "k2s3_gap": ((2, 10, 29), (2, 2), (3, 3), (0, 0, 0, 0), False),
    "k5s2_rect": ((2, 11, 23), (3, 5), (1, 2), (1, 2, 1, 2), False),
}


def _module(shape, pool, strides, padding, ceil, relu=False):
    x = relax.Var("x", relax.TensorType((1, *shape), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = R.nn.relu(x) if relu else x
            out = bb.emit_output(
                R.nn.max_pool2d(y, pool_size=pool, strides=strides, padding=padding, ceil_mode=ceil)
            )
        bb.emit_func_output(out)
    return bb.get()


def _reference(x, pool, strides, padding, ceil, relu=False):
    t = torch.from_numpy(x)
    t = F.relu(t) if relu else t
    top, left, bottom, right = padding
    t = F.pad(t, (left, right, top, bottom), value=-np.inf)
    return F.max_pool2d(t, pool, strides, 0, ceil_mode=ceil).numpy()


@pytest.mark.parametrize("name", list(CASES))
def test_strided_max_pool_numbers(name, target):
    shape, pool, strides, padding, ceil = CASES[name]
    relu = name == "squeezenet_k3s2_odd"
    x = RNG.standard_normal((1, *shape)).astype("float32")
    (got,), compiled = run(_module(shape, pool, strides, padding, ceil, relu), [x], target=target)
    np.testing.assert_array_equal(got, _reference(x, pool, strides, padding, ceil, relu))
    assert not analysis.fallback_kernels(compiled.lowered)


@pytest.mark.parametrize("name", ["squeezenet_k3s2_odd", "k3s2_tail", "k3s2_padded"])
def test_strided_max_pool_vectorised_row(name):
    """The window rule schedules the pool; its row reads the deinterleaved planes at the
    output column (contiguous), and the kernel built for AVX2 takes its maxima 8 lanes at a
    time (``vmaxps`` on ymm registers; built, not run: the test must not depend on the
    host's CPU)."""
    shape, pool, strides, padding, ceil = CASES[name]
    compiled = engine.compile_module(
        _module(shape, pool, strides, padding, ceil), AVX2, "tvm_fusion"
    )
    (func,) = [f for f in compiled.lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert func.attrs["tvm_fusion.schedule_rule"] == "WindowReduction"
    script = func.script()
    assert "tvm_fusion.deinterleave" in script
    update = script[script.index('T.sblock("pool_max') :]
    assert re.search(r"deinterleaved\[[^\]]*v4 // T\.int64\(2\) \+ v2\]", update), update
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), AVX2)
    asm = lib.mod.inspect_source("asm") if hasattr(lib, "mod") else lib.inspect_source("asm")
    assert re.search(r"vmaxps\s+[^\n]*ymm", asm), "the pool's maxima are not vectorised"


def test_unit_stride_keeps_stock_legalisation(target):
    """Stride 1 over the width: the stock pool (no deinterleaved copy), still the window rule."""
    shape, pool = (3, 9, 11), (3, 3)
    x = RNG.standard_normal((1, *shape)).astype("float32")
    (got,), compiled = run(_module(shape, pool, (1, 1), (1, 1, 1, 1), False), [x], target=target)
    np.testing.assert_array_equal(got, _reference(x, pool, (1, 1), (1, 1, 1, 1), False))
    (func,) = [f for f in compiled.lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert "tvm_fusion.deinterleave" not in func.script()


@pytest.mark.parametrize("kind", ["llvm", "cuda"])
def test_deinterleaved_on_cpu_targets_only(kind):
    """GPU targets keep the stock legalisation (dlight's rules inline such a copy)."""
    from tvm_fusion import target as _target
    from tvm_fusion.build import pipeline

    shape, pool, strides, padding, ceil = CASES["squeezenet_k3s2_odd"]
    target = AVX2 if kind == "llvm" else _target.parse_target("cuda:sm_80")
    with target:
        mod = tvm.transform.Sequential(pipeline.lowering_passes(fast_math=True))(
            _module(shape, pool, strides, padding, ceil)
        )
    funcs = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    deinterleaved = any("tvm_fusion.deinterleave" in f.script() for f in funcs)
    assert deinterleaved == (kind == "llvm")


def test_row_with_tail_splits_its_init_first(target):
    """A window row of whole vectors and a tail (depthwise 3 x 3, 19 wide): the init is split
    off before the row is partitioned, so no part keeps it inside the window loops (a branch
    that TVM's vectoriser scalarised); the numbers against torch."""
    weight = RNG.standard_normal((4, 1, 3, 3)).astype("float32")
    x_var = relax.Var("x", relax.TensorType((1, 4, 7, 19), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x_var]):
        with bb.dataflow():
            conv = R.nn.conv2d(x_var, relax.const(weight), padding=[1, 1, 1, 1], groups=4)
            out = bb.emit_output(conv)
        bb.emit_func_output(out)
    x = RNG.standard_normal((1, 4, 7, 19)).astype("float32")
    (got,), compiled = run(bb.get(), [x], target=target)
    want = F.conv2d(torch.from_numpy(x), torch.from_numpy(weight), padding=1, groups=4)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    (func,) = [f for f in compiled.lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert func.attrs["tvm_fusion.schedule_rule"] == "WindowReduction"
    assert "T.init()" not in func.script()
