"""FuseSplitGates, matching: the forms that fire and those that must not (float32).

Structural cases run the pass for a CUDA target (exact stock op semantics, no fast-math
polynomials in the TIR; V = 4 for these widths) on weights given as inputs, which are read in
place.

Must not fire: a piece also used outside the group; the GEMM output also used elsewhere; a split
on the batch axis; unequal pieces; an op outside the elementwise table; a width no vector
block divides; the pass switched off by flag or PassContext. Equal slices of the GEMM output
(TorchScript's ``chunk``) are one piece; slices that differ are not.

The other gate tests: ``test_fuse_split_gates_half.py`` (float16 / bfloat16),
``test_fuse_split_gates_merge.py`` (summed and sibling linear layers, bias shapes),
``test_fuse_split_gates_workloads.py`` (the model cells: numerics, one kernel, blocked
weights, no global GEMM intermediate); their shared pieces are in ``_gates_helpers.py``.
"""

import numpy as np
import tvm
import tvm.testing
from _gates_helpers import CUDA, GatesBase
from helpers import compare_pipelines
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion import analysis, models
from tvm_fusion.transform import FuseSplitGates, collect_rewrites


class TestSwiGLURuntimeWeight(GatesBase):
    """silu-style gate: sigmoid(gate) * up from one GEMM chunked in two."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((8, 4), "float32")):
            with R.dataflow():
                wt = R.permute_dims(w)
                y = R.matmul(x, wt)
                parts = R.split(y, 2, axis=-1)
                gate = parts[0]
                up = parts[1]
                act = R.sigmoid(gate)
                out = R.multiply(act, up)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def fused_gates_2(
            x: T.Buffer((T.int64(2), T.int64(4)), "float32"),
            w: T.Buffer((T.int64(8), T.int64(4)), "float32"),
            T_multiply: T.Buffer((T.int64(2), T.int64(4)), "float32"),
        ):
            T.func_attr(
                {
                    "op_pattern": 8,
                    "tirx.noalias": True,
                    "tvm_fusion.gate_fusion": {"block": 4, "gates": 2, "width": 4},
                }
            )
            gemm0 = T.sblock_alloc_buffer((T.int64(2), T.int64(2), T.int64(4)))
            gate0_0 = T.sblock_alloc_buffer((T.int64(2), T.int64(4)))
            compute = T.sblock_alloc_buffer((T.int64(2), T.int64(4)))
            gate0_1 = T.sblock_alloc_buffer((T.int64(2), T.int64(4)))
            for i0, i1, i2, k in T.grid(T.int64(2), T.int64(2), T.int64(4), T.int64(4)):
                with T.sblock("gemm0"):
                    v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
                    T.reads(x[v_i0, v_k], w[v_i1 * T.int64(4) + v_i2, v_k])
                    T.writes(gemm0[v_i0, v_i1, v_i2])
                    with T.init():
                        gemm0[v_i0, v_i1, v_i2] = T.float32(0.0)
                    gemm0[v_i0, v_i1, v_i2] = (
                        gemm0[v_i0, v_i1, v_i2] + x[v_i0, v_k] * w[v_i1 * T.int64(4) + v_i2, v_k]
                    )
            for i0, i1 in T.grid(T.int64(2), T.int64(4)):
                with T.sblock("gate0_0"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(gemm0[v_i0, T.int64(0), v_i1])
                    T.writes(gate0_0[v_i0, v_i1])
                    gate0_0[v_i0, v_i1] = gemm0[v_i0, T.int64(0), v_i1]
            for i0, i1 in T.grid(T.int64(2), T.int64(4)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(gate0_0[v_i0, v_i1])
                    T.writes(compute[v_i0, v_i1])
                    compute[v_i0, v_i1] = T.sigmoid(gate0_0[v_i0, v_i1])
            for i0, i1 in T.grid(T.int64(2), T.int64(4)):
                with T.sblock("gate0_1"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(gemm0[v_i0, T.int64(1), v_i1])
                    T.writes(gate0_1[v_i0, v_i1])
                    gate0_1[v_i0, v_i1] = gemm0[v_i0, T.int64(1), v_i1]
            for ax0, ax1 in T.grid(T.int64(2), T.int64(4)):
                with T.sblock("T_multiply"):
                    v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(compute[v_ax0, v_ax1], gate0_1[v_ax0, v_ax1])
                    T.writes(T_multiply[v_ax0, v_ax1])
                    T_multiply[v_ax0, v_ax1] = compute[v_ax0, v_ax1] * gate0_1[v_ax0, v_ax1]

        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((8, 4), "float32")) -> R.Tensor(
            (2, 4), "float32"
        ):
            cls = Expected
            with R.dataflow():
                out = R.call_tir(cls.fused_gates_2, (x, w), out_ty=R.Tensor((2, 4), "float32"))
                R.output(out)
            return out


class TestDynamicBatch(GatesBase):
    """Symbolic rows: the kernel's buffers take n from x."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 4), "float32"), w: R.Tensor((8, 4), "float32")):
            with R.dataflow():
                wt = R.permute_dims(w)
                y = R.matmul(x, wt)
                parts = R.split(y, 2, axis=-1)
                gate = parts[0]
                up = parts[1]
                act = R.sigmoid(gate)
                out = R.multiply(act, up)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def fused_gates_2(
            var_x: T.handle, w: T.Buffer((T.int64(8), T.int64(4)), "float32"), var_out: T.handle
        ):
            T.func_attr(
                {
                    "op_pattern": 8,
                    "tirx.noalias": True,
                    "tvm_fusion.gate_fusion": {"block": 4, "gates": 2, "width": 4},
                }
            )
            n = T.int64()
            x = T.match_buffer(var_x, (n, T.int64(4)))
            T_multiply = T.match_buffer(var_out, (n, T.int64(4)))
            gemm0 = T.sblock_alloc_buffer((n, T.int64(2), T.int64(4)))
            gate0_0 = T.sblock_alloc_buffer((n, T.int64(4)))
            compute = T.sblock_alloc_buffer((n, T.int64(4)))
            gate0_1 = T.sblock_alloc_buffer((n, T.int64(4)))
            for i0, i1, i2, k in T.grid(n, T.int64(2), T.int64(4), T.int64(4)):
                with T.sblock("gemm0"):
                    v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
                    T.reads(x[v_i0, v_k], w[v_i1 * T.int64(4) + v_i2, v_k])
                    T.writes(gemm0[v_i0, v_i1, v_i2])
                    with T.init():
                        gemm0[v_i0, v_i1, v_i2] = T.float32(0.0)
                    gemm0[v_i0, v_i1, v_i2] = (
                        gemm0[v_i0, v_i1, v_i2] + x[v_i0, v_k] * w[v_i1 * T.int64(4) + v_i2, v_k]
                    )
            for i0, i1 in T.grid(n, T.int64(4)):
                with T.sblock("gate0_0"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(gemm0[v_i0, T.int64(0), v_i1])
                    T.writes(gate0_0[v_i0, v_i1])
                    gate0_0[v_i0, v_i1] = gemm0[v_i0, T.int64(0), v_i1]
            for i0, i1 in T.grid(n, T.int64(4)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(gate0_0[v_i0, v_i1])
                    T.writes(compute[v_i0, v_i1])
                    compute[v_i0, v_i1] = T.sigmoid(gate0_0[v_i0, v_i1])
            for i0, i1 in T.grid(n, T.int64(4)):
                with T.sblock("gate0_1"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(gemm0[v_i0, T.int64(1), v_i1])
                    T.writes(gate0_1[v_i0, v_i1])
                    gate0_1[v_i0, v_i1] = gemm0[v_i0, T.int64(1), v_i1]
            for ax0, ax1 in T.grid(n, T.int64(4)):
                with T.sblock("T_multiply"):
                    v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(compute[v_ax0, v_ax1], gate0_1[v_ax0, v_ax1])
                    T.writes(T_multiply[v_ax0, v_ax1])
                    T_multiply[v_ax0, v_ax1] = compute[v_ax0, v_ax1] * gate0_1[v_ax0, v_ax1]

        @R.function
        def main(x: R.Tensor(("n", 4), "float32"), w: R.Tensor((8, 4), "float32")) -> R.Tensor(
            ("n", 4), "float32"
        ):
            n = T.int64()
            cls = Expected
            with R.dataflow():
                out = R.call_tir(cls.fused_gates_2, (x, w), out_ty=R.Tensor((n, 4), "float32"))
                R.output(out)
            return out


class TestNoFirePieceUsedOutside(GatesBase):
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                parts = R.split(y, 2, axis=-1)
                gate = parts[0]
                up = parts[1]
                act = R.sigmoid(gate)
                out = R.multiply(act, up)
                R.output(out, gate)
            return (out, gate)

    Expected = Before


class TestNoFireGemmOutputUsedElsewhere(GatesBase):
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                parts = R.split(y, 2, axis=-1)
                act = R.sigmoid(parts[0])
                out = R.multiply(act, parts[1])
                total = R.sum(y)
                R.output(out, total)
            return (out, total)

    Expected = Before


class TestNoFireBatchAxisSplit(GatesBase):
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 4), "float32"), w: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                parts = R.split(y, 2, axis=0)
                out = R.multiply(R.sigmoid(parts[0]), parts[1])
                R.output(out)
            return out

    Expected = Before


class TestNoFireUnequalPieces(GatesBase):
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 12), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                parts = R.split(y, [4], axis=1)
                a = R.sigmoid(parts[0])
                b = R.sum(parts[1], axis=[1], keepdims=True)
                out = R.multiply(a, b)
                R.output(out)
            return out

    Expected = Before


class TestNoFireUnknownOp(GatesBase):
    """softmax is not elementwise: the pieces feed nothing the kernel can compute."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                parts = R.split(y, 2, axis=-1)
                a = R.nn.softmax(parts[0])
                b = R.nn.softmax(parts[1])
                out = R.add(a, b)
                R.output(out)
            return out

    Expected = Before


class TestNoFireNoVectorBlock(GatesBase):
    """Pieces of width 2: no block of 4 or more units divides them."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 4), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                parts = R.split(y, 2, axis=-1)
                out = R.multiply(R.sigmoid(parts[0]), parts[1])
                R.output(out)
            return out

    Expected = Before


class TestDuplicateEqualSlices(GatesBase):
    """torch's TorchScript exporter writes ``chunk`` as one Slice per use: the two equal slices
    of the gate half are one piece (one ``gate0_0`` stage read by the sigmoid and the multiply)."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((8, 4), "float32")):
            with R.dataflow():
                wt = R.permute_dims(w)
                y = R.matmul(x, wt)
                gate = R.strided_slice(y, (1,), (0,), (4,))
                up = R.strided_slice(y, (1,), (4,), (8,))
                act = R.sigmoid(gate)
                gate_again = R.strided_slice(y, (1,), (0,), (4,))
                silu = R.multiply(gate_again, act)
                out = R.multiply(silu, up)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def fused_gates_2(
            x: T.Buffer((T.int64(2), T.int64(4)), "float32"),
            w: T.Buffer((T.int64(8), T.int64(4)), "float32"),
            T_multiply: T.Buffer((T.int64(2), T.int64(4)), "float32"),
        ):
            T.func_attr(
                {
                    "op_pattern": 8,
                    "tirx.noalias": True,
                    "tvm_fusion.gate_fusion": {"block": 4, "gates": 2, "width": 4},
                }
            )
            gemm0 = T.sblock_alloc_buffer((T.int64(2), T.int64(2), T.int64(4)))
            gate0_0 = T.sblock_alloc_buffer((T.int64(2), T.int64(4)))
            compute = T.sblock_alloc_buffer((T.int64(2), T.int64(4)))
            T_multiply_1 = T.sblock_alloc_buffer((T.int64(2), T.int64(4)))
            gate0_1 = T.sblock_alloc_buffer((T.int64(2), T.int64(4)))
            for i0, i1, i2, k in T.grid(T.int64(2), T.int64(2), T.int64(4), T.int64(4)):
                with T.sblock("gemm0"):
                    v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
                    T.reads(x[v_i0, v_k], w[v_i1 * T.int64(4) + v_i2, v_k])
                    T.writes(gemm0[v_i0, v_i1, v_i2])
                    with T.init():
                        gemm0[v_i0, v_i1, v_i2] = T.float32(0.0)
                    gemm0[v_i0, v_i1, v_i2] = (
                        gemm0[v_i0, v_i1, v_i2] + x[v_i0, v_k] * w[v_i1 * T.int64(4) + v_i2, v_k]
                    )
            for i0, i1 in T.grid(T.int64(2), T.int64(4)):
                with T.sblock("gate0_0"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(gemm0[v_i0, T.int64(0), v_i1])
                    T.writes(gate0_0[v_i0, v_i1])
                    gate0_0[v_i0, v_i1] = gemm0[v_i0, T.int64(0), v_i1]
            for i0, i1 in T.grid(T.int64(2), T.int64(4)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(gate0_0[v_i0, v_i1])
                    T.writes(compute[v_i0, v_i1])
                    compute[v_i0, v_i1] = T.sigmoid(gate0_0[v_i0, v_i1])
            for ax0, ax1 in T.grid(T.int64(2), T.int64(4)):
                with T.sblock("T_multiply"):
                    v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(gate0_0[v_ax0, v_ax1], compute[v_ax0, v_ax1])
                    T.writes(T_multiply_1[v_ax0, v_ax1])
                    T_multiply_1[v_ax0, v_ax1] = gate0_0[v_ax0, v_ax1] * compute[v_ax0, v_ax1]
            for i0, i1 in T.grid(T.int64(2), T.int64(4)):
                with T.sblock("gate0_1"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(gemm0[v_i0, T.int64(1), v_i1])
                    T.writes(gate0_1[v_i0, v_i1])
                    gate0_1[v_i0, v_i1] = gemm0[v_i0, T.int64(1), v_i1]
            for ax0, ax1 in T.grid(T.int64(2), T.int64(4)):
                with T.sblock("T_multiply_1"):
                    v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(T_multiply_1[v_ax0, v_ax1], gate0_1[v_ax0, v_ax1])
                    T.writes(T_multiply[v_ax0, v_ax1])
                    T_multiply[v_ax0, v_ax1] = T_multiply_1[v_ax0, v_ax1] * gate0_1[v_ax0, v_ax1]

        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((8, 4), "float32")) -> R.Tensor(
            (2, 4), "float32"
        ):
            cls = Expected
            with R.dataflow():
                out = R.call_tir(cls.fused_gates_2, (x, w), out_ty=R.Tensor((2, 4), "float32"))
                R.output(out)
            return out


@I.ir_module
class _SymbolicChunk:
    """What the ONNX importer makes of a TorchScript ``chunk`` once PlaceShapeOnHost made the
    bounds symbolic: whole leading axes ``(b, s)``, ``assume_inbound``."""

    @R.function
    def main(x: R.Tensor(("b", "s", 4), "float32"), w: R.Tensor((4, 8), "float32")):
        b = T.int64()
        s = T.int64()
        with R.dataflow():
            y = R.matmul(x, w)
            gate = R.strided_slice(y, (0, 1, 2), (0, 0, 0), (b, s, 4), assume_inbound=True)
            act = R.sigmoid(gate)
            up = R.strided_slice(y, (0, 1, 2), (0, 0, 4), (b, s, 8), assume_inbound=True)
            silu = R.multiply(gate, act)
            out = R.multiply(silu, up)
            R.output(out)
        return out


class TestDuplicateSymbolicSlices(GatesBase):
    """Symbolic bounds: ``b + 1 - 1`` is not structurally ``b``, the analyzer proves it equal.
    The result is the pass's result on the same module with the slice written once."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", "s", 4), "float32"), w: R.Tensor((4, 8), "float32")):
            b = T.int64()
            s = T.int64()
            with R.dataflow():
                y = R.matmul(x, w)
                gate = R.strided_slice(y, (0, 1, 2), (0, 0, 0), (b, s, 4), assume_inbound=True)
                act = R.sigmoid(gate)
                up = R.strided_slice(y, (0, 1, 2), (0, 0, 4), (b, s, 8), assume_inbound=True)
                gate_again = R.strided_slice(
                    y, (0, 1, 2), (0, 0, 0), (b + 1 - 1, s, 4), assume_inbound=True
                )
                silu = R.multiply(gate_again, act)
                out = R.multiply(silu, up)
                R.output(out)
            return out

    Expected = FuseSplitGates(CUDA)(_SymbolicChunk)

    def test_expected_is_fused(self):
        calls = [
            b.value.op.name
            for b in self.Expected["main"].body.blocks[0].bindings
            if isinstance(b.value, relax.Call)
        ]
        assert calls == ["relax.call_tir"]


class TestNoMergeDifferentSlices(GatesBase):
    """y[:, 2:6] is not y[:, 0:4]: three different slices that do not partition the axis."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                gate = R.strided_slice(y, (1,), (0,), (4,))
                up = R.strided_slice(y, (1,), (4,), (8,))
                act = R.sigmoid(gate)
                mid = R.strided_slice(y, (1,), (2,), (6,))
                silu = R.multiply(mid, act)
                out = R.multiply(silu, up)
                R.output(out)
            return out

    Expected = Before


def test_same_slice_symbolic_bounds():
    """Equal slices: structurally, or with bounds the analyzer proves equal; not a different
    bound, a different ``assume_inbound`` or another tensor."""
    from tvm_fusion.transform.fuse_split_gates.match import _same_slice

    n = tvm.tirx.Var("n", "int64")
    y = relax.Var("y", relax.TensorType((n, 8), "float32"))
    z = relax.Var("z", relax.TensorType((n, 8), "float32"))

    def piece(t, end0, inbound=True):
        return relax.op.strided_slice(t, [0, 1], [0, 0], [end0, 4], assume_inbound=inbound)

    assert _same_slice(piece(y, n), piece(y, n))
    assert _same_slice(piece(y, n), piece(y, n + 1 - 1))
    assert not _same_slice(piece(y, n), piece(y, n - 1))
    assert not _same_slice(piece(y, n), piece(y, n, inbound=False))
    assert not _same_slice(piece(y, n), piece(z, n))
    assert not _same_slice(piece(y, n), relax.op.strided_slice(y, [1], [0], [4]))


def test_disabled_by_flag_and_context(target):
    inst = models.build("lstm_cell", "small")
    report = analysis.fusion_report(inst.mod, target, fuse_split_gates=False)
    assert "FuseSplitGates" not in report.rewrites
    with tvm.transform.PassContext(disabled_pass=["FuseSplitGates"]):
        report = analysis.fusion_report(inst.mod, target)
    assert "FuseSplitGates" not in report.rewrites


def test_strided_slice_pieces():
    """Pieces written as strided_slice (ONNX Slice) fuse like a split."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 16)).astype("float32")
    x = relax.Var("x", relax.TensorType((3, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(relax.const(w)))))
            a = bb.emit(relax.op.strided_slice(y, [1], [0], [12]))
            b = bb.emit(relax.op.strided_slice(y, [1], [12], [24]))
            out = bb.emit_output(relax.op.multiply(bb.emit(relax.op.nn.silu(a)), b))
        bb.emit_func_output(out)
    data = rng.standard_normal((3, 16)).astype("float32")
    y = data @ w.T
    with collect_rewrites() as counts:
        compare_pipelines(
            bb.get(),
            [data],
            rtol=1e-5,
            atol=1e-5,
            reference=[y[:, :12] / (1 + np.exp(-y[:, :12])) * y[:, 12:]],
        )
    assert counts["FuseSplitGates"] == 1


def test_duplicate_slices_numerics():
    """The TorchScript ``chunk`` form (a slice per use, symbolic rows, constant weight) fuses
    into one gate kernel and computes silu(a) * b."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((16, 24)) / 4).astype("float32")
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(w)))

            def piece(begin, end):
                return bb.emit(
                    relax.op.strided_slice(y, [0, 1], [0, begin], [n, end], assume_inbound=True)
                )

            act = bb.emit(relax.op.sigmoid(piece(0, 12)))
            silu = bb.emit(relax.op.multiply(piece(0, 12), act))
            out = bb.emit_output(relax.op.multiply(silu, piece(12, 24)))
        bb.emit_func_output(out)
    data = rng.standard_normal((5, 16)).astype("float32")
    y = data @ w
    with collect_rewrites() as counts:
        compare_pipelines(
            bb.get(),
            [data],
            rtol=1e-5,
            atol=1e-5,
            reference=[y[:, :12] / (1 + np.exp(-y[:, :12])) * y[:, 12:]],
        )
    assert counts["FuseSplitGates"] == 1


if __name__ == "__main__":
    tvm.testing.main()
