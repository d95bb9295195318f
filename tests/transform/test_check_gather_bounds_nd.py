"""CheckGatherBounds on gather_nd / scatter_nd and data-dependent slices, and the table of bad
ids for every indexing op.

Fires on: gather_nd ids from the caller (each id of the last dimension against its own axis,
``batch_dims`` honoured; symbolic extents read at run time), scatter_nd ids, the steps of a
``dynamic_strided_slice`` (a step of 0 is SIGFPE in its shape function).
Must not fire: constant gather_nd ids inside their axes, constant nonzero slice steps,
constant scatter_elements ids inside [-n, n) (an ONNX Slice's axes: one check per dynamic Slice).
Numerical (``tvm_fusion.testing.bounds_table``): Gather, GatherElements, GatherND,
ScatterElements, ScatterND, Slice (ONNX, against onnxruntime) and torch.export's embedding /
index_select (against torch): ids in range give the reference's numbers, ids out by 1, by
10**8 and below -n raise one IndexError naming the op (Slice: ONNX's clamped result); GatherND,
ScatterND and Slice's step 0 in a child process (the unchecked kernels crash it).
"""

import re

import numpy as np
import pytest
import tvm
import tvm.testing
from helpers import Base
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion.build.engine import as_list, compile_module
from tvm_fusion.testing import bounds_table
from tvm_fusion.transform import CheckGatherBounds, collect_rewrites


class BoundsBase(Base):
    transform = CheckGatherBounds()


def _checks(mod) -> list[tuple[str, str]]:
    """``(kernel name, message)`` of each check kernel in ``mod``."""
    found = []
    for gv, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and gv.name_hint.startswith("check_"):
            text = func.script()
            found += [(gv.name_hint, m) for m in re.findall(r'"\w+Error", \["([^"]*)"', text)]
    return sorted(found)


class TestGatherNDSymbolic(BoundsBase):
    """gather_nd with batch_dims 1 into a (b, m, 4) table: the first id is checked against
    ``m`` (read from the table's shape at run time), the second against 4."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", "m", 4), "float32"), ids: R.Tensor(("b", "k", 2), "int64")):
            b = T.int64()
            k = T.int64()
            with R.dataflow():
                y = R.gather_nd(x, ids, batch_dims=1)
                R.output(y)
            return y

    def test_compare(self):
        after = self.transform(self.Before)
        message = "GatherND of 'x' at 'ids' (batch_dims 1): index out of range [0, m) x [0, 4)"
        assert _checks(after) == [("check_bounds", message)]
        text = after.script()
        assert "R.call_tir_inplace(cls.check_bounds, (x, ids)" in text
        assert re.search(r"R\.gather_nd\(x, lv, batch_dims=1\)", text), text

    def test_runs(self):
        with collect_rewrites() as counts:
            vm = compile_module(self.Before, "llvm").vm()
        assert counts["CheckGatherBounds"] == 1
        x = np.arange(40, dtype="float32").reshape(2, 5, 4)
        ids = np.array([[[4, 3], [0, 1]], [[2, 0], [4, 0]]], "int64")
        (got,) = as_list(vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(ids)))
        want = np.stack([x[i][tuple(ids[i].T)] for i in range(2)])
        np.testing.assert_array_equal(got, want)
        for bad in ([5, 0], [0, 4], [-1, 0], [0, 10**8]):
            wrong = ids.copy()
            wrong[1, 1] = bad
            with pytest.raises(IndexError, match=r"index out of range \[0, m\) x \[0, 4\)$"):
                vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(wrong))


class TestScatterNDInput(BoundsBase):
    """scatter_nd ids from the caller into a (2, 3) tensor: one id per axis, from axis 0."""

    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((2, 3), "float32"),
            ids: R.Tensor(("k", 2), "int32"),
            upd: R.Tensor(("k",), "float32"),
        ):
            k = T.int64()
            with R.dataflow():
                y = R.scatter_nd(x, ids, upd)
                R.output(y)
            return y

    def test_compare(self):
        after = self.transform(self.Before)
        message = "ScatterND of 'x' at 'ids': index out of range [0, 2) x [0, 3)"
        assert _checks(after) == [("check_bounds", message)]
        assert re.search(r"R\.scatter_nd\(x, lv, upd", after.script())


class TestConstantNDInRange(BoundsBase):
    """Constant gather_nd ids inside their axes: no check."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3, 4), "float32")):
            with R.dataflow():
                y = R.gather_nd(x, R.const(np.array([[1, 2], [0, 3]]), "int64"), batch_dims=1)
                R.output(y)
            return y

    Expected = Before


class TestTopkNDInRange(BoundsBase):
    """gather_nd of (E, N, K) expert weights by topk ids over E scores, as ``(s, 1)`` (the
    dynamo ONNX export of ``W[ids]``): the ids are proven inside axis 0, no check."""

    @I.ir_module
    class Before:
        @R.function
        def main(w: R.Tensor((3, 5, 4), "float32"), scores: R.Tensor(("s", 3), "float32")):
            s = T.int64()
            with R.dataflow():
                top = R.topk(scores, k=1, axis=-1, ret_type="indices", dtype="int64")
                ids = R.reshape(top, R.shape([s, 1]))
                y = R.gather_nd(w, ids, batch_dims=0)
                R.output(y)
            return y

    Expected = Before


class TestTopkNDOutside(BoundsBase):
    """The same gather_nd by topk ids over 4 scores into 3 experts: checked, and the check
    kernel says which axis bounds its one id (CHECKED_AXIS, for FuseGatheredGates)."""

    @I.ir_module
    class Before:
        @R.function
        def main(w: R.Tensor((3, 5, 4), "float32"), scores: R.Tensor(("s", 4), "float32")):
            s = T.int64()
            with R.dataflow():
                top = R.topk(scores, k=1, axis=-1, ret_type="indices", dtype="int64")
                ids = R.reshape(top, R.shape([s, 1]))
                y = R.gather_nd(w, ids, batch_dims=0)
                R.output(y)
            return y

    def test_compare(self):
        from tvm_fusion.transform.check_gather_bounds import CHECKED_AXIS, CHECKED_SIGNED

        after = self.transform(self.Before)
        assert [k for k, _ in _checks(after)] == ["check_bounds"]
        kernel = after["check_bounds"]
        assert int(kernel.attrs[CHECKED_AXIS]) == 0 and not bool(kernel.attrs[CHECKED_SIGNED])


class TestConstantNDOutside(BoundsBase):
    """A constant gather_nd id past its axis (3 into an axis of 3) is checked."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3, 4), "float32")):
            with R.dataflow():
                y = R.gather_nd(x, R.const(np.array([[3, 2], [0, 3]]), "int64"), batch_dims=1)
                R.output(y)
            return y

    def test_compare(self):
        after = self.transform(self.Before)
        assert [k for k, _ in _checks(after)] == ["check_bounds"]


class TestDynamicSliceSteps(BoundsBase):
    """Steps from the caller: checked nonzero before the slice."""

    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((5, 3), "float32"),
            begin: R.Tensor((2,), "int64"),
            end: R.Tensor((2,), "int64"),
            steps: R.Tensor((2,), "int64"),
        ):
            with R.dataflow():
                y = R.dynamic_strided_slice(x, begin, end, steps)
                R.output(y)
            return y

    def test_compare(self):
        after = self.transform(self.Before)
        message = (
            "Slice (dynamic_strided_slice) of 'x': a step of 0 (ONNX Slice steps must be nonzero)"
        )
        assert _checks(after) == [("check_steps", message)]
        assert re.search(r"R\.dynamic_strided_slice\(x, begin, end, lv\)", after.script())


class TestDynamicSliceConstantSteps(BoundsBase):
    """Bounds from the caller, constant nonzero steps: nothing to check."""

    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((5, 3), "float32"),
            begin: R.Tensor((2,), "int64"),
            end: R.Tensor((2,), "int64"),
        ):
            with R.dataflow():
                y = R.dynamic_strided_slice(x, begin, end, R.const(np.array([1, -2]), "int64"))
                R.output(y)
            return y

    Expected = Before


class TestScatterElementsConstantInside(BoundsBase):
    """Constant scatter_elements ids inside [-n, n) (a dynamic Slice's axes, as the importer
    scatters its bounds into a row per axis): no check."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((3,), "int64"), v: R.Tensor((2,), "int64")):
            with R.dataflow():
                y = R.scatter_elements(x, R.const(np.array([-3, 2]), "int64"), v)
                R.output(y)
            return y

    Expected = Before


class TestScatterElementsConstantOutside(BoundsBase):
    """A constant scatter_elements id of 3 into an axis of 3: checked."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((3,), "int64"), v: R.Tensor((2,), "int64")):
            with R.dataflow():
                y = R.scatter_elements(x, R.const(np.array([0, 3]), "int64"), v)
                R.output(y)
            return y

    def test_compare(self):
        after = self.transform(self.Before)
        assert [k for k, _ in _checks(after)] == ["check_bounds"]


def test_onnx_dynamic_slice_checks_steps_only():
    """ONNX Slice with starts / ends / steps inputs and constant axes: one check (the steps);
    the importer's scatters of the bounds at the constant axis are left alone."""
    import tvm_fusion

    with collect_rewrites() as counts:
        compile_module(tvm_fusion.load_onnx(bounds_table.onnx_model("Slice")), "llvm")
    assert counts["CheckGatherBounds"] == 1


# ---------------------------------------------------------------------------------------------
# the table: each op x (in range, out by 1, by 10**8, below -n) against onnxruntime / torch

# ops whose unchecked kernels crash the process on a bad id: run in a child process
ISOLATED = [("GatherND", c) for c in bounds_table.CASES]
ISOLATED += [("ScatterND", c) for c in bounds_table.CASES] + [("Slice", "step_0")]
IN_PROCESS = [
    (op, case)
    for op in bounds_table.OPS
    for case in bounds_table.CASES
    if (op, case) not in ISOLATED
]
MESSAGES = {
    "Gather": r"^Gather/take .* at 'ids' \(axis 0\): index out of range \[0, 4\)$",
    "embedding": r"^Gather/take .* at 'ids' \(axis 0\): index out of range \[0, 4\)$",
    "index_select": r"^Gather/take .* at 'ids' \(axis 0\): index out of range \[0, 4\)$",
    "GatherElements": r"^GatherElements of .* \(axis 1\): index out of range \[0, 4\)$",
    "ScatterElements": r"^ScatterElements of .* \(axis 1\): index out of range \[-4, 4\)$",
    "GatherND": r"^GatherND of .* \(batch_dims 1\): index out of range \[0, 3\) x \[0, 4\)$",
    "ScatterND": r"^ScatterND of .* at 'ids': index out of range \[0, 2\) x \[0, 3\)$",
    "Slice": r"^Slice \(dynamic_strided_slice\) of .*: a step of 0",
}


def _expect(row: dict) -> None:
    op, case = row["op"], row["case"]
    if case == "in_range" or (op == "Slice" and case != "step_0"):
        # ONNX clamps a slice's bounds: onnxruntime's numbers, no error
        assert (row["outcome"], row["reference"]) == ("ok", None), row
        return
    assert row["outcome"] == "error" and row["reference"], row
    assert re.match(MESSAGES[op], row["detail"]), row


@pytest.fixture(scope="module")
def runner():
    pytest.importorskip("onnxruntime")
    return bounds_table.Runner()


@pytest.mark.parametrize("op, case", IN_PROCESS, ids=[f"{o}-{c}" for o, c in IN_PROCESS])
def test_table_in_process(runner, op, case):
    if op in bounds_table.TORCH_OPS:
        pytest.importorskip("torch")
    _expect(runner.run(op, case))


def test_table_isolated():
    """GatherND / ScatterND ids and a Slice step of 0: one child process for all (a crash
    there is a ``crash`` row, not a dead pytest)."""
    pytest.importorskip("onnxruntime")
    rows = bounds_table.run_isolated(ISOLATED, timeout=300)
    assert [(r["op"], r["case"]) for r in rows] == ISOLATED
    for row in rows:
        _expect(row)


if __name__ == "__main__":
    tvm.testing.main()
