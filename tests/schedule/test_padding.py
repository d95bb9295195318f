"""``inline_padding``: pad_einsum's padded input copies read in place with clamped rows."""

import numpy as np
import tvm
from tvm import s_tir, te, tirx

from tvm_fusion import tir_util
from tvm_fusion.schedule._common import _clamped_copy, inline_padding


def _gemm():
    n = tirx.Var("n", "int64")
    x = te.placeholder((n, 24), name="x")
    w = te.placeholder((24, 16), name="w")
    k = te.reduce_axis((0, 24), "k")
    y = te.compute((n, 16), lambda i, j: te.sum(x[i, k] * w[k, j], axis=k), name="y")
    return te.create_prim_func([x, w, y])


def _padded(factors):
    sch = s_tir.Schedule(_gemm())
    block = sch.get_sblock("y")
    sch.pad_einsum(block, factors)
    return sch, list(sch.get_producers(block))


def test_row_padding_read_in_place_with_clamped_rows():
    """Rows padded to 4: the copy of x goes, the GEMM reads x[min(i, n - 1), k], and the
    result is right for row counts that are and are not multiples of 4 (one of them 0)."""
    sch, pads = _padded([4, 1, 1])
    assert [sch.get(p).name_hint for p in pads] == ["x_pad"]
    new = inline_padding(sch, pads)
    assert new is not None
    func = new.mod["main"]
    assert "x_pad" not in tir_util.block_names(func)
    assert not any(b.name == "x_pad" for b in tir_util.allocated_buffers(func))
    assert "T.min(" in func.script()
    built = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 16)).astype("float32")
    for rows in (0, 1, 4, 7):
        x = rng.standard_normal((rows, 24)).astype("float32")
        y = tvm.runtime.tensor(np.zeros((rows, 16), "float32"))
        built["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), y)
        np.testing.assert_allclose(y.numpy(), x @ w, rtol=1e-5, atol=1e-5)


def test_reduction_padding_keeps_its_zeros():
    """A padded reduction axis needs the zeros of the copy: clamping it would add the last
    element again. Left alone (None, the schedule unchanged)."""
    sch, pads = _padded([1, 1, 32])
    assert len(pads) == 2 and all(_clamped_copy(sch.get(p).body) for p in pads)  # copies
    before = sch.mod["main"]
    assert inline_padding(sch, pads) is None
    tvm.ir.assert_structural_equal(sch.mod["main"], before)


def test_other_producers_left_alone():
    """A producer that is not a pad_einsum copy (here: a computed prologue) is not touched."""
    n = tirx.Var("n", "int64")
    x = te.placeholder((n, 8), name="x")
    z = te.compute((n, 8), lambda i, j: x[i, j] * 2.0, name="z")
    k = te.reduce_axis((0, 8), "k")
    y = te.compute((n,), lambda i: te.sum(z[i, k], axis=k), name="y")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    assert inline_padding(sch, [sch.get_sblock("z")]) is None
