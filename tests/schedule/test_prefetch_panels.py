"""PrefetchPanels (issue #37): a GEMM over a large prepacked weight fetches the next panel of B
while it computes the current one, each row tile its share of the panel's cache lines.

Arithmetic of the k groups; structural (a marked loop nest in TVMScript, Before/Expected); the
pipeline on the five CPU targets (64 x 768 @ 768 x 3072: prefetches, no mark left, codegen);
must not fire (a 2.25 MiB weight, symbolic rows, a prime K); numbers on the host build against
NumPy, rows and columns that the tiles do not divide included."""

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.ir.expr import Call
from tvm.relax import op as R
from tvm.script import tirx as T

from tvm_fusion import host_target, tir_util
from tvm_fusion.build import engine
from tvm_fusion.build.pipeline import build_pipeline
from tvm_fusion.schedule.cpu import prefetch


def _gemm(m, k: int, n: int, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((k, n)).astype("float32") * k**-0.5
    rows = tirx.Var("m", "int64") if isinstance(m, str) else m
    x = relax.Var("x", relax.TensorType((rows, k), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(R.matmul(x, relax.const(w)))
        bb.emit_func_output(gv)
    return bb.get(), w


def _is_prefetch(stmt) -> bool:
    return (
        isinstance(stmt, tirx.Evaluate)
        and isinstance(stmt.value, Call)
        and stmt.value.op.same_as(tvm.ir.Op.get("tirx.prefetch"))
    )


def _kernels(mod) -> list:
    return [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]


def _count(funcs, pred) -> int:
    return sum(pred(s) for f in funcs for s in tir_util.iter_stmts(f.body))


def _marked(stmt) -> bool:
    return isinstance(stmt, tirx.For) and any(
        key in stmt.annotations for key in (prefetch.PLAN_ATTR, prefetch.ROWS_ATTR)
    )


def test_groups_cover_the_next_panel():
    mib = 1 << 20
    # AVX2's 4 x 24 tile, 64 rows: 1152 lines a panel, 72 per row tile, one per 8 steps of k
    assert prefetch.prefetch_group(768, 16, 24, 4, 9 * mib) == (8, 72)
    # many row tiles: a few lines each, one prefetch per 64 steps
    assert prefetch.prefetch_group(768, 128, 24, 4, 9 * mib) == (64, 9)
    # 4 row tiles would need one prefetch every 2.7 steps: declined
    assert prefetch.prefetch_group(768, 4, 24, 4, 9 * mib) is None
    assert prefetch.prefetch_group(768, 16, 24, 4, 2 * mib) is None  # B in L2 / L3
    assert prefetch.prefetch_group(1021, 34, 24, 4, 9 * mib) is None  # no group divides K
    assert prefetch.prefetch_group(768, tirx.Var("t", "int64"), 24, 4, 9 * mib) is None


@T.prim_func(private=True, s_tir=True)
def marked(
    x: T.Buffer((8, 16), "float32"),
    B: T.Buffer((2, 16, 8), "float32"),
    y: T.Buffer((8, 16), "float32"),
):
    for p in T.parallel(2):
        for rt in T.serial(2, annotations={"tvm_fusion.prefetch_rows": 1}):
            for ko in T.serial(4, annotations={"tvm_fusion.prefetch_panel": [2, 16, 8, 4]}):
                for ki, i, j in T.grid(4, 4, 8):
                    with T.sblock("update"):
                        vi = T.axis.spatial(8, rt * 4 + i)
                        vj = T.axis.spatial(16, p * 8 + j)
                        vk = T.axis.reduce(16, ko * 4 + ki)
                        y[vi, vj] = y[vi, vj] + x[vi, vk] * B[vj // 8, vk, vj % 8]


@T.prim_func(private=True, s_tir=True)
def marked_expected(
    x: T.Buffer((8, 16), "float32"),
    B: T.Buffer((2, 16, 8), "float32"),
    y: T.Buffer((8, 16), "float32"),
):
    for p in T.parallel(2):
        for rt in range(2):
            for ko in range(4):
                # 8 lines of 16 floats a panel, 4 per row tile; the last panel fetches itself
                T.evaluate(
                    T.call_intrin(
                        "void",
                        "tirx.prefetch",
                        T.address_of(
                            B[
                                T.min(p + 1, 1),
                                T.min(rt * 4 + ko, 7) * 16 // 8,
                                T.min(rt * 4 + ko, 7) * 16 % 8,
                            ]
                        ),
                        0,
                        2,
                        1,
                    )
                )
                for ki, i, j in T.grid(4, 4, 8):
                    with T.sblock("update"):
                        vi = T.axis.spatial(8, rt * 4 + i)
                        vj = T.axis.spatial(16, p * 8 + j)
                        vk = T.axis.reduce(16, ko * 4 + ki)
                        y[vi, vj] = y[vi, vj] + x[vi, vk] * B[vj // 8, vk, vj % 8]


@T.prim_func(private=True, s_tir=True)
def unrelated_b(
    x: T.Buffer((8, 16), "float32"),
    B: T.Buffer((2, 16, 4), "float32"),
    y: T.Buffer((8, 16), "float32"),
):
    # the mark names a (2, 16, 8) B that the block does not read: marks removed, nothing added
    for p in T.parallel(2):
        for rt in T.serial(2, annotations={"tvm_fusion.prefetch_rows": 1}):
            for ko in T.serial(4, annotations={"tvm_fusion.prefetch_panel": [2, 16, 8, 4]}):
                for ki, i, j in T.grid(4, 4, 8):
                    with T.sblock("update"):
                        vi = T.axis.spatial(8, rt * 4 + i)
                        vj = T.axis.spatial(16, p * 8 + j)
                        vk = T.axis.reduce(16, ko * 4 + ki)
                        y[vi, vj] = y[vi, vj] + x[vi, vk] * B[vj // 8, vk, vj % 4]


@T.prim_func(private=True, s_tir=True)
def unrelated_b_expected(
    x: T.Buffer((8, 16), "float32"),
    B: T.Buffer((2, 16, 4), "float32"),
    y: T.Buffer((8, 16), "float32"),
):
    for p in T.parallel(2):
        for rt, ko, ki, i, j in T.grid(2, 4, 4, 4, 8):
            with T.sblock("update"):
                vi = T.axis.spatial(8, rt * 4 + i)
                vj = T.axis.spatial(16, p * 8 + j)
                vk = T.axis.reduce(16, ko * 4 + ki)
                y[vi, vj] = y[vi, vj] + x[vi, vk] * B[vj // 8, vk, vj % 4]


def test_structural():
    tvm.ir.assert_structural_equal(prefetch.insert_prefetches(marked), marked_expected)
    tvm.ir.assert_structural_equal(prefetch.insert_prefetches(unrelated_b), unrelated_b_expected)


def test_pipeline_on_every_target(cpu_target):
    """64 x 768 @ 768 x 3072 (9 MiB of weights): one prefetch in the GEMM's k groups, no mark
    left in any kernel, and the kernel builds for the target."""
    mod, _ = _gemm(64, 768, 3072)
    with cpu_target:
        lowered = build_pipeline(cpu_target)(mod)
    kernels = _kernels(lowered)
    assert _count(kernels, _is_prefetch) == 1
    assert _count(kernels, _marked) == 0
    gemm = next(f for f in kernels if _count([f], _is_prefetch))
    tvm.compile(tvm.IRModule({"gemm": gemm.with_attr("global_symbol", "gemm")}), cpu_target)


@pytest.mark.parametrize(
    "m, k, n",
    [(64, 768, 768), ("m", 768, 3072), (64, 1021, 3072)],
    ids=["weight_2MiB", "symbolic_rows", "prime_k"],
)
def test_must_not_fire(m, k, n):
    mod, _ = _gemm(m, k, n)
    target = host_target()
    with target:
        kernels = _kernels(build_pipeline(target)(mod))
    assert _count(kernels, _is_prefetch) == 0
    assert _count(kernels, _marked) == 0


@pytest.mark.parametrize("m, k, n", [(64, 768, 3072), (52, 1000, 3000), (61, 768, 2100)])
def test_numbers(m, k, n):
    mod, w = _gemm(m, k, n, seed=m)
    compiled = engine.compile_module(mod, host_target(), "tvm_fusion")
    assert _count(_kernels(compiled.lowered), _is_prefetch) == 1
    x = np.random.default_rng(1).standard_normal((m, k)).astype("float32")
    got = engine.TvmRunner(compiled, [x]).outputs()[0]
    np.testing.assert_allclose(got, x @ w, rtol=1e-4, atol=1e-4)
