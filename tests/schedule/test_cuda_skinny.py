"""The CUDA skinny-GEMM rule (split-K), checked without a GPU (issue #26, item 3).

- it fires where dlight's gpu Matmul leaves SMs idle (64 x 2048 x 5632: 64 blocks) and not
  where dlight fills them (512 rows), nor where ``K`` is too short to split, nor on batched
  GEMMs, a weight read as ``B[j, k]``, a half-precision GEMM summed in half precision, a
  float64 one, nor one float32 row (dlight's reduction rules keep it);
- the schedule computes what the unscheduled kernel computes: at extents the tiles do not
  divide (13 rows, 97 columns, K = 1300: rows and K padded), with an epilogue (bias, relu)
  after the sum of the partials, and for symbolic rows, in float32 and (float32 partial sums
  of) float16 / bfloat16 operands, one row of those too (the GEMV tile); checked on llvm with
  the thread loops run one after the other;
- the SwiGLU down projection at its benchmark size, built for sm_90 with nvcc (skipped without
  it): the partial-sums kernel has >= 132 blocks, 16-byte ``cp.async`` copies into shared
  memory, ``bar.sync``, no spills within 128 registers and 48 KB of shared memory; in float16
  and bfloat16 at 64 rows and at batch 1 (1 x 2048 x 5632) too.
"""

from __future__ import annotations

import shutil

import ml_dtypes
import numpy as np
import pytest
import tvm
from helpers import run_kernel, sequential
from tvm import relax
from tvm.relax import op as R

from tvm_fusion import analysis, models, tir_util
from tvm_fusion import target as _target
from tvm_fusion.build import engine, pipeline
from tvm_fusion.schedule import default_rules
from tvm_fusion.schedule.cuda import SkinnyMatmul
from tvm_fusion.schedule.cuda.gate_fusion import SMEM_BUDGET, SMS
from tvm_fusion.schedule.cuda.skinny_matmul import choose_tile, dlight_blocks, smem_bytes
from tvm_fusion.tools import cuda_check

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
HALF = ["float16", "bfloat16"]
ULP = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}  # spacing in [1, 2)


def _np(dtype: str):
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def _linear(rows, k, n, *, weight_param=False, epilogue=False, dtype="float32", batch=None):
    """``x @ W^T`` (+ bias, relu), W a constant (transposed at compile time to ``[K, N]``) or
    a parameter (read as ``[N, K]``)."""
    gen = np.random.default_rng(3)
    w = (gen.standard_normal((n, k)) * k**-0.5).astype(_np(dtype))
    b = gen.standard_normal(n).astype(_np(dtype))
    dims = (rows, k) if batch is None else (batch, rows, k)
    x = relax.Var("x", relax.TensorType(dims, dtype))
    params = [x]
    if weight_param:
        wv = relax.Var("w", relax.TensorType((n, k), dtype))
        params.append(wv)
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            weight = params[1] if weight_param else relax.const(w, dtype)
            y = bb.emit(R.matmul(x, bb.emit(R.permute_dims(weight))))
            if epilogue:
                y = bb.emit(R.nn.relu(bb.emit(R.add(y, relax.const(b, dtype)))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _kernel(mod: tvm.IRModule, tgt) -> tvm.tirx.PrimFunc:
    with tgt:
        fused = tvm.transform.Sequential(pipeline.fused_passes(tgt))(mod)
    (func,) = [
        f
        for _, f in fused.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc)
        and any(iv.iter_type == iv.CommReduce for b in tir_util.blocks(f) for iv in b.iter_vars)
    ]
    return func


def test_rule_sits_before_dlight_matmul():
    names = [type(r).__name__ for r in default_rules(_target.cuda_target())]
    assert names.index("SkinnyMatmul") < names.index("Matmul")


@pytest.mark.parametrize(
    "rows, cols, k, elem",
    [
        (64, 2048, 5632, 4),
        (1, 4096, 1024, 4),
        (13, 97, 1300, 4),
        (100, 512, 4096, 4),
        (64, 2048, 5632, 2),
        (1, 2048, 5632, 2),
        (13, 97, 1300, 2),
    ],
)
def test_tile_fills_the_sms_within_budget(rows, cols, k, elem):
    assert dlight_blocks(rows, cols) < SMS
    tile = choose_tile(rows, cols, k, elem)
    blocks = -(-rows // tile.bm) * -(-cols // tile.bn) * tile.split
    assert smem_bytes(tile, elem) <= SMEM_BUDGET and tile.threads <= 256
    assert tile.bk * elem == 128  # 128 bytes of each row per reduction step
    assert tile.split >= 2 and -(-k // tile.split) >= 256
    if k >= 256 * -(-SMS // (-(-rows // tile.bm) * -(-cols // tile.bn))):
        assert blocks >= SMS, tile  # K is long enough for as many slices as the SMs need


def _te_kernel(dtype: str = "float32", nt: bool = False) -> tvm.tirx.PrimFunc:
    """``C[i, j] += A[i, k] * B[k, j]`` summed in ``dtype``, or with ``nt`` ``B[j, k]`` (a
    weight read untransposed)."""
    from tvm import te

    a = te.placeholder((64, 1024), dtype, name="a")
    b = te.placeholder((2048, 1024) if nt else (1024, 2048), dtype, name="b")
    k = te.reduce_axis((0, 1024), name="k")
    at = (lambda j: b[j, k]) if nt else (lambda j: b[k, j])
    c = te.compute((64, 2048), lambda i, j: te.sum(a[i, k] * at(j), axis=k), name="c")
    return te.create_prim_func([a, b, c])


MUST_NOT_FIRE = {
    "dlight fills the SMs": lambda: _linear(512, 1024, 2048),
    "K too short to split": lambda: _linear(64, 384, 2048),
    "batched GEMM": lambda: _linear(4, 2048, 512, batch=2, weight_param=True),
    "float16 summed in float16": lambda: _te_kernel("float16"),
    "float64": lambda: _te_kernel("float64"),
    "one float32 row": lambda: _linear(1, 5632, 2048),
    "B[j, k]": lambda: _te_kernel(nt=True),
}


@pytest.mark.parametrize("case", list(MUST_NOT_FIRE))
def test_must_not_fire(case):
    tgt = _target.cuda_target()
    built = MUST_NOT_FIRE[case]()
    func = built if isinstance(built, tvm.tirx.PrimFunc) else _kernel(built, tgt)
    assert SkinnyMatmul().apply(func, tgt, False) is None
    assert SkinnyMatmul().apply(func, _target.host_target(), False) is None


def _symbolic(k, n, dtype="float32"):
    rows = tvm.tirx.Var("n", "int64")
    return _linear(rows, k, n, epilogue=True, dtype=dtype)


CASES = {  # name: (module, rows to run a symbolic kernel at)
    "13x97x1300_const": (lambda: _linear(13, 1300, 97), None),
    "13x97x1300_epilogue": (lambda: _linear(13, 1300, 97, epilogue=True), None),
    "32x128x2048_divides": (lambda: _linear(32, 2048, 128), None),
    "nx97x2100_epilogue": (lambda: _symbolic(2100, 97), 21),
    "13x97x1300_f16": (lambda: _linear(13, 1300, 97, dtype="float16"), None),
    "13x97x1300_epilogue_bf16": (
        lambda: _linear(13, 1300, 97, epilogue=True, dtype="bfloat16"),
        None,
    ),
    "nx97x2100_epilogue_f16": (lambda: _symbolic(2100, 97, "float16"), 21),
    "1x97x1300_epilogue_bf16": (
        lambda: _linear(1, 1300, 97, epilogue=True, dtype="bfloat16"),
        None,
    ),
    "1x200x2048_f16": (lambda: _linear(1, 2048, 200, dtype="float16"), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_schedule_computes_the_same(case):
    build, rows = CASES[case]
    tgt = _target.cuda_target()
    func = _kernel(build(), tgt)
    sch = SkinnyMatmul().apply(func, tgt, False)
    assert sch is not None
    scheduled = sch.mod["main"]
    scopes = {b.scope() for b in tir_util.allocated_buffers(scheduled)}
    assert {"shared", "local", "global"} <= scopes, scopes  # staging, registers, partials
    assert "software_pipeline_stage" in scheduled.script()
    rng = np.random.default_rng(0)
    args = []
    for param in func.params:
        shape = [int(d) if isinstance(d, tvm.tirx.IntImm) else rows for d in param.shape]
        args.append(rng.standard_normal(shape).astype(_np(str(param.dtype))))
    dtype = str(func.params[-1].dtype)
    if dtype != "float32":  # the partial sums: float32, in registers and the workspace
        partials = [b for b in tir_util.allocated_buffers(scheduled) if "rf" in b.name]
        assert partials and all(str(b.dtype) == "float32" for b in partials), partials
    ours = run_kernel(sequential(scheduled), args)
    plain = run_kernel(func, args)
    # float32 sums in another order; rounded to half precision, one unit apart at most
    tol = max(1e-4, ULP[dtype])
    for a, b in zip(ours, plain, strict=True):
        np.testing.assert_allclose(a.astype("float32"), b.astype("float32"), rtol=tol, atol=tol)


def _checked_split_k(compiled):
    """The partial-sum and total kernels of the one SkinnyMatmul GEMM of ``compiled``, checked
    against the budgets: no spills, <= 128 registers, <= 48 KB shared, >= SMS partial blocks
    staging through shared memory (``cp.async``, barriers)."""
    rules = {info.name: info.rule for info in analysis.schedule_info(compiled.lowered)}
    (gemm,) = [name for name, rule in rules.items() if rule == "SkinnyMatmul"]
    checks = {k.name: k for k in cuda_check.check(compiled)}
    partials, total = checks[f"{gemm}_kernel"], checks[f"{gemm}_kernel_1"]
    for kc in (partials, total):
        assert kc.spill_stores == kc.spill_loads == 0, kc.to_text()
        assert kc.registers <= 128 and kc.smem <= 48 * 1024, kc.to_text()
    assert partials.blocks >= SMS, partials.to_text()
    assert partials.cp_async > 0 and partials.shared_loads > 0, partials.to_text()
    assert partials.barriers > 0, partials.to_text()
    return partials, total


@needs_nvcc
def test_swiglu_down_projection_at_benchmark_size():
    """64 x 2048 x 5632: dlight's 64 blocks become 256 blocks of partial sums (K in 8 slices
    of 704), summed by a second kernel."""
    compiled = engine.compile_module(
        models.build("swiglu", "seed").mod, _target.cuda_target(), "tvm_fusion"
    )
    partials, total = _checked_split_k(compiled)
    assert total.blocks * total.threads >= 64 * 2048, total.to_text()  # a thread per result


@needs_nvcc
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows", [64, 1])
def test_half_down_projection_at_benchmark_size(rows, dtype):
    """``rows x 2048 x 5632`` in float16 / bfloat16 (the down projection at 64 rows, and batch-1
    decode): 256 blocks of float32 partial sums (``K`` in 8 slices of 704, 64-half steps), the
    operands staged with 16-byte ``cp.async`` (``cp.async.cg``: 8 halves)."""
    compiled = engine.compile_module(
        _linear(rows, 5632, 2048, dtype=dtype), _target.cuda_target(), "tvm_fusion"
    )
    partials, total = _checked_split_k(compiled)
    assert "cp.async.cg.shared.global" in cuda_check.cuda_source(compiled.executable.mod)
    assert total.blocks * total.threads >= rows * 2048, total.to_text()
