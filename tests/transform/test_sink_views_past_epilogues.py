"""SinkViewsPastEpilogues: the view that unflattens a GEMM's rows moves past its elementwise
epilogue, so that FuseOps puts the GEMM and the epilogue in one kernel.

Must not fire: a view that changes the last axis; an operand that broadcasts other than along
the last axis; a view of something other than a GEMM result.
"""

import numpy as np
import tvm
import tvm.testing
from helpers import Base, compare_pipelines
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion import analysis
from tvm_fusion.transform import SinkViewsPastEpilogues, collect_rewrites


class SinkBase(Base):
    transform = SinkViewsPastEpilogues()


class TestScaleAndResidual(SinkBase):
    """view(-1, K) -> matmul -> view(b, s, N) -> * 0.5 -> + residual: the epilogue runs on the
    (b * s, N) GEMM result, the residual is viewed flat, one view back at the end."""

    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((2, 3, 8), "float32"),
            w: R.Tensor((8, 16), "float32"),
            res: R.Tensor((2, 3, 16), "float32"),
        ):
            with R.dataflow():
                a = R.reshape(x, (6, 8))
                y = R.matmul(a, w)
                r = R.reshape(y, (2, 3, 16))
                h = R.multiply(r, R.const(0.5, "float32"))
                o = R.add(h, res)
                R.output(o)
            return o

    @I.ir_module
    class Expected:
        @R.function
        def main(
            x: R.Tensor((2, 3, 8), "float32"),
            w: R.Tensor((8, 16), "float32"),
            res: R.Tensor((2, 3, 16), "float32"),
        ):
            with R.dataflow():
                a = R.reshape(x, (6, 8))
                y = R.matmul(a, w)
                h_flat = R.multiply(y, R.const(0.5, "float32"))
                lv = R.reshape(res, (6, 16))
                o_flat = R.add(h_flat, lv)
                o = R.reshape(o_flat, (2, 3, 16))
                R.output(o)
            return o


class TestDynamicChainIntoNextGemm(SinkBase):
    """Symbolic (n, s): bias (N,), GELU, a (1, 1, N) scale viewed as (N,); the next layer's
    view(-1, N) of the chain's result is dropped, the next GEMM reads the flat result."""

    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor(("n", "s", 8), "float32"),
            w: R.Tensor((8, 16), "float32"),
            b: R.Tensor((16,), "float32"),
            g: R.Tensor((1, 1, 16), "float32"),
            w2: R.Tensor((16, 8), "float32"),
        ):
            n = T.int64()
            s = T.int64()
            with R.dataflow():
                a = R.reshape(x, (n * s, 8))
                y = R.matmul(a, w)
                r = R.reshape(y, (n, s, 16))
                h = R.add(r, b)
                t = R.nn.gelu(h)
                u = R.multiply(t, g)
                f = R.reshape(u, (n * s, 16))
                z = R.matmul(f, w2)
                R.output(z)
            return z

    @I.ir_module
    class Expected:
        @R.function
        def main(
            x: R.Tensor(("n", "s", 8), "float32"),
            w: R.Tensor((8, 16), "float32"),
            b: R.Tensor((16,), "float32"),
            g: R.Tensor((1, 1, 16), "float32"),
            w2: R.Tensor((16, 8), "float32"),
        ):
            n = T.int64()
            s = T.int64()
            with R.dataflow():
                a = R.reshape(x, (n * s, 8))
                y = R.matmul(a, w)
                h_flat = R.add(y, b)
                t_flat = R.nn.gelu(h_flat)
                lv = R.reshape(g, (16,))
                u_flat = R.multiply(t_flat, lv)
                z = R.matmul(u_flat, w2)
                R.output(z)
            return z


class TestBiasAddBeforeTheView(SinkBase):
    """addmm = matmul + bias, then the view: elementwise math on a GEMM result of its shape
    counts as the GEMM's result (it is in the GEMM's group already)."""

    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((6, 8), "float32"),
            w: R.Tensor((8, 16), "float32"),
            b: R.Tensor((16,), "float32"),
        ):
            with R.dataflow():
                y = R.add(R.matmul(x, w), b)
                r = R.reshape(y, (2, 3, 16))
                o = R.nn.gelu(r)
                R.output(o)
            return o

    @I.ir_module
    class Expected:
        @R.function
        def main(
            x: R.Tensor((6, 8), "float32"),
            w: R.Tensor((8, 16), "float32"),
            b: R.Tensor((16,), "float32"),
        ):
            with R.dataflow():
                lv = R.matmul(x, w)
                y = R.add(lv, b)
                o_flat = R.nn.gelu(y)
                o = R.reshape(o_flat, (2, 3, 16))
                R.output(o)
            return o


class TestViewChangesLastAxis(SinkBase):
    """(6, 16) viewed as (2, 3, 4, 4): the epilogue's last axis is not the GEMM's."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((6, 8), "float32"), w: R.Tensor((8, 16), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                r = R.reshape(y, (2, 3, 4, 4))
                o = R.exp(r)
                R.output(o)
            return o

    Expected = Before


class TestOperandBroadcastsOverRows(SinkBase):
    """A (2, 1, 16) operand repeats along seq: it has no flat view."""

    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((6, 8), "float32"),
            w: R.Tensor((8, 16), "float32"),
            m: R.Tensor((2, 1, 16), "float32"),
        ):
            with R.dataflow():
                y = R.matmul(x, w)
                r = R.reshape(y, (2, 3, 16))
                o = R.add(r, m)
                R.output(o)
            return o

    Expected = Before


class TestViewOfAnInput(SinkBase):
    """A view of a function input: nothing would fuse better."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((6, 16), "float32")):
            with R.dataflow():
                r = R.reshape(x, (2, 3, 16))
                o = R.exp(R.multiply(r, R.const(2.0, "float32")))
                R.output(o)
            return o

    Expected = Before


def _mlp(batch, seq):
    """GPT-2's MLP as the dynamo exporter writes it: view(-1, 16) -> addmm -> view -> GELU
    (tanh form) -> view(-1, 64) -> addmm -> view -> + residual."""
    rng = np.random.default_rng(3)
    w1 = relax.const(rng.standard_normal((16, 64)).astype("float32") / 4)
    w2 = relax.const(rng.standard_normal((64, 16)).astype("float32") / 8)
    b1 = relax.const(rng.standard_normal((64,)).astype("float32"))
    x = relax.Var("x", relax.TensorType([batch, seq, 16], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(R.reshape(x, (batch * seq, 16)))
            y = bb.emit(R.reshape(R.add(R.matmul(a, w1), b1), (batch, seq, 64)))
            cube = bb.emit(R.multiply(R.power(y, relax.const(3.0)), relax.const(0.044715)))
            inner = bb.emit(R.multiply(R.add(y, cube), relax.const(0.7978845608)))
            gelu = bb.emit(
                R.multiply(R.multiply(y, relax.const(0.5)), R.add(R.tanh(inner), relax.const(1.0)))
            )
            z = bb.emit(
                R.reshape(R.matmul(R.reshape(gelu, (batch * seq, 64)), w2), (batch, seq, 16))
            )
            out = bb.emit_output(R.add(x, z))
        bb.emit_func_output(out)
    return bb.get(), (w1, b1, w2)


def test_gemm_epilogues_fuse_numerics_match_stock(target):
    """Symbolic (batch, seq): both GEMMs get their epilogue (bias + GELU; the residual add) in
    their own kernel, no GELU or add kernel is left, and the outputs match stock TVM at shapes
    that do and do not fill the GEMM's register tiles."""
    batch, seq = tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("seq", "int64")
    mod, (w1, b1, w2) = _mlp(batch, seq)
    rng = np.random.default_rng(4)
    for shape in [(1, 1, 16), (2, 5, 16), (3, 8, 16)]:
        x = rng.standard_normal(shape).astype("float32")
        with collect_rewrites() as rewrites:
            ours, stock = compare_pipelines(mod, [x], rtol=1e-4, atol=1e-4)
        assert rewrites["SinkViewsPastEpilogues"] == 2
    names = [k.name for k in analysis.kernels(ours.lowered)]
    gemms = [n for n in names if "matmul" in n]
    assert len(gemms) == 2, names
    assert any("tanh" in n for n in gemms), names  # GELU in the first GEMM's kernel
    assert any("add" in n for n in gemms if "tanh" not in n), names  # the residual in the second
    assert not [n for n in names if "matmul" not in n and ("tanh" in n or "add" in n)], names
    assert len(names) < analysis.kernel_count(stock.lowered), names


if __name__ == "__main__":
    tvm.testing.main()
