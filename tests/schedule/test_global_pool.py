"""The CPU row rule on a global average pool, ``mean(x, axis=[2, 3], keepdims=True)`` over a
window that no vector divides (SqueezeNet's 1000 x 13 x 13, ResNet-50's 2048 x 7 x 7).

At batch 1 the row rule took it for one row (the output's unit axes dropped, the channels its
innermost) and reduced every channel in one scalar chain, serially: 66 us for SqueezeNet's,
against 9 us for MetaSchedule's best in a tuning run. Now the channels are rows, in parallel,
and each 13 x 13 window is summed as 13 partials (one 13-lane vector per window row, rfactor),
11 us (AVX-512, two threads). Compile-only checks over the target matrix; numbers on the host.
"""

import numpy as np
import pytest
import tvm
from helpers import fused_prim_funcs, run
from tvm import relax

from tvm_fusion import tir_util
from tvm_fusion.schedule import cpu

RNG = np.random.default_rng(13)


def _mean_module(shape):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.mean(x, axis=[2, 3], keepdims=True)))
        bb.emit_func_output(out)
    return bb.get()


def _loops(func, kind):
    return [int(lp.extent) for lp in tir_util.loops(func) if lp.kind == kind]


@pytest.mark.parametrize("shape", [(1, 1000, 13, 13), (1, 2048, 7, 7), (2, 256, 13, 13)])
def test_channels_parallel_window_rows_vectorised(cpu_target, shape):
    (func,) = fused_prim_funcs(_mean_module(shape), cpu_target, layout_free=False)
    sch = cpu.RowReduction().apply(func, cpu_target, False)
    assert sch is not None
    scheduled = sch.mod["main"]
    assert _loops(scheduled, tvm.tirx.ForKind.PARALLEL) == [shape[0] * shape[1]]
    assert shape[3] in _loops(scheduled, tvm.tirx.ForKind.VECTORIZED)


def test_short_window_row_stays_scalar():
    """A window row under ``MIN_WINDOW_LANES`` (3 wide) is not worth a vector."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    (func,) = fused_prim_funcs(_mean_module((1, 256, 5, 3)), target, layout_free=False)
    sch = cpu.RowReduction().apply(func, target, False)
    assert sch is not None
    assert 3 not in _loops(sch.mod["main"], tvm.tirx.ForKind.VECTORIZED)


@pytest.mark.parametrize(
    "shape", [(1, 1000, 13, 13), (3, 40, 7, 7), (1, 17, 5, 3), (2, 8, 16, 16), (1, 5, 9, 4)]
)
def test_numbers_match_numpy(target, shape):
    x = RNG.standard_normal(shape).astype("float32")
    out, _ = run(_mean_module(shape), [x], "tvm_fusion", target=target)
    np.testing.assert_allclose(out[0], x.mean(axis=(2, 3), keepdims=True), rtol=1e-5, atol=1e-6)


def test_symbolic_batch_matches_numpy(target):
    n = tvm.tirx.Var("n", "int64")
    x = RNG.standard_normal((3, 64, 7, 7)).astype("float32")
    out, _ = run(_mean_module((n, 64, 7, 7)), [x], "tvm_fusion", target=target)
    np.testing.assert_allclose(out[0], x.mean(axis=(2, 3), keepdims=True), rtol=1e-5, atol=1e-6)
