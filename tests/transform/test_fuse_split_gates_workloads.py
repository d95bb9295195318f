"""FuseSplitGates on the model cells (gate_2890, LSTM, GRU, SwiGLU, GeGLU): numerics against
the reference and stock (static and dynamic rows, and through the ONNX importer), one kernel
per gate group, the blocked constant weight ``Wb (D/V, K, k, V)`` (padded to whole blocks), no
global buffer of the GEMM output (llvm and CUDA), the LSTM's two results from one call.
"""

import numpy as np
import pytest
import tvm
import tvm.testing
from _gates_helpers import CUDA
from helpers import compare_pipelines
from tvm import relax

import tvm_fusion
from tvm_fusion import analysis, models, tir_util
from tvm_fusion.build import engine
from tvm_fusion.transform import FuseSplitGates, collect_rewrites

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


if __name__ == "__main__":
    tvm.testing.main()
