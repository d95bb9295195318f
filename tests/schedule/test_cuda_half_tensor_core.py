"""HalfTensorCore: float16 GEMMs summed in float32 with an extent <= 64 on tensor cores (dlight's
``MatmulTensorization``), checked without a GPU.

- where it fires: attention's two GEMMs at head size 64 (``Q K^T``: K = 64; ``P V``: J = 64),
  batched, padded (77 x 77 x 64) and symbolic (the sequence length); the kernel it emits is
  tensorized (``wmma`` fragments) and, with ``tensorize`` turned into a no-op, runs serially on
  llvm with the numbers of the unscheduled kernel (same tiles, padding, layouts; ``tensorize``
  itself checks that each block it replaces is the intrinsic's description);
- where it must not: float32, bfloat16, a float16 sum, sm_60, every extent above 64 (dlight
  tensorizes those), padding beyond ``MAX_PADDING`` (J = 48, one row), not a GEMM;
- built for sm_90 through the whole pipeline (nvcc, skipped without it): float16 attention's
  two GEMM kernels by this rule, ``wmma.mma.sync`` in the PTX, no spills.
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import tvm
from helpers import attention_module, run_kernel
from tvm import te
from tvm.s_tir import Schedule

from tvm_fusion import target as _target
from tvm_fusion import tir_util
from tvm_fusion.build import engine, pipeline
from tvm_fusion.schedule import RULE_ATTR, default_rules
from tvm_fusion.schedule.cuda.half_tensor_core import HalfTensorCore, refusal
from tvm_fusion.tools import cuda_check

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


def _gemm(i, j, k, dtype="float16", acc="float32", batch=None, nt=True) -> tvm.tirx.PrimFunc:
    """``C[b, i, j] = cast(sum_k A[b, i, k] * B[b, j, k])`` (``nt``) or ``B[b, k, j]``, the sum in
    ``acc`` and the result cast back to ``dtype``, as ``legalize`` writes a half matmul; ``i``
    may be a name (symbolic)."""
    n, j, k = (tvm.tirx.Var(e, "int64") if isinstance(e, str) else _i64(e) for e in (i, j, k))
    lead = (_i64(batch),) if batch else ()
    a = te.placeholder((*lead, n, k), dtype, name="a")
    b = te.placeholder((*lead, j, k) if nt else (*lead, k, j), dtype, name="b")
    r = te.reduce_axis((0, k), name="r")

    def body(*idx):
        *bi, ii, jj = idx
        bv = b[(*bi, jj, r)] if nt else b[(*bi, r, jj)]
        return te.sum(a[(*bi, ii, r)].astype(acc) * bv.astype(acc), axis=r)

    c = te.compute((*lead, n, j), body, name="c")
    out = te.compute(c.shape, lambda *idx: c(*idx).astype(dtype), name="out")
    return te.create_prim_func([a, b, out] if acc != dtype else [a, b, c])


def _i64(value: int):
    return tvm.tirx.IntImm("int64", value)


FIRES = {
    "qk_k64": lambda: _gemm(2048, 2048, 64, batch=8),
    "pv_j64": lambda: _gemm(2048, 64, 2048, batch=8, nt=False),
    "padded_77x77x64": lambda: _gemm(77, 77, 64, batch=2),
    "symbolic_rows_k64": lambda: _gemm("n", 256, 64),
    "k32": lambda: _gemm(512, 512, 32),
}


@pytest.mark.parametrize("case", list(FIRES))
def test_fires_and_tensorizes(case):
    func = FIRES[case]()
    tgt = _target.cuda_target()
    assert refusal(func, tgt) is None
    sch = HalfTensorCore().apply(func, tgt, False)
    assert sch is not None
    scopes = {b.scope() for b in tir_util.allocated_buffers(sch.mod["main"])}
    assert {"wmma.matrix_a", "wmma.matrix_b", "wmma.accumulator"} <= scopes, scopes


MUST_NOT_FIRE = {
    "float32": (lambda: _gemm(256, 256, 64, "float32", "float32"), "float16"),
    "bfloat16": (lambda: _gemm(256, 256, 64, "bfloat16"), "float16"),
    "float16 sum": (lambda: _gemm(256, 256, 64, "float16", "float16"), "float32"),
    "every extent > 64": (lambda: _gemm(256, 256, 128), "dlight"),
    "J = 16 pads 8x": (lambda: _gemm(256, 16, 256), "padding"),
    "one row": (lambda: _gemm(1, 256, 64), "GEMM"),
    "not a GEMM": (lambda: _elementwise(), "reduction"),
}


def _elementwise() -> tvm.tirx.PrimFunc:
    a = te.placeholder((64, 64), "float16", name="a")
    return te.create_prim_func([a, te.compute((64, 64), lambda i, j: a[i, j] * 2, name="b")])


@pytest.mark.parametrize("case", list(MUST_NOT_FIRE))
def test_must_not_fire(case):
    build, why = MUST_NOT_FIRE[case]
    func = build()
    tgt = _target.cuda_target()
    assert why in refusal(func, tgt)
    assert HalfTensorCore().apply(func, tgt, False) is None
    assert HalfTensorCore().apply(func, _target.host_target(), False) is None


def test_no_wmma_before_sm70():
    func = FIRES["qk_k64"]()
    assert "sm_70" in refusal(func, _target.cuda_target("sm_60"))
    assert refusal(func, _target.cuda_target("sm_75")) is None


def test_rule_sits_before_dlight_matmul():
    names = [type(r).__name__ for r in default_rules(_target.cuda_target())]
    # after SkinnyMatmul, which splits K where 128 x 128 tiles would leave SMs idle
    assert names.index("SkinnyMatmul") < names.index("HalfTensorCore") < names.index("Matmul")


def _untensorized(func, tgt) -> tvm.tirx.PrimFunc:
    """The rule's schedule with ``tensorize`` a no-op, its threads serial and its buffers
    global: what the tensorized kernel computes, runnable on llvm."""
    real = Schedule.tensorize
    Schedule.tensorize = lambda self, *args, **kwargs: None
    try:
        sch = HalfTensorCore().apply(func, tgt, False)
    finally:
        Schedule.tensorize = real
    text = sch.mod["main"].script()
    text = re.sub(r'T\.thread_binding\((.+?), thread="[^"]+"\)', r"T.serial(\1)", text)
    text = re.sub(r'"software_pipeline_\w+": \[[^\]]*\](, )?', "", text)
    text = re.sub(
        r'"(tirx\.manifest_shared_memory_local_stage|double_buffer_scope)": \d+(, )?', "", text
    )
    text = re.sub(r'scope="(shared\.dyn|wmma\.\w+)"', 'scope="global"', text)
    parsed = tvm.script.from_source(text)
    return parsed if isinstance(parsed, tvm.tirx.PrimFunc) else parsed["main"]


@pytest.mark.parametrize(
    "case, rows",
    [("padded_77x77x64", 77), ("symbolic_rows_k64", 37), ("pv_small", None)],
)
def test_schedule_computes_the_same(case, rows):
    func = _gemm(100, 64, 200, batch=2, nt=False) if case == "pv_small" else FIRES[case]()
    scheduled = _untensorized(func, _target.cuda_target())
    rng = np.random.default_rng(0)
    args = []
    for param in func.params:
        shape = [int(d) if isinstance(d, tvm.tirx.IntImm) else rows for d in param.shape]
        args.append(rng.standard_normal(shape).astype(param.dtype))
    ours = run_kernel(scheduled, args)
    plain = run_kernel(func, args)
    # float32 sums in another order, rounded to float16: a unit of the last place apart at most
    np.testing.assert_allclose(ours[-1], plain[-1], rtol=2e-3, atol=2e-3)


def test_attention_gemms_scheduled_by_the_rule():
    tgt = _target.cuda_target()
    with tgt:
        lowered = tvm.transform.Sequential(pipeline.fused_passes(tgt))(attention_module(515))
        lowered = tvm.transform.Sequential(pipeline.schedule_passes(tgt))(lowered)
    rules = {
        gv.name_hint: f.attrs.get(RULE_ATTR)
        for gv, f in lowered.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint
    }
    assert len(rules) == 2 and set(rules.values()) == {"HalfTensorCore"}, rules


@needs_nvcc
def test_attention_builds_for_sm90():
    compiled = engine.compile_module(attention_module(2048), _target.cuda_target("sm_90"))
    checks = {c.name: c for c in cuda_check.check(compiled)}
    gemms = [c for name, c in checks.items() if "matmul" in name]
    assert len(gemms) == 2, sorted(checks)
    for c in gemms:
        assert c.spill_stores == 0 and c.spill_loads == 0 and c.stack == 0, c
    ptx = cuda_check.compile_source(cuda_check.cuda_source(compiled.executable.mod), "sm_90")[0]
    assert "wmma.mma.sync" in ptx
