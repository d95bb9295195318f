"""The tensor-core CUDA schedule of float16 / bfloat16 gate kernels, checked without a GPU.

- the tile: within 48 KB of static shared memory and 8 warps, >= 132 thread blocks at the
  benchmark sizes (gate_2890 at 64 rows: 256 blocks of one warp per gate);
- the bfloat16 intrinsics are TVM's float16 ones with the element type changed: retyped back to
  float16 they give TVM's descriptions and mma implementation;
- what the schedule computes: tensorized ``mma.sync`` blocks cannot run on llvm, so the test runs
  the same schedule stopped before ``tensorize`` (same tiles, shared / warp buffers, layouts,
  padding, gate math; its threads serial, on llvm) and compares it with the unscheduled kernel;
  ``tensorize`` itself checks that each block it replaces is the intrinsic's description, and
  the tensorized schedule of the same kernel must exist. 64 rows x 48 units x K = 128 (SwiGLU),
  float16 and bfloat16; padded: 77 rows x K = 100 and symbolic rows (run with 37), also built
  for sm_90; GeGLU (erf) at 37 x 48 x K = 100; a GRU cell (two GEMMs, one accumulator buffer)
  at 37 rows x 48 units, K = 40 and 48, float16 and bfloat16; 97 rows x K = 389 (gate_2890's
  gates) is only built for sm_90 (its serial copy fails TVM's use-before-def check on llvm);
- float32 kernels, sm_75 and 5 rows are left to the CUDA-core schedules;
- at the benchmark sizes of gate_2890 (64 x 3 x 1024 x 1024), SwiGLU's and GeGLU's gate+up
  (64 x 2 x 5632 x 2048) and a GRU cell (64 rows, 2 x 3 x 1024 x 1024) in float16 and bfloat16,
  built for sm_90 with nvcc
  (skipped without it): one gate kernel, ``mma.sync.m16n8k16`` with float32 accumulators in its
  PTX, 16-byte ``cp.async`` copies and ``bar.sync`` in the reduction loop, ptxas without spills
  or stack within 128 registers and 48 KB of static shared memory, >= 132 blocks, no global
  (rows, gates, D) buffer;
- a float16 and a bfloat16 gate model still compile and fuse on llvm, with the numbers of NumPy.
"""

from __future__ import annotations

import re
import shutil

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op as R
from tvm.s_tir import TensorIntrin

from tvm_fusion import analysis, tir_util
from tvm_fusion import target as _target
from tvm_fusion.build import engine, pipeline
from tvm_fusion.schedule.cuda import gate_tensor_core as gtc
from tvm_fusion.tools import cuda_check

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
HALF = ["float16", "bfloat16"]


def _np(dtype: str):
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def _gate_module(rows, k: int, d: int, dtype: str, act: str = "2890") -> tvm.IRModule:
    """gate_2890's graph (``act="2890"``: bias, split(3), sigmoid + tanh * exp), a GLU's
    (``silu`` / ``gelu``: split(2), act(gate) * up) or a GRU cell's (``gru``: two GEMMs, of
    ``x`` and of ``h`` (rows x d), r * (W_hn h + b_hn)) in ``dtype``; ``rows`` an int or a
    name."""
    if act == "gru":
        return _gru_module(rows, k, d, dtype)
    gen = np.random.default_rng(26)
    gates = 3 if act == "2890" else 2
    w = (gen.standard_normal((gates * d, k)) * k**-0.5).astype(_np(dtype))
    n = tvm.tirx.Var(rows, "int64") if isinstance(rows, str) else rows
    x = relax.Var("x", relax.TensorType((n, k), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(R.matmul(x, bb.emit(R.permute_dims(relax.const(w, dtype)))))
            if act == "2890":
                b = (gen.standard_normal(3 * d) * 0.1).astype(_np(dtype))
                y = bb.emit(R.add(y, relax.const(b, dtype)))
            parts = bb.emit(R.split(y, gates, axis=-1))
            p = [bb.emit(relax.TupleGetItem(parts, i)) for i in range(gates)]
            if act == "2890":
                s, t, e = bb.emit(R.sigmoid(p[0])), bb.emit(R.tanh(p[1])), bb.emit(R.exp(p[2]))
                out = bb.emit_output(R.add(s, bb.emit(R.multiply(t, e))))
            else:
                g = bb.emit(R.nn.silu(p[0]) if act == "silu" else R.nn.gelu(p[0]))
                out = bb.emit_output(R.multiply(g, p[1]))
        bb.emit_func_output(out)
    return bb.get()


def _gru_module(rows, k: int, d: int, dtype: str) -> tvm.IRModule:
    """One GRU step (torch's GRUCell, as models.gates.gru_cell) in ``dtype``."""
    gen = np.random.default_rng(2014)

    def const(*shape, scale=1.0):
        return relax.const((gen.standard_normal(shape) * scale).astype(_np(dtype)), dtype)

    n = tvm.tirx.Var(rows, "int64") if isinstance(rows, str) else rows
    x = relax.Var("x", relax.TensorType((n, k), dtype))
    h = relax.Var("h", relax.TensorType((n, d), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, h]):
        with bb.dataflow():

            def gates(a, width):
                w = bb.emit(R.permute_dims(const(3 * d, width, scale=width**-0.5)))
                y = bb.emit(R.add(bb.emit(R.matmul(a, w)), const(3 * d, scale=0.1)))
                parts = bb.emit(R.split(y, 3, axis=-1))
                return [bb.emit(relax.TupleGetItem(parts, i)) for i in range(3)]

            i_r, i_z, i_n = gates(x, k)
            h_r, h_z, h_n = gates(h, d)
            r = bb.emit(R.sigmoid(bb.emit(R.add(i_r, h_r))))
            z = bb.emit(R.sigmoid(bb.emit(R.add(i_z, h_z))))
            cand = bb.emit(R.tanh(bb.emit(R.add(i_n, bb.emit(R.multiply(r, h_n))))))
            keep = bb.emit(R.subtract(relax.const(1.0, dtype), z))
            new = R.add(bb.emit(R.multiply(keep, cand)), bb.emit(R.multiply(z, h)))
            out = bb.emit_output(new)
        bb.emit_func_output(out)
    return bb.get()


def _gate_kernel(mod: tvm.IRModule, tgt) -> tvm.tirx.PrimFunc:
    with tgt:
        fused = tvm.transform.Sequential(pipeline.fused_passes(tgt))(mod)
    (func,) = [
        f
        for _, f in fused.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and "tvm_fusion.gate_fusion" in f.attrs
    ]
    return func


@pytest.mark.parametrize(
    "rows, units, gates, k, min_blocks",
    [(64, 1024, 3, 1024, 256), (64, 5632, 2, 2048, gtc.SMS), (64, 1024, 4, 1024, gtc.SMS)],
)
def test_tile_fits_and_fills_the_sms(rows, units, gates, k, min_blocks):
    tile = gtc.choose_tile(rows, units, 32, gates, k)
    assert gtc.smem_bytes(tile) <= gtc.SMEM_BUDGET and tile.warps <= gtc.MAX_WARPS
    assert k % tile.bk == 0
    assert -(-rows // tile.bm) * -(-units // tile.bn) >= min_blocks, tile
    symbolic = gtc.choose_tile(tvm.tirx.Var("n", "int64"), units, 32, gates, k)
    assert symbolic == gtc.choose_tile(gtc.SYMBOLIC_ROWS, units, 32, gates, k)


@pytest.mark.parametrize(
    "rows, units, gates, k",
    [(64, 5632, 2, 2048), (37, 1024, 3, 1024), (16, 1024, 4, 1024), (128, 1024, 3, [1024] * 2)],
)
def test_few_rows_deepen_the_weight_stream(rows, units, gates, k):
    """Few rows (<= SKINNY_ROWS, or symbolic): the kernel streams its weight, so the pipeline
    holds more than one step in flight (3 or 4 stages within the shared memory; SwiGLU's 64 x
    2048 -> 2 x 5632 had 2 stages, one 12 KB step in flight per block). Many rows: unchanged."""
    tile = gtc.choose_tile(rows, units, 32, gates, k)
    assert tile.stages >= 3 and gtc.smem_bytes(tile) <= gtc.SMEM_BUDGET, tile
    gemms = 1 if isinstance(k, int) else len(k)
    two = [gtc.TensorCoreTile(tile.wr, tile.wu, bk, gates, gemms) for bk in (64, 32, 16)]
    two = next(t for t in two if gtc.smem_bytes(t) <= gtc.SMEM_BUDGET)  # 2 stages, widest step
    assert tile.bk * (tile.stages - 1) > two.bk * (two.stages - 1), (tile, two)
    symbolic = gtc.choose_tile(tvm.tirx.Var("n", "int64"), units, 32, gates, k)
    assert symbolic.stages >= 3, symbolic
    assert gtc.choose_tile(512, units, 32, gates, k).stages == gtc.STAGES


def test_swiglu_gate_takes_the_measured_tile():
    """SwiGLU's 64 x 2048 -> 2 x 5632 gate: 4 stages of 32 (0.057 ms on an H100 and an H200),
    not 3 stages of 64 (0.080 ms, the widest bytes in flight): the most stages first."""
    tile = gtc.choose_tile(64, 5632, 16, 2, [2048])
    assert (tile.wr, tile.wu, tile.bk, tile.stages) == (4, 1, 32, 4), tile
    # where 4 stages of the widest step fit, the widest step stays (gate_2890: 4 of 64)
    assert gtc.choose_tile(64, 1024, 16, 3, [1024]).bk == 64


def test_retyped_intrinsics_are_tvms_for_float16():
    """The bfloat16 intrinsics are made by retyping TVM's float16 ones; retyped to float16 they
    are TVM's (the ldmatrix implementation differs only in its pointer's printed type)."""
    # imported here, not at collection: it parses ~250 TVMScript intrinsics (~5 s per process)
    from tvm.s_tir.tensor_intrin import cuda as tc

    for name in (tc.LDMATRIX_f16_A_INTRIN, tc.LDMATRIX_f16_B_INTRIN, tc.MMA_f16f16f32_INTRIN):
        desc, impl = gtc.retyped(name, "float16")
        tvm.ir.assert_structural_equal(desc, TensorIntrin.get(name).desc)
        if name == tc.MMA_f16f16f32_INTRIN:
            tvm.ir.assert_structural_equal(impl, TensorIntrin.get(name).impl)
        desc_bf16, _ = gtc.retyped(name, "bfloat16")
        assert "bfloat16" in desc_bf16.script() and 'float16"' not in desc_bf16.script().replace(
            '"bfloat16"', ""
        )


def _sequential(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """``func`` with its thread loops serial and its buffers global (its meaning, runnable on
    llvm); the software pipeline's annotations dropped."""
    text = func.script()
    text = re.sub(r'T\.thread_binding\((.+?), thread="[^"]+"\)', r"T.serial(\1)", text)
    text = re.sub(r'"software_pipeline_\w+": \[[^\]]*\](, )?', "", text)
    for scope in ("shared", "warp", "local"):
        text = text.replace(f'scope="{scope}"', 'scope="global"')
    parsed = tvm.script.from_source(text)
    return parsed if isinstance(parsed, tvm.tirx.PrimFunc) else parsed["main"]


def _run(func: tvm.tirx.PrimFunc, args: list[np.ndarray]) -> list[np.ndarray]:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    tensors = [tvm.runtime.tensor(a) for a in args]
    lib["main"](*tensors)
    return [t.numpy() for t in tensors]


CASES = {  # name: (module, rows): the padded cases run with 37 rows for a symbolic n
    "64x48x128_silu_bf16": (lambda: _gate_module(64, 128, 48, "bfloat16", "silu"), 64),
    "64x48x128_silu_f16": (lambda: _gate_module(64, 128, 48, "float16", "silu"), 64),
    "77x48x100_silu_f16": (lambda: _gate_module(77, 100, 48, "float16", "silu"), 77),
    "nx48x128_silu_bf16": (lambda: _gate_module("n", 128, 48, "bfloat16", "silu"), 37),
    "37x48x100_gelu_f16": (lambda: _gate_module(37, 100, 48, "float16", "gelu"), 37),
    "37x48x40_gru_f16": (lambda: _gate_module(37, 40, 48, "float16", "gru"), 37),
    "37x48x40_gru_bf16": (lambda: _gate_module(37, 40, 48, "bfloat16", "gru"), 37),
}


@pytest.mark.parametrize("case", list(CASES))
def test_schedule_computes_the_same(case):
    build, rows = CASES[case]
    tgt = _target.cuda_target()
    func = _gate_kernel(build(), tgt)
    assert gtc.schedule(func, tgt) is not None  # the tensorized schedule exists
    sch = gtc.schedule(func, tgt, tensorize=False)
    scheduled = sch.mod["main"]
    scopes = {b.scope() for b in tir_util.allocated_buffers(scheduled)}
    assert scopes == {"shared", "warp"}, scopes
    rng = np.random.default_rng(0)
    args = []
    for param in func.params:
        shape = [int(d) if isinstance(d, tvm.tirx.IntImm) else rows for d in param.shape]
        args.append((rng.standard_normal(shape) * 0.3).astype(param.dtype))
    ours = _run(_sequential(scheduled), args)
    plain = _run(func, args)
    for a, b in zip(ours, plain, strict=True):
        np.testing.assert_allclose(a.astype("float32"), b.astype("float32"), rtol=2e-2, atol=2e-2)


def test_left_to_the_cuda_core_schedules():
    """float32 (its schedule unchanged), an architecture before sm_80 and fewer than 16 static
    rows (the split-K GEMV: its weight block is 4 units, and at batch 1 both read the weight
    once while the GEMV spreads K over 256 blocks) are left to the CUDA-core schedules; rows
    that 16 does not divide, symbolic rows and a K that 16 does not divide are padded."""
    tgt = _target.cuda_target()
    fp32 = _gate_kernel(_gate_module(64, 128, 48, "float32", "silu"), tgt)
    assert gtc.schedule(fp32, tgt) is None
    half = _gate_kernel(_gate_module(64, 128, 48, "float16", "silu"), tgt)
    assert gtc.schedule(half, tgt) is not None
    assert gtc.schedule(half, _target.cuda_target("sm_75")) is None
    assert gtc.schedule(_gate_kernel(_gate_module(5, 128, 48, "float16", "silu"), tgt), tgt) is None
    for rows, k in ((19, 128), ("n", 128), (64, 389)):
        padded = _gate_kernel(_gate_module(rows, k, 48, "float16", "silu"), tgt)
        assert gtc.schedule(padded, tgt) is not None, (rows, k)


@needs_nvcc
@pytest.mark.parametrize(
    "rows, k, act, dtype",
    [(77, 100, "silu", "float16"), ("n", 128, "silu", "bfloat16"), (97, 389, "2890", "float16")],
)
def test_padded_kernels_build(rows, k, act, dtype):
    """Odd rows, symbolic rows and a K that 16 does not divide, built for sm_90: mma.sync with
    float32 accumulators, cp.async, no spills, within the register and shared-memory budgets."""
    compiled = engine.compile_module(
        _gate_module(rows, k, 64, dtype, act), _target.cuda_target(), "tvm_fusion"
    )
    (gate,) = [kc for kc in cuda_check.check(compiled) if kc.name.startswith("fused_gates")]
    assert gate.mma_f32 > 0 and gate.cp_async > 0, gate.to_text()
    assert gate.spill_stores == gate.spill_loads == gate.stack == 0, gate.to_text()
    assert gate.registers <= 128 and gate.smem <= 48 * 1024, gate.to_text()


BENCH = {  # name: (rows, K, D, act)
    "gate_2890": (64, 1024, 1024, "2890"),
    "swiglu": (64, 2048, 5632, "silu"),
    "geglu": (64, 2048, 5632, "gelu"),  # gelu's erf inlined into the result block
    "gru_cell": (64, 1024, 1024, "gru"),  # models.gates.gru_cell's weights, 64 rows
}


@needs_nvcc
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(BENCH))
def test_tensor_core_kernels_at_benchmark_size(name, dtype):
    rows, k, d, act = BENCH[name]
    compiled = engine.compile_module(
        _gate_module(rows, k, d, dtype, act), _target.cuda_target(), "tvm_fusion"
    )
    gate_funcs = {
        gv.name_hint: f
        for gv, f in compiled.lowered.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc)
        and f.attrs.get("tvm_fusion.schedule_rule") == "GateFusion"
    }
    assert len(gate_funcs) == 1, list(gate_funcs)  # one kernel per gate group
    (func,) = gate_funcs.values()
    for buf in tir_util.allocated_buffers(func):  # no (rows, gates, D) buffer in global memory
        assert buf.scope() in ("shared", "local", "warp"), buf
    checks = {kc.name: kc for kc in cuda_check.check(compiled)}
    (gate,) = [kc for n, kc in checks.items() if n.startswith(next(iter(gate_funcs)))]
    assert gate.mma_f32 > 0, gate.to_text()  # mma.sync ... .f32.{b,}f16.{b,}f16.f32
    assert gate.cp_async > 0 and gate.barriers >= 2, gate.to_text()
    assert gate.spill_stores == gate.spill_loads == gate.stack == 0, gate.to_text()
    assert gate.registers <= 128 and gate.smem <= 48 * 1024, gate.to_text()
    assert gate.blocks >= gtc.SMS, gate.to_text()
    source = cuda_check.cuda_source(compiled.executable.mod)
    ptx_type = "bf16" if dtype == "bfloat16" else "f16"
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32" in source
    assert "cp.async.cg.shared.global [%0], [%1], %2" in source and "_16_" in source


@pytest.mark.parametrize("dtype", HALF)
def test_half_gate_model_fuses_on_llvm(dtype):
    """A float16 / bfloat16 GLU compiles on llvm, fused (fewer kernels than stock), with stock's
    numbers within half precision."""
    mod = _gate_module(5, 40, 24, dtype, "silu")
    x = (np.random.default_rng(1).standard_normal((5, 40)) * 0.5).astype(_np(dtype))
    outs = {}
    for name in ("stock", "tvm_fusion"):
        compiled = engine.compile_module(mod, _target.host_target(), name)
        outs[name] = (engine.TvmRunner(compiled, [x]).outputs(), compiled)
    (ours,), fused = outs["tvm_fusion"]
    (stock,), unfused = outs["stock"]
    assert analysis.kernel_count(fused.lowered) < analysis.kernel_count(unfused.lowered)
    assert ours.dtype == _np(dtype)
    np.testing.assert_allclose(
        ours.astype("float32"), stock.astype("float32"), rtol=2e-2, atol=2e-2
    )
