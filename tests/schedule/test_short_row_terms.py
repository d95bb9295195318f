"""The row rule computes a costly reduction's terms over a short static row as one vector
(``reduction._costly_update``): ``rfactor`` takes the whole row as its lanes, so
``sum(exp(x - max))`` over 13 classes evaluates the exp once per row, 13 lanes wide, and
folds the 13 terms after.

Cases: log_softmax rows of 21 (two rows an iteration), 13 (an odd number of rows, one an
iteration), one row (the single-row schedule), symbolic rows; the fused cross entropy's row
kernel at 13 classes. Must not fire: a cheap update (layer norm's sums over a row of 21) stays
one scalar reduction. Kernels are legalised as the pipeline does and scheduled by the rule
directly, small shapes, built for llvm.
"""

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from tvm_fusion import tir_util
from tvm_fusion.lower import legalize
from tvm_fusion.schedule.cpu.reduction import RowReduction
from tvm_fusion.target import parse_target
from tvm_fusion.transform.fuse_cross_entropy import cross_entropy_rows

TARGET = parse_target("llvm")


def _scheduled(make):
    """``make() -> (inputs, output)`` legalised under the target (its vector width)."""
    with TARGET:
        inputs, output = make()
        func = te.create_prim_func([*inputs, output])
        sch = RowReduction().apply(func, TARGET, False)
    assert sch is not None
    return sch.mod["main"]


def _run(func, args, out_shape) -> np.ndarray:
    with TARGET:
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


def _input(m: int, n: int) -> np.ndarray:
    return np.random.default_rng(m * 1000 + n).normal(0, 3, (m, n)).astype("float32")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("m, n", [(6, 21), (7, 13), (1, 21)])
def test_log_softmax_terms_in_one_vector(m, n):
    func = _scheduled(lambda: _log_softmax_te((m, n)))
    assert n in _rf_vector_widths(func)
    data = _input(m, n)
    y = _run(func, [data], (m, n))
    np.testing.assert_allclose(y, _log_softmax(data), rtol=1e-5, atol=2e-6)


def test_symbolic_rows():
    func = _scheduled(lambda: _log_softmax_te((tirx.Var("m", "int64"), 13)))
    assert 13 in _rf_vector_widths(func)
    for rows in (1, 5):
        data = _input(rows, 13)
        y = _run(func, [data], (rows, 13))
        np.testing.assert_allclose(y, _log_softmax(data), rtol=1e-5, atol=2e-6)


def test_cross_entropy_rows_at_13_classes():
    m, n = 9, 13

    def make():
        x = te.placeholder((m, n), "float32", name="x")
        t = te.placeholder((m,), "int64", name="t")
        return [x, t], cross_entropy_rows(x, t, fast_exp=True)

    func = _scheduled(make)
    assert n in _rf_vector_widths(func)
    data = _input(m, n)
    target = np.random.default_rng(1).integers(0, n, m).astype("int64")
    y = _run(func, [data, target], (m, 2))
    lse = data.max(axis=1) + np.log(np.exp(data - data.max(axis=1, keepdims=True)).sum(axis=1))
    np.testing.assert_allclose(y[:, 0], lse, rtol=1e-5, atol=2e-6)
    np.testing.assert_array_equal(y[:, 1], data[np.arange(m), target])


def test_cheap_update_stays_one_reduction():
    """Must not fire: layer norm's sums load about as much as they compute."""
    m, n = 9, 21

    def make():
        x = te.placeholder((m, n), "float32", name="x")
        g = te.placeholder((n,), "float32", name="g")
        b = te.placeholder((n,), "float32", name="b")
        return [x, g, b], legalize.fast_layer_norm(x, g, b, 1e-5)

    func = _scheduled(make)
    assert _rf_vector_widths(func) == []
    data, gamma, beta = _input(m, n), _input(1, n)[0], _input(2, n)[1]
    y = _run(func, [data, gamma, beta], (m, n))
    mean = data.mean(axis=1, keepdims=True)
    var = ((data - mean) ** 2).mean(axis=1, keepdims=True)
    np.testing.assert_allclose(
        y, (data - mean) / np.sqrt(var + 1e-5) * gamma + beta, rtol=1e-4, atol=1e-5
    )


if __name__ == "__main__":
    tvm.testing.main()
