"""The row rule stores softmax's ``exp(x - max)`` in the output row and scales it in place
(``_row_buffer.output_as_row_buffer``), so no row buffer is allocated per row.

Cases: static rows of an odd length over 1024 bytes (the buffer was a ``TVMBackendAllocWorkspace``
call per row), short rows two per iteration, one row, symbolic rows and length, log_softmax
(no row buffer to share). Must not fire: an output that reads the buffer at other columns than
it writes keeps the buffer. Kernels are legalised as the pipeline does (``legalize``) and
scheduled by the rule directly, small shapes, built for llvm.
"""

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from tvm_fusion.lower import legalize
from tvm_fusion.schedule.cpu.reduction import RowReduction
from tvm_fusion.target import parse_target
from tvm_fusion.tir_util import allocated_buffers

TARGET = parse_target("llvm")
EXP = "T_exp_below_max"


def _scheduled(shape, compute):
    x = te.placeholder(shape, "float32", name="x")
    with TARGET:
        func = te.create_prim_func([x, compute(x)])
        sch = RowReduction().apply(func, TARGET, False)
    assert sch is not None
    return sch.mod["main"]


def _run(func, x: np.ndarray) -> tuple[np.ndarray, str]:
    with TARGET:
        lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
    dev = tvm.cpu()
    y = tvm.runtime.tensor(np.full(x.shape, np.nan, "float32"), dev)
    lib["main"](tvm.runtime.tensor(x, dev), y)
    return y.numpy(), lib.inspect_source("ll")


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _input(m: int, n: int) -> np.ndarray:
    return np.random.default_rng(m * 1000 + n).normal(0, 3, (m, n)).astype("float32")


def _names(func) -> list[str]:
    return [b.name for b in allocated_buffers(func)]


@pytest.mark.parametrize(
    "m, n",
    [
        (37, 531),  # one row an iteration, a row of 2124 bytes, a vector tail
        (10, 100),  # short rows: two an iteration
        (1, 999),  # one row: the single-row schedule
    ],
)
def test_softmax_writes_exp_into_the_output(m, n):
    func = _scheduled((m, n), lambda x: legalize.fast_softmax(x, 1))
    assert EXP not in _names(func)
    x = _input(m, n)
    y, ll = _run(func, x)
    np.testing.assert_allclose(y, _softmax(x), rtol=2e-6, atol=1e-7)
    assert "TVMBackendAllocWorkspace" not in ll or m == 1  # one row: buffers of the row itself


def test_symbolic_rows_and_length():
    m, n = tirx.Var("m", "int64"), tirx.Var("n", "int64")
    func = _scheduled((m, n), lambda x: legalize.fast_softmax(x, 1))
    assert EXP not in _names(func)
    for shape in ((3, 531), (4, 17), (1, 1)):
        x = _input(*shape)
        y, _ = _run(func, x)
        np.testing.assert_allclose(y, _softmax(x), rtol=2e-6, atol=1e-7, err_msg=str(shape))


def test_log_softmax_is_unchanged():
    func = _scheduled((5, 531), lambda x: legalize.fast_log_softmax(x, 1))
    x = _input(5, 531)
    y, ll = _run(func, x)
    np.testing.assert_allclose(y, np.log(_softmax(x)), rtol=1e-5, atol=2e-6)
    assert "TVMBackendAllocWorkspace" not in ll


def test_output_reading_other_columns_keeps_the_buffer():
    """Must not fire: the output reads ``exp`` in reverse column order, so writing ``exp``
    into the output would overwrite columns not yet read."""

    def reversed_softmax(x):
        n = x.shape[1]
        m = legalize._row_reduce(x, 1, "max")
        e = legalize.exp_below_max(x, m, 1)
        s = legalize._row_reduce(e, 1, "sum")
        return te.compute(x.shape, lambda i, j: e[i, n - 1 - j] / s[i, 0], name="out")

    func = _scheduled((6, 531), reversed_softmax)
    assert EXP in _names(func)
    x = _input(6, 531)
    y, _ = _run(func, x)
    np.testing.assert_allclose(y, _softmax(x)[:, ::-1], rtol=2e-6, atol=1e-7)
