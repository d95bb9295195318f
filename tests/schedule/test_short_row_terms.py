"""The row rule computes a costly reduction's terms over a short static row as one vector
(``reduction._costly_update``): ``rfactor`` takes the whole row as its lanes, so
``sum(exp(x - max))`` over 13 classes evaluates the exp once per row, 13 lanes wide, and
folds the 13 terms after.

"Short" is relative to the target: a row of ``1 < n < 2 * lanes`` (21 classes at AVX-512's 16
float lanes, not at AVX2's 8). The schedule is checked compile-only on AVX2, AVX-512 and NEON
targets (``cpu_target``) with row lengths drawn from each target's lanes; the numbers on the
host's own build, with row lengths drawn from the host's lanes.

Cases: log_softmax rows under one vector, just over one, just under two (two rows an
iteration, an odd number of rows, one row: the single-row schedule), symbolic rows; the fused
cross entropy's row kernel. Must not fire: rows of two vectors or more (reduced in vectors of
``lanes``, with a tail or without); a cheap update (layer norm's sums over a short row) stays
one scalar reduction. Kernels are legalised as the pipeline does (under the target: its
vector width) and scheduled by the rule directly, small shapes.
"""

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from tvm_fusion import tir_util
from tvm_fusion.lower import legalize
from tvm_fusion.schedule.cpu.reduction import RowReduction
from tvm_fusion.target import parse_target, vector_lanes
from tvm_fusion.transform.fuse_cross_entropy import cross_entropy_rows

HOST = parse_target("llvm")

# Row lengths relative to a target's float lanes L. Shorter than two vectors: one vector of n
SHORT = {
    "under_one_vector": lambda lanes: lanes // 2 + 1,  # 9 at 16 lanes, 5 at 8, 3 at 4
    "over_one_vector": lambda lanes: lanes + 1,  # 17, 9, 5
    "under_two_vectors": lambda lanes: 2 * lanes - 3,  # 29, 13, 5
}
# Two vectors or more: reduced in vectors of L lanes, with a tail (2L + 1) or without (2L)
LONG = {
    "two_vectors": lambda lanes: 2 * lanes,
    "over_two_vectors": lambda lanes: 2 * lanes + 1,
}
# (rows, row length): two rows an iteration, an odd number of rows, one row
LOG_SOFTMAX = [
    (6, "under_two_vectors"),
    (7, "under_one_vector"),
    (1, "under_two_vectors"),
    (6, "over_one_vector"),
]


def _scheduled(make, target):
    """``make() -> (inputs, output)`` legalised under ``target`` (its vector width)."""
    with target:
        inputs, output = make()
        func = te.create_prim_func([*inputs, output])
        sch = RowReduction().apply(func, target, False)
    assert sch is not None
    return sch.mod["main"]


def _run(func, args, out_shape) -> np.ndarray:
    with HOST:
        lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
    dev = tvm.cpu()
    y = tvm.runtime.tensor(np.full(out_shape, np.nan, "float32"), dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], y)
    return y.numpy()


def _rf_vector_widths(func) -> list[int]:
    """Extents of the vectorised loops around an rfactor block's update."""
    widths = []
    for loop in tir_util.loops(func):
        if loop.kind != tirx.ForKind.VECTORIZED:
            continue
        names = [s.name_hint for s in tir_util.iter_stmts(loop.body) if hasattr(s, "name_hint")]
        if any(name.endswith("_rf_update") for name in names):
            widths.append(int(loop.extent))
    return widths


def _log_softmax_te(shape):
    x = te.placeholder(shape, "float32", name="x")
    return [x], legalize.fast_log_softmax(x, 1)


def _cross_entropy_te(m, n):
    x = te.placeholder((m, n), "float32", name="x")
    t = te.placeholder((m,), "int64", name="t")
    return [x, t], cross_entropy_rows(x, t, fast_exp=True)


def _layer_norm_te(m, n):
    x = te.placeholder((m, n), "float32", name="x")
    g = te.placeholder((n,), "float32", name="g")
    b = te.placeholder((n,), "float32", name="b")
    return [x, g, b], legalize.fast_layer_norm(x, g, b, 1e-5)


def _input(m: int, n: int) -> np.ndarray:
    return np.random.default_rng(m * 1000 + n).normal(0, 3, (m, n)).astype("float32")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _host_width(name: str) -> int:
    return {**SHORT, **LONG}[name](vector_lanes(HOST, "float32"))


@pytest.mark.parametrize("m, width", LOG_SOFTMAX)
def test_log_softmax_terms_in_one_vector(m, width, cpu_target):
    n = SHORT[width](vector_lanes(cpu_target, "float32"))
    func = _scheduled(lambda: _log_softmax_te((m, n)), cpu_target)
    assert n in _rf_vector_widths(func)


@pytest.mark.parametrize("width", list(LONG))
def test_log_softmax_long_rows_not_one_vector(width, cpu_target):
    """Must not fire: a row of two vectors or more is reduced in vectors of the target's lanes
    (partial sums that the legalisation writes), no vector as long as the row."""
    lanes = vector_lanes(cpu_target, "float32")
    n = LONG[width](lanes)
    func = _scheduled(lambda: _log_softmax_te((6, n)), cpu_target)
    assert _rf_vector_widths(func) == []
    vectors = [int(lp.extent) for lp in tir_util.loops(func) if lp.kind == tirx.ForKind.VECTORIZED]
    assert vectors and max(vectors) == lanes, vectors


@pytest.mark.parametrize("m, width", [*LOG_SOFTMAX, (6, "two_vectors"), (6, "over_two_vectors")])
def test_log_softmax_numbers(m, width):
    n = _host_width(width)
    func = _scheduled(lambda: _log_softmax_te((m, n)), HOST)
    data = _input(m, n)
    y = _run(func, [data], (m, n))
    np.testing.assert_allclose(y, _log_softmax(data), rtol=1e-5, atol=2e-6)


def test_symbolic_rows(cpu_target):
    n = SHORT["under_two_vectors"](vector_lanes(cpu_target, "float32"))
    func = _scheduled(lambda: _log_softmax_te((tirx.Var("m", "int64"), n)), cpu_target)
    assert n in _rf_vector_widths(func)


def test_symbolic_rows_numbers():
    n = _host_width("under_two_vectors")
    func = _scheduled(lambda: _log_softmax_te((tirx.Var("m", "int64"), n)), HOST)
    for rows in (1, 5):
        data = _input(rows, n)
        y = _run(func, [data], (rows, n))
        np.testing.assert_allclose(y, _log_softmax(data), rtol=1e-5, atol=2e-6)


def test_cross_entropy_rows_in_one_vector(cpu_target):
    """13 classes on AVX2 (29 on AVX-512, 5 on NEON): just under two vectors."""
    n = SHORT["under_two_vectors"](vector_lanes(cpu_target, "float32"))
    func = _scheduled(lambda: _cross_entropy_te(9, n), cpu_target)
    assert n in _rf_vector_widths(func)


def test_cross_entropy_rows_numbers():
    m, n = 9, _host_width("under_two_vectors")
    func = _scheduled(lambda: _cross_entropy_te(m, n), HOST)
    data = _input(m, n)
    target = np.random.default_rng(1).integers(0, n, m).astype("int64")
    y = _run(func, [data, target], (m, 2))
    lse = data.max(axis=1) + np.log(np.exp(data - data.max(axis=1, keepdims=True)).sum(axis=1))
    np.testing.assert_allclose(y[:, 0], lse, rtol=1e-5, atol=2e-6)
    np.testing.assert_array_equal(y[:, 1], data[np.arange(m), target])


def test_cheap_update_stays_one_reduction(cpu_target):
    """Must not fire: layer norm's sums load about as much as they compute, even over a row
    that a costly update would take as one vector."""
    n = SHORT["under_two_vectors"](vector_lanes(cpu_target, "float32"))
    func = _scheduled(lambda: _layer_norm_te(9, n), cpu_target)
    assert _rf_vector_widths(func) == []


def test_cheap_update_numbers():
    m, n = 9, _host_width("under_two_vectors")
    func = _scheduled(lambda: _layer_norm_te(m, n), HOST)
    data, gamma, beta = _input(m, n), _input(1, n)[0], _input(2, n)[1]
    y = _run(func, [data, gamma, beta], (m, n))
    mean = data.mean(axis=1, keepdims=True)
    var = ((data - mean) ** 2).mean(axis=1, keepdims=True)
    np.testing.assert_allclose(
        y, (data - mean) / np.sqrt(var + 1e-5) * gamma + beta, rtol=1e-4, atol=1e-5
    )


if __name__ == "__main__":
    tvm.testing.main()
