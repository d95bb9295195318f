"""FuseSplitGates on float16 / bfloat16: every GEMM input, weight, bias and addend has the
model's dtype; the kernel accumulates in float32, runs the gate math on the float32 tile and
rounds each result once, where it is written (structural cases for a CUDA target, numerics
against stock and NumPy on llvm, an sm_90 build with nvcc where installed).

Must not fire: mixed dtypes (a float16 GEMM with a float32 result and bias, an ``astype``
before the split).
"""

import re
import shutil

import ml_dtypes
import numpy as np
import pytest
import tvm
import tvm.testing
from _gates_helpers import GatesBase
from helpers import compare_pipelines, run
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion import analysis
from tvm_fusion import target as _target
from tvm_fusion.build import engine, pipeline
from tvm_fusion.schedule import cuda
from tvm_fusion.tools import cuda_check
from tvm_fusion.transform import collect_rewrites
from tvm_fusion.transform.fuse_split_gates import GATE_ATTR


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
