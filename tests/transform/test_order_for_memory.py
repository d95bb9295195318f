"""OrderForMemory: reorder the grouped program so that large tensors die early.

Must not fire: a block with symbolic sizes, a block already in a good order, a small
accumulation group.
"""

import numpy as np
import tvm
import tvm.testing
from helpers import Base
from tvm import relax, te, tirx
from tvm.relax import op as R

import tvm_fusion
from tvm_fusion import analysis
from tvm_fusion.build import engine
from tvm_fusion.models.cross_entropy import lm_head_module
from tvm_fusion.transform import (
    FuseCrossEntropy,
    FuseLinearCrossEntropy,
    OrderForMemory,
    collect_rewrites,
)


class OrderBase(Base):
    transform = OrderForMemory()


def _expand(x):  # (n,) -> (n, 1024): a large output from a small input
    return te.compute((x.shape[0], 1024), lambda i, j: x[i] * j.astype("float32"), name="expand")


def _total(x):  # (n, 1024) -> (n,)
    k = te.reduce_axis((0, 1024), "k")
    return te.compute((x.shape[0],), lambda i: te.sum(x[i, k], axis=k), name="total")


def _scale(x):
    return te.compute(x.shape, lambda *i: x(*i) * 2.0, name="scale")


def _program(n, layout: str):
    """``big = expand(x)`` read by ``total(big)``, and three small steps: ``early`` makes
    ``big`` first and reads it last; ``together`` makes and reads it first; ``late`` makes
    and reads it last."""
    x = relax.Var("x", relax.TensorType((n,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            if layout in ("early", "together"):
                big = bb.emit_te(_expand, x, primfunc_name_hint="expand")
            if layout == "together":
                t = bb.emit_te(_total, big, primfunc_name_hint="total")
            s = x
            for _ in range(3):
                s = bb.emit_te(_scale, s, primfunc_name_hint="scale")
            if layout == "late":
                big = bb.emit_te(_expand, x, primfunc_name_hint="expand")
            if layout != "together":
                t = bb.emit_te(_total, big, primfunc_name_hint="total")
            out = bb.emit_output(R.add(t, s))
        bb.emit_func_output(out)
    return bb.get()


class TestLargeTensorDiesEarly(OrderBase):
    """The (n, 1024) tensor was made first and read last, alive over three steps; its reader
    moves up to it (it frees more than it allocates)."""

    Before = _program(64, "early")
    Expected = _program(64, "together")


class TestNoFireGoodOrder(OrderBase):
    Before = _program(64, "late")
    Expected = Before


class TestNoFireSymbolicSizes(OrderBase):
    """Symbolic sizes: nothing can be compared, nothing moves."""

    n = tirx.Var("n", "int64")
    Before = _program(n, "early")
    Expected = Before


def test_chunked_backward_keeps_one_chunk_alive():
    """FuseLinearCrossEntropy's backward: FuseOps computes every chunk's logit gradient before
    the first matmul reads one, and fuses the weight-gradient accumulation into one group of
    8 partials; reordered, the planned peak drops below half, with the same numbers."""
    n, k, v, rows = 512, 64, 8192, 64
    target = tvm_fusion.host_target()
    mod = tvm.transform.Sequential(
        [FuseCrossEntropy(target), FuseLinearCrossEntropy(target, rows=rows)]
    )(lm_head_module(n, k, v, reduction="sum"))
    params = mod["main"].params
    grad = relax.transform.Gradient("main", require_grads=[params[0], params[1]])(mod)
    rng = np.random.default_rng(0)
    args = [
        rng.standard_normal((n, k)).astype("float32"),
        (rng.standard_normal((v, k)) / 8).astype("float32"),
        rng.integers(0, v, n).astype("int64"),
    ]
    results = {}
    for flag in (False, True):
        with collect_rewrites() as counts:
            compiled = engine.compile_module(grad, target, "tvm_fusion", order_for_memory=flag)
        outs = engine.TvmRunner(compiled, args, "main_adjoint").outputs()
        peak = analysis.peak_bytes(compiled.lowered, "main_adjoint")
        names = [gv.name_hint for gv in compiled.lowered.get_global_vars()]
        results[flag] = (outs, peak, names, counts["OrderForMemory"])
    plain, ordered = results[False], results[True]
    assert ordered[3] > 0 and plain[3] == 0
    assert any("add1_add1" in name for name in plain[2])  # the accumulation group
    assert not any("add1_add1" in name for name in ordered[2])
    assert ordered[1] <= plain[1] / 2
    assert ordered[1] <= 4 * rows * v * 4 + 2 * v * k * 4  # a few chunks, two weight grads
    for a, b in zip(plain[0], ordered[0], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


if __name__ == "__main__":
    tvm.testing.main()
