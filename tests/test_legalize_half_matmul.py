"""float16 / bfloat16 GEMMs accumulate in float32 (``legalize._matmul_half``), on every target.

- the legalised GEMM sums into a float32 buffer and one cast writes the half-precision result,
  for static, symbolic and batched rows, with fast math or without;
- must not fire: float32 GEMMs, and half-precision GEMMs that already ask for a float32 result
  (``out_dtype``), keep the stock legalisation;
- numbers on llvm at ``K = 2000``: the result is NumPy's float32 product rounded once (within
  one unit in the last place of the dtype); summed in float16 it is off by tens of units.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from helpers import run
from tvm import relax
from tvm.relax import op as R

from tvm_fusion import tir_util
from tvm_fusion.lower.legalize import legalize_map

HALF = ["float16", "bfloat16"]
ULP = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # spacing of [1, 2) in each dtype


def _np(dtype: str):
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def _gemm(rows, k: int, n: int, dtype: str, out_dtype: str | None = None, batch=None):
    """``x @ W^T`` with a constant ``W``; ``rows`` an int or a name (symbolic)."""
    gen = np.random.default_rng(35)
    w = (gen.standard_normal((n, k)) * k**-0.5).astype(_np(dtype))
    m = tvm.tirx.Var(rows, "int64") if isinstance(rows, str) else rows
    x = relax.Var("x", relax.TensorType((m, k) if batch is None else (batch, m, k), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            wt = bb.emit(R.permute_dims(relax.const(w, dtype)))
            gemm = R.matmul(x, wt) if out_dtype is None else R.matmul(x, wt, out_dtype=out_dtype)
            out = bb.emit_output(gemm)
        bb.emit_func_output(out)
    return bb.get(), w


def _legalized(mod, fast_math: bool):
    with tvm.target.Target("llvm"):
        return relax.transform.LegalizeOps(legalize_map(fast_math))(mod)


@pytest.mark.parametrize("fast_math", [False, True])
@pytest.mark.parametrize(
    "rows, batch, dtype", [(8, None, "float16"), ("n", None, "bfloat16"), ("n", 3, "float16")]
)
def test_half_gemm_sums_in_float32(rows, batch, dtype, fast_math):
    mod, _ = _gemm(rows, 64, 24, dtype, batch=batch)
    lowered = _legalized(mod, fast_math)
    gemm = [
        f
        for gv, f in lowered.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint.startswith("matmul")
    ]
    (func,) = gemm
    (block,) = [b for b in tir_util.blocks(func) if len(b.iter_vars) > len(b.writes[0].region)]
    assert str(block.writes[0].source.dtype) == "float32"
    assert {str(r.source.dtype) for r in block.reads} == {dtype}
    out = lowered["main"].ret_ty
    assert str(out.dtype) == dtype  # the result keeps the model's dtype (one cast)


@pytest.mark.parametrize("dtype, out_dtype", [("float32", None), ("float16", "float32")])
def test_must_not_fire(dtype, out_dtype):
    """float32, and a half GEMM already summed into float32: the stock legalisation."""
    mod, _ = _gemm(8, 64, 24, dtype, out_dtype=out_dtype)
    with tvm.target.Target("llvm"):
        stock = relax.transform.LegalizeOps()(mod)
    tvm.ir.assert_structural_equal(_legalized(mod, fast_math=False), stock)


@pytest.mark.parametrize("rows, dtype", [(7, "float16"), (7, "bfloat16"), ("n", "float16")])
def test_numbers_on_llvm_are_float32_sums_rounded_once(rows, dtype):
    k, n, run_rows = 2000, 24, 7
    mod, w = _gemm(rows, k, n, dtype)
    x = np.random.default_rng(1).standard_normal((run_rows, k)).astype(_np(dtype))
    (out,), _ = run(mod, [x], "tvm_fusion")
    assert out.dtype == _np(dtype)
    want = x.astype("float32") @ w.astype("float32").T
    rounded = want.astype(_np(dtype)).astype("float32")
    # float32 sums differ from NumPy's in the last bits only: the rounded result, or its
    # neighbour where the sum sits at a rounding boundary
    np.testing.assert_allclose(out.astype("float32"), rounded, rtol=ULP[dtype], atol=1e-6)
