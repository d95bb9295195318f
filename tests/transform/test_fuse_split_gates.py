"""FuseSplitGates: matmul (+bias) -> split -> gates becomes one kernel with blocked weights.

Structural cases run the pass for a CUDA target (exact stock op semantics, no fast-math
polynomials in the TIR; V = 4 for these widths) on weights given as inputs, which are read in
place; constant weights are checked for their blocked layout separately.

Must not fire: a piece also used outside the group; the GEMM output also used elsewhere; a split
on the batch axis; unequal pieces; an op outside the elementwise table; a float16 GEMM with
a float32 result and bias, or an ``astype`` before the split (mixed dtypes); a width no vector
block divides. float16 / bfloat16 groups accumulate in float32 and round once, where each result
is written. Equal slices of the GEMM output (TorchScript's ``chunk``) are one piece; slices
that differ are not. A constant added to a linear layer is a GEMM bias only when it broadcasts
along the features alone (a per-row bias of as many elements is not).
"""

import re
import shutil

import ml_dtypes
import numpy as np
import pytest
import tvm
import tvm.testing
from helpers import Base, compare_pipelines, run
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvm_fusion
from tvm_fusion import analysis, models, tir_util
from tvm_fusion import target as _target
from tvm_fusion.build import engine, pipeline
from tvm_fusion.schedule import cuda
from tvm_fusion.tools import cuda_check
from tvm_fusion.transform import FuseSplitGates, collect_rewrites
from tvm_fusion.transform.fuse_split_gates import GATE_ATTR

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


class GatesBase(Base):
    transform = FuseSplitGates(CUDA)


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


class TestSwiGLUFloat16(GatesBase):
    """float16: the GEMM widens its inputs and accumulates in float32, the gate math runs on the
    float32 tile, the result is rounded to float16 once, where it is written."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float16"), w: R.Tensor((4, 8), "float16")):
            with R.dataflow():
                y = R.matmul(x, w)
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
            x: T.Buffer((T.int64(2), T.int64(4)), "float16"),
            w: T.Buffer((T.int64(4), T.int64(8)), "float16"),
            compute: T.Buffer((T.int64(2), T.int64(4)), "float16"),
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
            compute_1 = T.sblock_alloc_buffer((T.int64(2), T.int64(4)))
            gate0_1 = T.sblock_alloc_buffer((T.int64(2), T.int64(4)))
            T_multiply = T.sblock_alloc_buffer((T.int64(2), T.int64(4)))
            for i0, i1, i2, k in T.grid(T.int64(2), T.int64(2), T.int64(4), T.int64(4)):
                with T.sblock("gemm0"):
                    v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
                    T.reads(x[v_i0, v_k], w[v_k, v_i1 * T.int64(4) + v_i2])
                    T.writes(gemm0[v_i0, v_i1, v_i2])
                    with T.init():
                        gemm0[v_i0, v_i1, v_i2] = T.float32(0.0)
                    gemm0[v_i0, v_i1, v_i2] = gemm0[v_i0, v_i1, v_i2] + T.Cast(
                        "float32", x[v_i0, v_k]
                    ) * T.Cast("float32", w[v_k, v_i1 * T.int64(4) + v_i2])
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
                    T.writes(compute_1[v_i0, v_i1])
                    compute_1[v_i0, v_i1] = T.sigmoid(gate0_0[v_i0, v_i1])
            for i0, i1 in T.grid(T.int64(2), T.int64(4)):
                with T.sblock("gate0_1"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(gemm0[v_i0, T.int64(1), v_i1])
                    T.writes(gate0_1[v_i0, v_i1])
                    gate0_1[v_i0, v_i1] = gemm0[v_i0, T.int64(1), v_i1]
            for ax0, ax1 in T.grid(T.int64(2), T.int64(4)):
                with T.sblock("T_multiply"):
                    v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(compute_1[v_ax0, v_ax1], gate0_1[v_ax0, v_ax1])
                    T.writes(T_multiply[v_ax0, v_ax1])
                    T_multiply[v_ax0, v_ax1] = compute_1[v_ax0, v_ax1] * gate0_1[v_ax0, v_ax1]
            for i0, i1 in T.grid(T.int64(2), T.int64(4)):
                with T.sblock("compute_1"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(T_multiply[v_i0, v_i1])
                    T.writes(compute[v_i0, v_i1])
                    compute[v_i0, v_i1] = T.Cast("float16", T_multiply[v_i0, v_i1])

        @R.function
        def main(
            x: R.Tensor((2, 4), dtype="float16"), w: R.Tensor((4, 8), dtype="float16")
        ) -> R.Tensor((2, 4), dtype="float16"):
            cls = Expected
            with R.dataflow():
                out = R.call_tir(
                    cls.fused_gates_2, (x, w), out_ty=R.Tensor((2, 4), dtype="float16")
                )
                R.output(out)
            return out


class TestBFloat16SymbolicRowsBias(GatesBase):
    """bfloat16 with symbolic rows and a bias: the bias is widened into the float32 tile."""

    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor(("n", 4), "bfloat16"),
            w: R.Tensor((8, 4), "bfloat16"),
            b: R.Tensor((8,), "bfloat16"),
        ):
            with R.dataflow():
                wt = R.permute_dims(w)
                mm = R.matmul(x, wt)
                y = R.add(mm, b)
                parts = R.split(y, 2, axis=-1)
                gate = parts[0]
                up = parts[1]
                act = R.nn.silu(gate)
                out = R.multiply(act, up)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def fused_gates_2(
            var_x: T.handle,
            w: T.Buffer((T.int64(8), T.int64(4)), "bfloat16"),
            b: T.Buffer((T.int64(8),), "bfloat16"),
            var_compute: T.handle,
        ):
            T.func_attr(
                {
                    "op_pattern": 8,
                    "tirx.noalias": True,
                    "tvm_fusion.gate_fusion": {"block": 4, "gates": 2, "width": 4},
                }
            )
            n = T.int64()
            x = T.match_buffer(var_x, (n, T.int64(4)), "bfloat16")
            compute = T.match_buffer(var_compute, (n, T.int64(4)), "bfloat16")
            gemm0 = T.sblock_alloc_buffer((n, T.int64(2), T.int64(4)))
            gemm0_bias = T.sblock_alloc_buffer((n, T.int64(2), T.int64(4)))
            gate0_0 = T.sblock_alloc_buffer((n, T.int64(4)))
            compute_1 = T.sblock_alloc_buffer((n, T.int64(4)))
            T_multiply = T.sblock_alloc_buffer((n, T.int64(4)))
            gate0_1 = T.sblock_alloc_buffer((n, T.int64(4)))
            T_multiply_1 = T.sblock_alloc_buffer((n, T.int64(4)))
            for i0, i1, i2, k in T.grid(n, T.int64(2), T.int64(4), T.int64(4)):
                with T.sblock("gemm0"):
                    v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
                    T.reads(x[v_i0, v_k], w[v_i1 * T.int64(4) + v_i2, v_k])
                    T.writes(gemm0[v_i0, v_i1, v_i2])
                    with T.init():
                        gemm0[v_i0, v_i1, v_i2] = T.float32(0.0)
                    gemm0[v_i0, v_i1, v_i2] = gemm0[v_i0, v_i1, v_i2] + T.Cast(
                        "float32", x[v_i0, v_k]
                    ) * T.Cast("float32", w[v_i1 * T.int64(4) + v_i2, v_k])
            for i0, i1, i2 in T.grid(n, T.int64(2), T.int64(4)):
                with T.sblock("gemm0_bias"):
                    v_i0, v_i1, v_i2 = T.axis.remap("SSS", [i0, i1, i2])
                    T.reads(gemm0[v_i0, v_i1, v_i2], b[v_i1 * T.int64(4) + v_i2])
                    T.writes(gemm0_bias[v_i0, v_i1, v_i2])
                    gemm0_bias[v_i0, v_i1, v_i2] = gemm0[v_i0, v_i1, v_i2] + T.Cast(
                        "float32", b[v_i1 * T.int64(4) + v_i2]
                    )
            for i0, i1 in T.grid(n, T.int64(4)):
                with T.sblock("gate0_0"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(gemm0_bias[v_i0, T.int64(0), v_i1])
                    T.writes(gate0_0[v_i0, v_i1])
                    gate0_0[v_i0, v_i1] = gemm0_bias[v_i0, T.int64(0), v_i1]
            for i0, i1 in T.grid(n, T.int64(4)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(gate0_0[v_i0, v_i1])
                    T.writes(compute_1[v_i0, v_i1])
                    compute_1[v_i0, v_i1] = T.sigmoid(gate0_0[v_i0, v_i1])
            for ax0, ax1 in T.grid(n, T.int64(4)):
                with T.sblock("T_multiply"):
                    v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(gate0_0[v_ax0, v_ax1], compute_1[v_ax0, v_ax1])
                    T.writes(T_multiply[v_ax0, v_ax1])
                    T_multiply[v_ax0, v_ax1] = gate0_0[v_ax0, v_ax1] * compute_1[v_ax0, v_ax1]
            for i0, i1 in T.grid(n, T.int64(4)):
                with T.sblock("gate0_1"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(gemm0_bias[v_i0, T.int64(1), v_i1])
                    T.writes(gate0_1[v_i0, v_i1])
                    gate0_1[v_i0, v_i1] = gemm0_bias[v_i0, T.int64(1), v_i1]
            for ax0, ax1 in T.grid(n, T.int64(4)):
                with T.sblock("T_multiply_1"):
                    v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(T_multiply[v_ax0, v_ax1], gate0_1[v_ax0, v_ax1])
                    T.writes(T_multiply_1[v_ax0, v_ax1])
                    T_multiply_1[v_ax0, v_ax1] = T_multiply[v_ax0, v_ax1] * gate0_1[v_ax0, v_ax1]
            for i0, i1 in T.grid(n, T.int64(4)):
                with T.sblock("compute_1"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(T_multiply_1[v_i0, v_i1])
                    T.writes(compute[v_i0, v_i1])
                    compute[v_i0, v_i1] = T.Cast("bfloat16", T_multiply_1[v_i0, v_i1])

        @R.function
        def main(
            x: R.Tensor(("n", 4), dtype="bfloat16"),
            w: R.Tensor((8, 4), dtype="bfloat16"),
            b: R.Tensor((8,), dtype="bfloat16"),
        ) -> R.Tensor(("n", 4), dtype="bfloat16"):
            n = T.int64()
            cls = Expected
            with R.dataflow():
                out = R.call_tir(
                    cls.fused_gates_2, (x, w, b), out_ty=R.Tensor((n, 4), dtype="bfloat16")
                )
                R.output(out)
            return out


class TestNoFireFloat16GemmFloat32Bias(GatesBase):
    """A float16 GEMM with a float32 result (``out_dtype``) plus a float32 bias: mixed dtypes."""

    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((2, 4), "float16"),
            w: R.Tensor((4, 8), "float16"),
            b: R.Tensor((8,), "float32"),
        ):
            with R.dataflow():
                y = R.add(R.matmul(x, w, out_dtype="float32"), b)
                parts = R.split(y, 2, axis=-1)
                out = R.multiply(R.sigmoid(parts[0]), parts[1])
                R.output(out)
            return out

    Expected = Before


class TestNoFireAstypeBeforeSplit(GatesBase):
    """``astype`` between the GEMM and the split: the split input is not a GEMM."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float16"), w: R.Tensor((4, 8), "float16")):
            with R.dataflow():
                y = R.astype(R.matmul(x, w), "float32")
                parts = R.split(y, 2, axis=-1)
                out = R.multiply(R.sigmoid(parts[0]), parts[1])
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


# ---------------------------------------------------------------------------------------------
# Workloads: numerics, one kernel, blocked constant weights, no full GEMM intermediate

GATE_WORKLOADS = ["gate_2890", "lstm_cell", "gru_cell", "swiglu", "geglu"]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", GATE_WORKLOADS)
def test_cells_numerics_vs_reference_and_stock(name, dynamic):
    inst = models.build(name, "small", dynamic=dynamic)
    with collect_rewrites() as counts:
        compare_pipelines(
            inst.mod,
            inst.input_list(),
            rtol=1e-4,
            atol=1e-4,
            reference=inst.reference(*inst.input_list()),
        )
    assert counts["FuseSplitGates"] == 1


@pytest.mark.parametrize("name", GATE_WORKLOADS)
def test_one_kernel_for_the_gate_group(name, target):
    inst = models.build(name, "small")
    report = analysis.fusion_report(inst.mod, target)
    gate_kernels = [k for k in report.ours if k.name.startswith("fused_gates")]
    assert len(gate_kernels) == 1
    # stock: the GEMM(s) and the gate math are separate kernels
    stock_gemm = [k for k in report.stock if "matmul" in k.label()]
    assert report.stock_kernels >= 2 and stock_gemm
    # ours: the gate group is the only kernel but for SwiGLU/GeGLU's down projection
    expected = 2 if name in ("swiglu", "geglu") else 1
    assert report.ours_kernels == expected


@pytest.mark.parametrize("name", ["lstm_cell", "gru_cell"])
def test_onnx_import_fuses(name):
    inst = models.build(name, "small")
    mod = tvm_fusion.load_onnx(inst.onnx_model)
    with collect_rewrites() as counts:
        compare_pipelines(
            mod,
            inst.input_list(),
            rtol=1e-4,
            atol=1e-4,
            reference=inst.reference(*inst.input_list()),
        )
    assert counts["FuseSplitGates"] == 1


def test_constant_weight_blocked_layout(target):
    """W (k*D, K) becomes Wb (D/V, K, k, V): Wb[b, k, g, v] = W[g*D + b*V + v, k]."""
    inst = models.build("lstm_cell", "small")
    fused = FuseSplitGates(target)(inst.mod)
    call = next(
        b.value
        for b in fused["main"].body.blocks[0].bindings
        if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"
    )
    consts = [a for a in call.args[1].fields if isinstance(a, tvm.ir.expr.GenericConst)]
    wb = next(c.value.numpy() for c in consts if c.value.numpy().ndim == 4)
    blocks, k_dim, gates, v = wb.shape
    assert gates == 4 and k_dim == 32 and blocks * v == 16
    w = next(
        b.value.args[0].value.numpy()
        for b in inst.mod["main"].body.blocks[0].bindings
        if isinstance(b.value, relax.Call) and b.value.op.name == "relax.permute_dims"
    )
    for g in range(gates):
        for blk in range(blocks):
            np.testing.assert_array_equal(
                wb[blk, :, g, :], w[g * 16 + blk * v : g * 16 + (blk + 1) * v].T
            )


def _gate_module(rows, k_in, width, gates):
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((gates * width, k_in)) / np.sqrt(k_in)).astype("float32")
    x = relax.Var("x", relax.TensorType((rows, k_in), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(relax.const(w)))))
            parts = bb.emit(relax.op.split(y, gates, axis=1))
            acc = bb.emit(relax.op.sigmoid(bb.emit(relax.TupleGetItem(parts, 0))))
            for g in range(1, gates):
                acc = bb.emit(
                    relax.op.multiply(
                        acc, bb.emit(relax.op.tanh(bb.emit(relax.TupleGetItem(parts, g))))
                    )
                )
            out = bb.emit_output(acc)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("name", ["gate_2890", "lstm_cell", "gru_cell", "swiglu", "medium"])
def test_no_global_gemm_intermediate(name, target):
    """No global buffer of rows * gates * D in the lowered kernel: the GEMM outputs are tile-local
    registers (``local``), the rest of the gate math works on the tile."""
    mod = _gate_module(32, 64, 128, 3) if name == "medium" else models.build(name, "small").mod
    compiled = engine.compile_module(mod, target, "tvm_fusion")
    kernel = next(
        f for gv, f in compiled.lowered.functions_items() if gv.name_hint.startswith("fused_gates")
    )
    hints = kernel.attrs["tvm_fusion.gate_fusion"]
    rows = int(kernel.params[0].shape[0])
    full = rows * int(hints["gates"]) * int(hints["width"])
    buffers = tir_util.compacted_allocations(kernel)
    assert buffers
    for buf in buffers:
        n = tir_util.num_elements(buf)
        if buf.name.startswith("gemm"):
            assert buf.scope() == "local", buf.name
        else:
            assert n is not None and n < full, (buf.name, buf.shape, full)
        if name == "medium":  # a real tile: far smaller than the whole GEMM output
            assert n is not None and n * 8 <= full, (buf.name, buf.shape, full)


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


def test_lstm_two_outputs_one_call(target):
    inst = models.build("lstm_cell", "small")
    fused = FuseSplitGates(target)(inst.mod)
    calls = [
        b
        for b in fused["main"].body.blocks[0].bindings
        if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"
    ]
    assert len(calls) == 1
    assert isinstance(calls[0].var.ty, relax.TupleType) and len(calls[0].var.ty.fields) == 2


# ---------------------------------------------------------------------------------------------
# float16 / bfloat16: float32 accumulation and gate math, one rounding where a result is written

HALF = ["float16", "bfloat16"]


def _np_dtype(dtype: str):
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def _half_lstm(dtype: str, rows: int, k: int = 37, units: int = 13, seed: int = 26):
    """``x @ W^T + b -> split(4) -> LSTM cell`` in ``dtype`` with constant W, b and the cell
    state as an input; results (h, c') and their NumPy float32 reference."""
    rng = np.random.default_rng(seed)
    npd = _np_dtype(dtype)
    w = (rng.standard_normal((4 * units, k)) / np.sqrt(k)).astype(npd)
    b = (rng.standard_normal(4 * units) * 0.1).astype(npd)
    x = relax.Var("x", relax.TensorType((rows, k), dtype))
    c = relax.Var("c", relax.TensorType((rows, units), dtype))
    bb = relax.BlockBuilder()
    op = relax.op
    with bb.function("main", [x, c]):
        with bb.dataflow():
            y = bb.emit(op.matmul(x, bb.emit(op.permute_dims(relax.const(w, dtype)))))
            parts = bb.emit(op.split(bb.emit(op.add(y, relax.const(b, dtype))), 4, axis=-1))
            i, f, g, o = (bb.emit(relax.TupleGetItem(parts, j)) for j in range(4))
            i, f, o = (bb.emit(op.sigmoid(t)) for t in (i, f, o))
            g = bb.emit(op.tanh(g))
            c2 = bb.emit(op.add(bb.emit(op.multiply(f, c)), bb.emit(op.multiply(i, g))))
            h = bb.emit(op.multiply(o, bb.emit(op.tanh(c2))))
            out = bb.emit_output(relax.Tuple([h, c2]))
        bb.emit_func_output(out)
    xs = rng.standard_normal((rows, k)).astype(npd)
    cs = rng.standard_normal((rows, units)).astype(npd)
    ig, fg, gg, og = np.split(
        xs.astype("float32") @ w.astype("float32").T + b.astype("float32"), 4, -1
    )
    cr = _sigmoid(fg) * cs.astype("float32") + _sigmoid(ig) * np.tanh(gg)
    return bb.get(), [xs, cs], [_sigmoid(og) * np.tanh(cr), cr]


def _half_swiglu(dtype: str, rows: int, k: int = 37, units: int = 13, seed: int = 27):
    """Llama's ``silu(x @ Wg^T) * (x @ Wu^T)`` in ``dtype`` (sibling linears, joined by the pass)
    and its NumPy float32 reference."""
    rng = np.random.default_rng(seed)
    npd = _np_dtype(dtype)
    wg, wu = ((rng.standard_normal((units, k)) / np.sqrt(k)).astype(npd) for _ in range(2))
    x = relax.Var("x", relax.TensorType((rows, k), dtype))
    bb = relax.BlockBuilder()
    op = relax.op
    with bb.function("main", [x]):
        with bb.dataflow():
            g = bb.emit(op.matmul(x, bb.emit(op.permute_dims(relax.const(wg, dtype)))))
            u = bb.emit(op.matmul(x, bb.emit(op.permute_dims(relax.const(wu, dtype)))))
            out = bb.emit_output(op.multiply(bb.emit(op.nn.silu(g)), u))
        bb.emit_func_output(out)
    xs = rng.standard_normal((rows, k)).astype(npd)
    gr, ur = (xs.astype("float32") @ m.astype("float32").T for m in (wg, wu))
    return bb.get(), [xs], [gr * _sigmoid(gr) * ur]


def _sigmoid(t):
    return 1 / (1 + np.exp(-t))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("build", [_half_lstm, _half_swiglu], ids=["lstm", "swiglu"])
def test_half_precision_numerics_vs_stock_and_numpy(build, dtype):
    """5 rows, K = 37, 13 units (no vector block divides them: padded): one gate kernel whose
    results, in the model's dtype, agree with stock's unfused pipeline and with NumPy in
    float32 within half precision; float32 accumulation makes ours no worse than stock's."""
    mod, inputs, reference = build(dtype, rows=5)
    stock_out, stock = run(mod, inputs, "stock")
    with collect_rewrites() as counts:
        ours_out, ours = run(mod, inputs, "tvm_fusion")
    assert counts["FuseSplitGates"] == 1
    assert analysis.kernel_count(ours.lowered) < analysis.kernel_count(stock.lowered)
    for o, s, r in zip(ours_out, stock_out, reference, strict=True):
        assert o.dtype == _np_dtype(dtype)
        o, s = o.astype("float32"), s.astype("float32")
        np.testing.assert_allclose(o, s, rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(o, r, rtol=1e-2, atol=1e-2)
        assert np.abs(o - r).max() <= np.abs(s - r).max() + 1e-6


def test_half_gate_math_with_casts_and_scalar_bias():
    """float16 with a scalar bias, ``astype`` to float32 and back inside the gate math and a
    ``(1, D)`` state broadcast to the rows: one kernel, numbers as stock's and NumPy's."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((37, 26)) / 6).astype("float16")
    x = relax.Var("x", relax.TensorType((5, 37), "float16"))
    h = relax.Var("h", relax.TensorType((1, 13), "float16"))
    bb = relax.BlockBuilder()
    op = relax.op
    with bb.function("main", [x, h]):
        with bb.dataflow():
            y = bb.emit(op.matmul(x, relax.const(w, "float16")))
            y = bb.emit(op.add(y, relax.const(np.array(0.25, "float16"), "float16")))
            parts = bb.emit(op.split(y, 2, axis=-1))
            a = bb.emit(
                op.astype(bb.emit(op.sigmoid(bb.emit(relax.TupleGetItem(parts, 0)))), "float32")
            )
            b = bb.emit(op.astype(bb.emit(relax.TupleGetItem(parts, 1)), "float32"))
            prod = bb.emit(op.astype(bb.emit(op.multiply(a, b)), "float16"))
            out = bb.emit_output(op.add(prod, h))
        bb.emit_func_output(out)
    inputs = [
        rng.standard_normal((5, 37)).astype("float16"),
        rng.standard_normal((1, 13)).astype("float16"),
    ]
    yr = inputs[0].astype("float32") @ w.astype("float32") + 0.25
    ref = _sigmoid(yr[:, :13]) * yr[:, 13:] + inputs[1].astype("float32")
    with collect_rewrites() as counts:
        compare_pipelines(bb.get(), inputs, rtol=1e-2, atol=1e-2, reference=[ref])
    assert counts["FuseSplitGates"] == 1


@pytest.mark.parametrize("dynamic", [False, True])
def test_bfloat16_linear_views_on_3d_rows(dynamic):
    """bfloat16 SwiGLU on (2, n, 37) rows written as TVM's PyTorch frontend writes a linear
    layer (reshape -> 2-D GEMM -> reshape), static and symbolic n: folded and fused into one
    kernel; our float32 accumulation is within 1e-2 of NumPy, stock's bfloat16 accumulation
    within 3e-2 of ours."""
    rng = np.random.default_rng(3)
    npd = _np_dtype("bfloat16")
    wg, wu = ((rng.standard_normal((13, 37)) / 6).astype(npd) for _ in range(2))
    n = tvm.tirx.Var("n", "int64") if dynamic else 3
    x = relax.Var("x", relax.TensorType((2, n, 37), "bfloat16"))
    bb = relax.BlockBuilder()
    op = relax.op
    with bb.function("main", [x]):
        with bb.dataflow():
            outs = []
            for w in (wg, wu):
                rows = bb.emit(op.reshape(x, (-1, 37)))
                wt = bb.emit(op.permute_dims(relax.const(w, "bfloat16")))
                outs.append(bb.emit(op.reshape(bb.emit(op.matmul(rows, wt)), (2, n, 13))))
            out = bb.emit_output(op.multiply(bb.emit(op.nn.silu(outs[0])), outs[1]))
        bb.emit_func_output(out)
    xs = rng.standard_normal((2, 3, 37)).astype(npd)
    g, u = (xs.astype("float32") @ w.astype("float32").T for w in (wg, wu))
    (stock,), _ = run(bb.get(), [xs], "stock")
    with collect_rewrites() as counts:
        (ours,), _ = run(bb.get(), [xs], "tvm_fusion")
    assert counts["FuseSplitGates"] == 1 and ours.dtype == npd
    ours = ours.astype("float32")
    np.testing.assert_allclose(ours, g * _sigmoid(g) * u, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(ours, stock.astype("float32"), rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_builds_for_sm90(dtype):
    """float16 / bfloat16 gate kernels build for sm_90 with nvcc, for the split-K GEMV (1 row)
    and the tiled rule (19 rows): one gate kernel, no spills; and the CUDA schedule computes
    what the unscheduled kernel computes (thread loops run one after the other on llvm)."""
    tgt = _target.cuda_target()
    for rows in (1, 19):
        mod = _half_lstm(dtype, rows=rows)[0]
        compiled = engine.compile_module(mod, tgt, "tvm_fusion")
        (gate,) = [k for k in cuda_check.check(compiled) if k.name.startswith("fused_gates")]
        assert gate.spill_stores == gate.spill_loads == 0 and gate.registers <= 128, gate.to_text()
        with tgt:
            fused = tvm.transform.Sequential(pipeline.fused_passes(tgt))(mod)
        (func,) = [f for _, f in fused.functions_items() if GATE_ATTR in getattr(f, "attrs", {})]
        scheduled = cuda.GateFusion().apply(func, tgt, False).mod["main"]
        rng = np.random.default_rng(rows)
        args = [
            (rng.standard_normal([int(d) for d in p.shape]) * 0.5).astype(_np_dtype(dtype))
            for p in func.params
        ]
        ours, plain = _run_prim(_serial_threads(scheduled), args), _run_prim(func, args)
        for a, b in zip(ours, plain, strict=True):
            np.testing.assert_allclose(
                a.astype("float32"), b.astype("float32"), rtol=1e-2, atol=1e-2
            )


def _serial_threads(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """``func`` with its thread loops serial and its buffers global, runnable on llvm (as in
    tests/schedule/test_cuda_rules.py)."""
    text = func.script()
    text = re.sub(r'T\.thread_binding\((.+?), thread="[^"]+"\)', r"T.serial(\1)", text)
    text = re.sub(r'"software_pipeline_\w+": \[[^\]]*\](, )?', "", text)
    text = text.replace('scope="shared"', 'scope="global"').replace('scope="local"', "")
    parsed = tvm.script.from_source(text)
    return parsed if isinstance(parsed, tvm.tirx.PrimFunc) else parsed["main"]


def _run_prim(func: tvm.tirx.PrimFunc, args: list) -> list:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    tensors = [tvm.runtime.tensor(a) for a in args]
    lib["main"](*tensors)
    return [t.numpy() for t in tensors]


if __name__ == "__main__":
    tvm.testing.main()


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", GATE_WORKLOADS)
def test_cuda_compile_no_global_gemm_intermediate(name, dynamic):
    """For CUDA the gate kernel compiles and keeps the GEMM outputs on chip: a thread's
    register tile (rows x gates x 4 units, at most 64 accumulators; the split-K GEMV's partial
    sums alike) and shared memory (the staged ``x`` and weight slabs); no global buffer."""
    inst = models.build(name, "small", dynamic=dynamic)
    compiled = engine.compile_module(inst.mod, CUDA, "tvm_fusion")
    kernel = next(
        f for gv, f in compiled.lowered.functions_items() if gv.name_hint.startswith("fused_gates")
    )
    assert "threadIdx.x" in kernel.script()
    buffers = tir_util.compacted_allocations(kernel)
    assert buffers
    for buf in buffers:
        assert buf.scope() in ("local", "shared"), buf.name
        n = tir_util.num_elements(buf)
        assert n is not None, buf.name
        if buf.scope() == "local":
            assert n <= 64, (buf.name, n)


def _lstm_tail(bb, gates, c):
    """split(gates, 4) -> the LSTM cell's (h, c)."""
    parts = bb.emit(relax.op.split(gates, 4, axis=1))
    i, f, g, o = (bb.emit(relax.TupleGetItem(parts, k)) for k in range(4))
    c2 = bb.emit(
        relax.op.add(
            relax.op.multiply(relax.op.sigmoid(f), c),
            relax.op.multiply(relax.op.sigmoid(i), relax.op.tanh(g)),
        )
    )
    h2 = bb.emit(relax.op.multiply(relax.op.sigmoid(o), relax.op.tanh(c2)))
    return relax.Tuple([h2, c2])


def _summed_linears(const_weights: bool):
    """torch.nn.LSTMCell's shape after import: (x @ Wih^T + bih) + (h @ Whh^T + bhh) -> split."""
    rng = np.random.default_rng(3)
    wih = rng.standard_normal((64, 8)).astype("float32") / 4
    whh = rng.standard_normal((64, 16)).astype("float32") / 4
    bih, bhh = (rng.standard_normal(64).astype("float32") for _ in range(2))
    x = relax.Var("x", relax.TensorType((tvm.tirx.Var("n", "int64"), 8), "float32"))
    h = relax.Var("h", relax.TensorType((x.ty.shape[0], 16), "float32"))
    c = relax.Var("c", relax.TensorType((x.ty.shape[0], 16), "float32"))
    params = [x, h, c]
    if const_weights:
        w1, w2 = relax.const(wih), relax.const(whh)
    else:
        w1 = relax.Var("wih", relax.TensorType((64, 8), "float32"))
        w2 = relax.Var("whh", relax.TensorType((64, 16), "float32"))
        params += [w1, w2]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            a = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w1, [1, 0]))))
            a = bb.emit(relax.op.add(a, relax.const(bih)))
            b = bb.emit(relax.op.matmul(h, bb.emit(relax.op.permute_dims(w2, [1, 0]))))
            b = bb.emit(relax.op.add(b, relax.const(bhh)))
            out = bb.emit_output(_lstm_tail(bb, bb.emit(relax.op.add(a, b)), c))
        bb.emit_func_output(out)
    inputs = [rng.standard_normal((3, k)).astype("float32") for k in (8, 16, 16)]
    if not const_weights:
        inputs += [wih, whh]
    return bb.get(), inputs, (wih, whh, bih + bhh)


def test_two_summed_linears_become_one_gate_gemm():
    from tvm_fusion.transform.fuse_split_gates.merge import _MergeSummedGemms

    mod, _, (wih, whh, bias) = _summed_linears(const_weights=True)
    merged = _MergeSummedGemms(mod).transform()
    x, h, c = merged["main"].params
    bb = relax.BlockBuilder()
    with bb.function("main", [x, h, c]):
        with bb.dataflow():
            xc = bb.emit(relax.op.concat([x, h], axis=-1))
            wt = bb.emit(relax.op.permute_dims(relax.const(np.concatenate([wih, whh], 1)), [1, 0]))
            y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(xc, wt)), relax.const(bias)))
            out = bb.emit_output(_lstm_tail(bb, y, c))
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(merged, bb.get())


def test_two_summed_linears_numerics_and_one_gate_kernel():
    mod, inputs, _ = _summed_linears(const_weights=True)
    with collect_rewrites() as counts:
        ours, stock = compare_pipelines(mod, inputs, rtol=1e-5, atol=1e-5)
    assert counts.get("FuseSplitGates") == 1
    report = analysis.fusion_report(mod, tvm_fusion.host_target())
    assert report.ours_kernels == 2 and report.stock_kernels > 2, report.to_text()  # concat, gates


def test_two_summed_linears_with_runtime_weights_left_alone():
    from tvm_fusion.transform.fuse_split_gates.merge import _MergeSummedGemms

    mod, _, _ = _summed_linears(const_weights=False)
    assert _MergeSummedGemms(mod).transform().same_as(mod)


# ---------------------------------------------------------------------------------------------
# Sibling linear layers of one input (Llama's gate_proj / up_proj): joined into one gate GEMM


def _swiglu_mlp(layers: int = 1, width: int = 16, hidden: int = 8, up_also_output=False):
    """Llama's MLP as the ONNX importer writes it (weights (K, N) constants, rows symbolic):
    ``g = x @ Wg; (g * sigmoid(g)) * (x @ Wu)``, then the down projection; ``layers`` MLPs in a
    row, each reading the previous one's result, in one dataflow block."""
    rng = np.random.default_rng(5)
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, hidden), "float32"))
    weights = []
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h, extra = x, []
            for _ in range(layers):
                wg, wu = (rng.standard_normal((hidden, width)).astype("float32") / 3 for _ in "gu")
                wd = rng.standard_normal((width, hidden)).astype("float32") / 3
                weights.append((wg, wu, wd))
                g = bb.emit(relax.op.matmul(h, relax.const(wg)))
                act = bb.emit(relax.op.multiply(g, bb.emit(relax.op.sigmoid(g))))
                u = bb.emit(relax.op.matmul(h, relax.const(wu)))
                if up_also_output:
                    extra.append(u)
                h = bb.emit(relax.op.matmul(bb.emit(relax.op.multiply(act, u)), relax.const(wd)))
            out = bb.emit_output(relax.Tuple([h, *extra]) if extra else h)
        bb.emit_func_output(out)
    return bb.get(), weights


def test_sibling_linears_become_one_split_gemm():
    from tvm_fusion.transform.fuse_split_gates.merge import _MergeSiblingGemms

    mod, [(wg, wu, wd)] = _swiglu_mlp()
    merger = _MergeSiblingGemms(mod)
    merged = merger.transform()
    assert len(merger.merged) == 1
    (x,) = merged["main"].params
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            wt = bb.emit(relax.op.permute_dims(relax.const(np.concatenate([wg.T, wu.T])), [1, 0]))
            y = bb.emit(relax.op.matmul(x, wt))
            parts = bb.emit(relax.op.split(y, 2, axis=-1))
            g, u = (bb.emit(relax.TupleGetItem(parts, i)) for i in range(2))
            act = bb.emit(relax.op.multiply(g, bb.emit(relax.op.sigmoid(g))))
            h = bb.emit(relax.op.matmul(bb.emit(relax.op.multiply(act, u)), relax.const(wd)))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(merged, bb.get())


def test_sibling_linears_fuse_into_one_gate_kernel_per_layer(target):
    """Two MLPs in one block: the second layer's gate input depends on the first group's
    result, so the groups are emitted in dependency order (a use before its definition
    otherwise). Numerics vs stock at 1, 3 and 5 rows."""
    mod, _ = _swiglu_mlp(layers=2)
    with target:
        fused = FuseSplitGates()(mod)
    gate_funcs = [gv.name_hint for gv in fused.get_global_vars() if "fused_gates" in gv.name_hint]
    assert len(gate_funcs) == 2, fused["main"].script()
    main = fused["main"].script()
    assert main.count("R.matmul") == 2 and "R.split" not in main, main  # down projections
    for rows in (1, 3, 5):
        inputs = [np.random.default_rng(rows).standard_normal((rows, 8)).astype("float32")]
        with collect_rewrites() as counts:
            compare_pipelines(mod, inputs, rtol=1e-4, atol=1e-4)
        assert counts.get("FuseSplitGates") == 2


def test_sibling_projections_read_by_other_ops_left_alone():
    """q/k/v-style siblings (results reshaped, not gate math) and a gate sibling whose result
    is also a function output are not joined."""
    from tvm_fusion.transform.fuse_split_gates.merge import _MergeSiblingGemms

    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((tvm.tirx.Var("n", "int64"), 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            q, k = (
                bb.emit(relax.op.matmul(x, relax.const(rng.standard_normal((8, 16), "float32"))))
                for _ in "qk"
            )
            q4, k4 = (bb.emit(relax.op.reshape(t, (x.ty.shape[0], 4, 4))) for t in (q, k))
            out = bb.emit_output(relax.op.add(q4, k4))
        bb.emit_func_output(out)
    mod = bb.get()
    assert _MergeSiblingGemms(mod).transform().same_as(mod)
    mod, _ = _swiglu_mlp(up_also_output=True)
    assert _MergeSiblingGemms(mod).transform().same_as(mod)


def test_sibling_linears_of_odd_width_join_and_fuse_padded(target):
    """Width 3: no vector block divides it; the blocked weight is padded to a whole block (zero
    columns nothing reads), so the joined GEMM and its gates are one kernel, numbers right."""
    from tvm_fusion.transform.fuse_split_gates.merge import _merge_siblings

    mod, _ = _swiglu_mlp(width=3)
    assert not _merge_siblings(mod, target).same_as(mod)
    with collect_rewrites() as counts:
        with target:
            FuseSplitGates()(_merge_siblings(mod, target))
    assert counts["FuseSplitGates"] == 1


def test_blocked_weight_pads_units_to_whole_blocks():
    """(k*D, K) with D = 5, V = 4: (2, K, k, 4), units 5..7 zero, the rest in place."""
    from tvm_fusion.transform.fuse_split_gates.plan import _blocked_weight

    gates, width, k = 3, 5, 2
    w = np.arange(gates * width * k, dtype="float32").reshape(gates * width, k) + 1
    blocked = _blocked_weight(w, True, gates, width, 4)
    assert blocked.shape == (2, k, gates, 4)
    for g in range(gates):
        for d in range(8):
            column = blocked[d // 4, :, g, d % 4]
            expect = w[g * width + d] if d < width else np.zeros(k)
            np.testing.assert_array_equal(column, expect)


def _t5_gated_gelu(rows, hidden: int = 8, width: int = 16, seed: int = 3):
    """T5's gated-GELU feed-forward as torch.export writes it (``wi_0`` and ``wi_1`` sibling
    Linears, ``gelu_new`` with ``pow(x, 3)``, ``tanh``), then ``wo``."""
    rng = np.random.default_rng(seed)
    x = relax.Var("x", relax.TensorType((rows, hidden), "float32"))
    w0, w1 = (rng.standard_normal((hidden, width)).astype("float32") / 3 for _ in "01")
    wo = rng.standard_normal((width, hidden)).astype("float32") / 3

    def c(v):
        return relax.const(np.array(v, "float32"))

    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h0 = bb.emit(relax.op.matmul(x, relax.const(w0)))
            cube = bb.emit(relax.op.power(h0, c(3.0)))
            inner = bb.emit(relax.op.add(h0, bb.emit(relax.op.multiply(cube, c(0.044715)))))
            t = bb.emit(relax.op.tanh(bb.emit(relax.op.multiply(inner, c(0.7978845608)))))
            gelu = bb.emit(
                relax.op.multiply(
                    bb.emit(relax.op.multiply(h0, c(0.5))), bb.emit(relax.op.add(t, c(1.0)))
                )
            )
            h1 = bb.emit(relax.op.matmul(x, relax.const(w1)))
            y = bb.emit(relax.op.matmul(bb.emit(relax.op.multiply(gelu, h1)), relax.const(wo)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)

    def reference(xv):
        a = xv @ w0
        g = 0.5 * a * (1 + np.tanh(0.7978845608 * (a + 0.044715 * a**3)))
        return (g * (xv @ w1)) @ wo

    return bb.get(), reference


@pytest.mark.parametrize("rows", [5, "n"])
def test_t5_gated_gelu_with_power_fuses(rows, target):
    """``pow(x, 3)`` is gate math (it was not among the pass' ops, so T5's wi_0/wi_1 pair was
    dropped without a word): one gate kernel, numbers right at static and symbolic rows."""
    n = tvm.tirx.Var("n", "int64") if rows == "n" else rows
    mod, reference = _t5_gated_gelu(n)
    with target:
        fused = FuseSplitGates()(mod)
    gate_funcs = [gv.name_hint for gv in fused.get_global_vars() if "fused_gates" in gv.name_hint]
    assert len(gate_funcs) == 1, fused["main"].script()
    assert "R.power" not in fused["main"].script()
    for m in (1, 5, 7):
        if rows != "n" and m != rows:
            continue
        xv = np.random.default_rng(m).standard_normal((m, 8)).astype("float32")
        with collect_rewrites() as counts:
            ours, _ = compare_pipelines(mod, [xv], rtol=1e-4, atol=1e-4, reference=[reference(xv)])
        assert counts.get("FuseSplitGates") == 1


def test_gate_math_with_comparisons_where_and_casts_fuses(target):
    """A ReLU written as ``where(g > 0, g, 0)`` times the up projection, through a cast and
    ``erf``: every op is one LegalizeOps makes injective, so the group fuses."""
    rng = np.random.default_rng(11)
    x = relax.Var("x", relax.TensorType((6, 8), "float32"))
    wg, wu = (rng.standard_normal((8, 16)).astype("float32") / 3 for _ in "gu")
    zero = relax.const(np.array(0.0, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            g = bb.emit(relax.op.matmul(x, relax.const(wg)))
            relu = bb.emit(relax.op.where(bb.emit(relax.op.greater(g, zero)), g, zero))
            e = bb.emit(relax.op.astype(bb.emit(relax.op.erf(relu)), "float32"))
            u = bb.emit(relax.op.matmul(x, relax.const(wu)))
            out = bb.emit_output(relax.op.multiply(e, u))
        bb.emit_func_output(out)
    mod = bb.get()
    xv = rng.standard_normal((6, 8)).astype("float32")
    from scipy.special import erf

    a = xv @ wg
    expect = erf(np.where(a > 0, a, 0)) * (xv @ wu)
    with collect_rewrites() as counts:
        compare_pipelines(mod, [xv], rtol=1e-4, atol=1e-5, reference=[expect])
    assert counts.get("FuseSplitGates") == 1


# ---------------------------------------------------------------------------------------------
# Biases that are not per-feature (issue #27): a constant's size is no evidence of its shape


def _gated_with_bias(rows: int, bias_shape: tuple):
    """``tanh(x @ Wg) * (x @ Wu + b)`` with x (rows, 4), rows == features, b constant of
    ``bias_shape``: the module, its input, the NumPy result and (Wg, Wu, b)."""
    rng = np.random.default_rng(rows)
    wg, wu = (rng.standard_normal((4, rows)).astype("float32") for _ in "gu")
    b = rng.standard_normal(bias_shape).astype("float32")
    x = relax.Var("x", relax.TensorType((rows, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            g = bb.emit(relax.op.tanh(bb.emit(relax.op.matmul(x, relax.const(wg)))))
            u = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(wu))), relax.const(b)))
            out = bb.emit_output(relax.op.multiply(g, u))
        bb.emit_func_output(out)
    xv = rng.standard_normal((rows, 4)).astype("float32")
    return bb.get(), [xv], np.tanh(xv @ wg) * (xv @ wu + b), (wg, wu, b)


@pytest.mark.parametrize("rows", [8, 5])
@pytest.mark.parametrize("bias", ["per_row", "full", "per_feature"])
def test_sibling_linears_bias_shapes_numerics(rows, bias):
    """A per-row bias (rows, 1) with rows == features has as many elements as a per-feature
    one; it was flattened into the joined GEMM's bias (max error ~1 at 8 rows). Per-row and
    full (rows, N) biases stay adds in the gate math; per-feature ones join the GEMM (width 5:
    the blocked weight padded to a whole vector block)."""
    shape = {"per_row": (rows, 1), "full": (rows, rows), "per_feature": (rows,)}[bias]
    mod, inputs, expected, _ = _gated_with_bias(rows, shape)
    with collect_rewrites() as counts:
        compare_pipelines(mod, inputs, rtol=1e-5, atol=1e-5, reference=[expected])
    assert counts.get("FuseSplitGates", 0) == 1


def test_per_row_bias_stays_out_of_the_joined_gemm():
    """The siblings are joined without a bias; the per-row add stays on the up piece."""
    from tvm_fusion.transform.fuse_split_gates.merge import _MergeSiblingGemms

    mod, _, _, (wg, wu, b) = _gated_with_bias(8, (8, 1))
    merged = _MergeSiblingGemms(mod).transform()
    (x,) = merged["main"].params
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            wt = bb.emit(relax.op.permute_dims(relax.const(np.concatenate([wg.T, wu.T])), [1, 0]))
            parts = bb.emit(relax.op.split(bb.emit(relax.op.matmul(x, wt)), 2, axis=-1))
            g, u = (bb.emit(relax.TupleGetItem(parts, i)) for i in range(2))
            g = bb.emit(relax.op.tanh(g))
            u = bb.emit(relax.op.add(u, relax.const(b)))
            out = bb.emit_output(relax.op.multiply(g, u))
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(merged, bb.get())


def _summed_with_bias(bias_shape: tuple):
    """``(x @ W1 + b) + h @ W2 -> split -> sigmoid(i) * g`` over 16 rows and 16 features."""
    rng = np.random.default_rng(7)
    w1, w2 = (rng.standard_normal((4, 16)).astype("float32") for _ in "12")
    b = rng.standard_normal(bias_shape).astype("float32")
    x, h = (relax.Var(name, relax.TensorType((16, 4), "float32")) for name in "xh")
    bb = relax.BlockBuilder()
    with bb.function("main", [x, h]):
        with bb.dataflow():
            a = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w1))), relax.const(b)))
            y = bb.emit(relax.op.add(a, bb.emit(relax.op.matmul(h, relax.const(w2)))))
            parts = bb.emit(relax.op.split(y, 2, axis=-1))
            i, g = (bb.emit(relax.TupleGetItem(parts, k)) for k in range(2))
            out = bb.emit_output(relax.op.multiply(bb.emit(relax.op.sigmoid(i)), g))
        bb.emit_func_output(out)
    xv, hv = (rng.standard_normal((16, 4)).astype("float32") for _ in "xh")
    ref = xv @ w1 + b + hv @ w2
    return bb.get(), [xv, hv], 1 / (1 + np.exp(-ref[:, :8])) * ref[:, 8:]


def test_summed_linears_with_a_per_row_bias_left_alone():
    """A (rows, 1) bias of one summand (rows == features) is not a GEMM bias: no merge, and
    the numbers match; a per-feature (N,) one still merges."""
    from tvm_fusion.transform.fuse_split_gates.merge import _MergeSummedGemms

    mod, inputs, expected = _summed_with_bias((16, 1))
    assert _MergeSummedGemms(mod).transform().same_as(mod)
    compare_pipelines(mod, inputs, rtol=1e-5, atol=1e-5, reference=[expected])
    mod, _, _ = _summed_with_bias((16,))
    assert not _MergeSummedGemms(mod).transform().same_as(mod)


def test_bias_adding_leading_axes_left_alone(target):
    """``x (1, K) @ W + b (1, 1, N)`` is a (1, 1, N) result: the split GEMM has more dims than
    its input (the matcher crashed comparing them), constant or runtime bias."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 16)).astype("float32")
    b = rng.standard_normal((1, 1, 16)).astype("float32")
    x = relax.Var("x", relax.TensorType((1, 4), "float32"))
    bv = relax.Var("b", relax.TensorType((1, 1, 16), "float32"))
    for bias, params, inputs in ((relax.const(b), [x], []), (bv, [x, bv], [b])):
        bb = relax.BlockBuilder()
        with bb.function("main", params):
            with bb.dataflow():
                y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w))), bias))
                parts = bb.emit(relax.op.split(y, 2, axis=-1))
                i, g = (bb.emit(relax.TupleGetItem(parts, k)) for k in range(2))
                out = bb.emit_output(relax.op.multiply(bb.emit(relax.op.sigmoid(i)), g))
            bb.emit_func_output(out)
        mod = bb.get()
        with target:
            tvm.ir.assert_structural_equal(FuseSplitGates()(mod), mod)
        xv = rng.standard_normal((1, 4)).astype("float32")
        ref = xv @ w + b
        expected = 1 / (1 + np.exp(-ref[..., :8])) * ref[..., 8:]
        compare_pipelines(mod, [xv, *inputs], rtol=1e-5, atol=1e-5, reference=[expected])


def test_scalar_bias_fuses(target):
    """``x @ W + b`` with a 0-d constant ``b`` (ONNX Add of a scalar) is a GEMM bias too: the
    matcher indexed its last dim and raised IndexError (found by scripts/fuzz.py)."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((4, 16)).astype("float32")
    b = np.array(0.25, dtype="float32")
    x = relax.Var("x", relax.TensorType((3, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w))), relax.const(b)))
            parts = bb.emit(relax.op.split(y, 2, axis=-1))
            i, g = (bb.emit(relax.TupleGetItem(parts, k)) for k in range(2))
            out = bb.emit_output(relax.op.multiply(bb.emit(relax.op.sigmoid(i)), g))
        bb.emit_func_output(out)
    mod = bb.get()
    with collect_rewrites() as counts:
        with target:
            FuseSplitGates()(mod)
    assert counts.get("FuseSplitGates", 0) == 1
    xv = rng.standard_normal((3, 4)).astype("float32")
    ref = xv @ w + b
    expected = 1 / (1 + np.exp(-ref[..., :8])) * ref[..., 8:]
    compare_pipelines(mod, [xv], rtol=1e-5, atol=1e-5, reference=[expected])
