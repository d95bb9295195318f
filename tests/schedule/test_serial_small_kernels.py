"""SerialSmallKernels (issue #37): a CPU kernel with less work than the threshold runs on the
calling thread; with symbolic extents the choice is made at run time.

Structural: a symbolic parallel nest gets ``if work < threshold`` with a serial copy whose
buffers are bound by ``match_buffer`` (Expected in TVMScript); a scalar parameter is bound too;
a static nest under the threshold becomes serial. Must not fire: a static nest at or over the
threshold, a kernel without parallel loops, an extent that reads a loop variable, a kernel whose
serial path no positive extent reaches. Numbers: both paths of a symbolic kernel through the
whole pipeline and of a kernel with a scalar parameter, against NumPy.
"""

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.script import relax as R
from tvm.script import tirx as T

import tvm_fusion
from tvm_fusion import tir_util
from tvm_fusion.schedule.serial_small_kernels import ATTR, serialize_small


def _parallel_loops(func) -> list:
    return [
        s
        for s in tir_util.iter_stmts(func.body)
        if isinstance(s, tirx.For) and s.kind == tirx.ForKind.PARALLEL
    ]


@T.prim_func(private=True, s_tir=True)
def symbolic(x: T.handle, y: T.handle):
    m = T.int64()
    X = T.match_buffer(x, (m, T.int64(8)), "float32")
    Y = T.match_buffer(y, (m, T.int64(8)), "float32")
    for i in T.parallel(m):
        for j in range(T.int64(8)):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                Y[vi, vj] = X[vi, vj] + T.float32(1)


@T.prim_func(private=True, s_tir=True)
def symbolic_expected(x: T.handle, y: T.handle):
    T.func_attr({"tvm_fusion.serial_below": 4096})
    m = T.int64()
    X = T.match_buffer(x, (m, T.int64(8)), "float32")
    Y = T.match_buffer(y, (m, T.int64(8)), "float32")
    serial = T.sblock_alloc_buffer((1,), "int32", scope="local")
    serial[0] = T.Cast("int32", m * T.int64(8) < T.int64(4096))
    if serial[0] != 0:
        m_1: T.let[T.int64] = m
        with T.sblock("serial"):
            T.reads()
            T.writes()
            X_1 = T.match_buffer(X[0:m_1, 0 : T.int64(8)], (m_1, T.int64(8)))
            Y_1 = T.match_buffer(Y[0:m_1, 0 : T.int64(8)], (m_1, T.int64(8)))
            with T.sblock("root"):
                T.reads()
                T.writes()
                for i, j in T.grid(m_1, T.int64(8)):
                    with T.sblock("add"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        Y_1[vi, vj] = X_1[vi, vj] + T.float32(1)
    else:
        with T.sblock("root"):
            T.reads()
            T.writes()
            for i in T.parallel(m):
                for j in range(T.int64(8)):
                    with T.sblock("add"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        Y[vi, vj] = X[vi, vj] + T.float32(1)


def test_symbolic_nest_gets_a_serial_path():
    tvm.ir.assert_structural_equal(serialize_small(symbolic), symbolic_expected)


@T.prim_func(private=True, s_tir=True)
def static_small(X: T.Buffer((16, 8), "float32"), Y: T.Buffer((16, 8), "float32")):
    for i in T.parallel(16):
        for j in range(8):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                Y[vi, vj] = X[vi, vj] + T.float32(1)


@T.prim_func(private=True, s_tir=True)
def static_small_expected(X: T.Buffer((16, 8), "float32"), Y: T.Buffer((16, 8), "float32")):
    for i, j in T.grid(16, 8):
        with T.sblock("add"):
            vi, vj = T.axis.remap("SS", [i, j])
            Y[vi, vj] = X[vi, vj] + T.float32(1)


def test_static_nest_under_the_threshold_is_serial():
    tvm.ir.assert_structural_equal(serialize_small(static_small), static_small_expected)
    assert _parallel_loops(serialize_small(static_small, threshold=128)) != []


@T.prim_func(private=True, s_tir=True)
def static_large(X: T.Buffer((1024, 8), "float32"), Y: T.Buffer((1024, 8), "float32")):
    for i in T.parallel(1024):
        for j in range(8):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                Y[vi, vj] = X[vi, vj] + T.float32(1)


@T.prim_func(private=True, s_tir=True)
def no_parallel(x: T.handle, y: T.handle):
    m = T.int64()
    X = T.match_buffer(x, (m, T.int64(8)), "float32")
    Y = T.match_buffer(y, (m, T.int64(8)), "float32")
    for i, j in T.grid(m, T.int64(8)):
        with T.sblock("add"):
            vi, vj = T.axis.remap("SS", [i, j])
            Y[vi, vj] = X[vi, vj] + T.float32(1)


@T.prim_func(private=True, s_tir=True)
def triangular(x: T.handle, y: T.handle):
    m = T.int64()
    X = T.match_buffer(x, (m, m), "float32")
    Y = T.match_buffer(y, (m, m), "float32")
    for i in T.parallel(m):
        for j in range(i):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                Y[vi, vj] = X[vi, vj] + T.float32(1)


@T.prim_func(private=True, s_tir=True)
def wide_rows(x: T.handle, y: T.handle):
    m = T.int64()
    X = T.match_buffer(x, (m, T.int64(8192)), "float32")
    Y = T.match_buffer(y, (m, T.int64(8192)), "float32")
    for i in T.parallel(m):
        for j in range(T.int64(8192)):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                Y[vi, vj] = X[vi, vj] + T.float32(1)


@pytest.mark.parametrize(
    "func",
    [static_large, no_parallel, triangular, wide_rows],
    ids=["static_large", "no_parallel", "triangular", "wide_rows"],
)
def test_must_not_fire(func):
    assert serialize_small(func).same_as(func)


@T.prim_func(private=True, s_tir=True)
def scalar_param(x: T.handle, y: T.handle, n: T.int64):
    m = T.int64()
    X = T.match_buffer(x, (m,), "float32")
    Y = T.match_buffer(y, (m,), "float32")
    for i in T.parallel(n):
        with T.sblock("add"):
            vi = T.axis.spatial(m, i)
            Y[vi] = X[vi] * T.float32(2)


def test_scalar_parameter_bound_on_both_paths():
    func = serialize_small(scalar_param)
    assert func.attrs[ATTR] == 4096
    assert len(_parallel_loops(func)) == 1
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    for m in (3, 5000):
        x = np.arange(m, dtype="float32")
        y = tvm.runtime.tensor(np.zeros(m, "float32"))
        lib["main"](tvm.runtime.tensor(x), y, m - 1)
        np.testing.assert_array_equal(y.numpy()[: m - 1], 2 * x[: m - 1])
        assert y.numpy()[m - 1] == 0


@tvm.script.ir_module
class MatmulSoftmax:
    @R.function
    def main(
        x: R.Tensor(("m", 64), "float32"),
        w: R.Tensor((64, 48), "float32"),
        b: R.Tensor((48,), "float32"),
    ):
        with R.dataflow():
            y = R.nn.relu(R.add(R.matmul(x, w), b))
            z = R.nn.softmax(y, axis=-1)
            R.output(z)
        return z


def test_pipeline_runs_both_paths():
    target = tvm_fusion.host_target()
    with target:
        lowered = tvm_fusion.build_pipeline(target)(MatmulSoftmax)
    marked = [
        gv.name_hint
        for gv, f in lowered.functions_items()
        if isinstance(f, tirx.PrimFunc) and ATTR in (f.attrs or {})
    ]
    assert any("softmax" in name for name in marked), marked
    vm = relax.VirtualMachine(
        tvm.compile(MatmulSoftmax, target=target, relax_pipeline="tvm_fusion"), tvm.cpu()
    )
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 48)).astype("float32")
    b = rng.standard_normal(48).astype("float32")
    for m in (1, 3, 100, 600):  # the softmax's serial path up to 4096 / (48 * ...) rows
        x = rng.standard_normal((m, 64)).astype("float32")
        out = vm["main"](*(tvm.runtime.tensor(a) for a in (x, w, b))).numpy()
        y = np.maximum(x @ w + b, 0)
        e = np.exp(y - y.max(-1, keepdims=True))
        np.testing.assert_allclose(out, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_cpu_only_and_flag():
    from tvm_fusion.build import pipeline

    assert pipeline.serial_passes(tvm.target.Target("cuda")) == []
    names = [str(p.info.name) for p in pipeline.serial_passes(tvm_fusion.host_target())]
    assert names == ["PrefetchPanels", "SerialSmallKernels"]  # the Matmul rule's prefetches first
    off = pipeline.serial_passes(tvm_fusion.host_target(), serial_small_kernels=False)
    assert [str(p.info.name) for p in off] == ["PrefetchPanels"]
    with tvm_fusion.host_target():
        off = tvm_fusion.build_pipeline(serial_small_kernels=False)(MatmulSoftmax)
    assert not [f for f in off.functions.values() if ATTR in (getattr(f, "attrs", None) or {})]


@T.prim_func(private=True, s_tir=True)
def half_rows(x: T.handle, y: T.handle, n: T.int64):
    X = T.match_buffer(x, (n - n // 2, T.int64(8)), "float32")
    Y = T.match_buffer(y, (n - n // 2, T.int64(8)), "float32")
    for i in T.parallel(n - n // 2):
        for j in range(T.int64(8)):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                Y[vi, vj] = X[vi, vj] + T.float32(1)


def test_shape_expressions_bound_on_both_paths():
    """A buffer of ``n - n // 2`` rows (one half of an axis): the copy's buffers are matched
    with extents in its own variables, bound to the function's (``match_buffer`` alone cannot
    prove ``n' - n' // 2 == n - n // 2``)."""
    func = serialize_small(half_rows)
    assert func.attrs[ATTR] == 4096
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    for n in (5, 3001):
        x = np.random.default_rng(n).standard_normal((n - n // 2, 8)).astype("float32")
        y = tvm.runtime.tensor(np.zeros_like(x))
        lib["main"](tvm.runtime.tensor(x), y, n)
        np.testing.assert_array_equal(y.numpy(), x + 1)


@T.prim_func(private=True, s_tir=True)
def launch_region(X: T.Buffer((4, 8), "float32"), Y: T.Buffer((4, 8), "float32")):
    # lower/rnn_loop.py's form: one launch for every step, a join after each step's blocks
    with T.attr(0, "pragma_parallel_launch_point", 1):
        for s in range(4):
            with T.attr(0, "pragma_parallel_barrier_when_finish", 1):
                for j in T.parallel(8):
                    Y[s, j] = X[s, j] + T.float32(1)


@T.prim_func(private=True, s_tir=True)
def launch_region_expected(X: T.Buffer((4, 8), "float32"), Y: T.Buffer((4, 8), "float32")):
    for s, j in T.grid(4, 8):
        Y[s, j] = X[s, j] + T.float32(1)


def test_serial_copy_drops_the_launch_pragmas():
    """Left over a serial loop, the pragmas fail codegen ("Cannot find parallel loop within
    parallel launch"): an LSTM with 19 units on AVX2 did (issue #37)."""
    tvm.ir.assert_structural_equal(serialize_small(launch_region), launch_region_expected)
    tvm.compile(serialize_small(launch_region).with_attr("global_symbol", "f"), "llvm")


@pytest.mark.parametrize("hidden", [19, 40])
def test_small_recurrent_loops_build_on_every_target(cpu_target, hidden, monkeypatch):
    """The dynamic-sequence LSTM loop, its unit blocks forced parallel, through the pass and
    codegen for every target: where a step has little work the pass makes it serial."""
    from tvm_fusion.lower import rnn_loop

    monkeypatch.setattr(rnn_loop, "PARALLEL_MIN_MACS", 0)
    func = rnn_loop.loop_kernel("LSTM", hidden, False, None, target=cpu_target)
    out = serialize_small(func)
    pragmas = [
        s
        for s in tir_util.iter_stmts(out.body)
        if isinstance(s, tirx.AttrStmt) and "parallel_launch" in str(s.attr_key)
    ]
    assert bool(pragmas) == bool(_parallel_loops(out))
    mod = tvm.IRModule({"lstm": out.with_attr("global_symbol", "lstm")})
    with cpu_target:
        tvm.compile(mod, cpu_target)
