"""CheckGatherBounds: a run-time range check before every take whose indices are unproven.

Fires on: indices that are a function input (static and symbolic axis, int32 indices).
Must not fire: constant indices inside the axis, ``arange`` inside the axis (static and
symbolic), ``argmax`` / ``topk`` indices of an axis no longer than the take's, a slice of a
constant ``position_ids`` buffer (symbolic length, broadcast), ``mode="clip"``.
Checked as well: a constant index outside the axis, an argmax over a longer axis, a cast
that wraps a constant.
Numerical: ONNX Gather (against onnxruntime) and torch.export's ``nn.Embedding`` /
``index_select`` (against torch): in-range ids give the same numbers, out-of-range ids (by 1, by
10**8, negative beyond -n) raise one ``IndexError`` that names the op.
"""

import re

import numpy as np
import pytest
import tvm
import tvm.testing
from helpers import Base
from onnx import TensorProto, helper, numpy_helper
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvm_fusion
from tvm_fusion.build.engine import as_list, compile_module
from tvm_fusion.target import cuda_target
from tvm_fusion.transform import CheckGatherBounds, collect_rewrites

MESSAGE = "Gather/take (ONNX Gather, torch embedding/index_select) of 'x' at 'ids' ("


class BoundsBase(Base):
    transform = CheckGatherBounds()


def _checks(mod) -> list[tuple[str, str]]:
    """``(kernel name, IndexError message)`` of each check kernel in ``mod``."""
    found = []
    for gv, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and gv.name_hint.startswith("check_"):
            found += [
                (gv.name_hint, m) for m in re.findall(r'"IndexError", \["([^"]*)"', func.script())
            ]
    return sorted(found)


class TestInputIndices(BoundsBase):
    """Token ids from the caller into a (4, 3) table: one kernel checks them against [0, 4),
    in place (no copy), and the take reads its output."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 3), "float32"), ids: R.Tensor(("n",), "int64")):
            n = T.int64()
            with R.dataflow():
                y = R.take(x, ids, axis=0)
                R.output(y)
            return y

    def test_compare(self):
        after = self.transform(self.Before)
        assert _checks(after) == [("check_bounds", MESSAGE + "axis 0): index out of range [0, 4)")]
        text = after.script()
        assert "R.call_tir_inplace(cls.check_bounds, (x, ids)" in text
        assert re.search(r"R\.take\(x, lv, axis=0", text), text


class TestSymbolicExtent(BoundsBase):
    """int32 ids into a table of ``m`` rows: the kernel reads ``m`` from the table's shape."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("m", 3), "float32"), ids: R.Tensor((2,), "int32")):
            m = T.int64()
            with R.dataflow():
                y = R.take(x, ids, axis=0)
                R.output(y)
            return y

    def test_compare(self):
        after = self.transform(self.Before)
        assert _checks(after) == [("check_bounds", MESSAGE + "axis 0): index out of range [0, m)")]

    def test_runs(self):
        vm = compile_module(self.Before, "llvm").vm()
        for rows in (4, 9):
            x = np.arange(rows * 3, dtype="float32").reshape(rows, 3)
            ids = np.array([rows - 1, 0], "int32")
            (got,) = as_list(vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(ids)))
            np.testing.assert_array_equal(got, x[ids])
            for bad in ([rows, 0], [0, -1], [2**31 - 1, 0]):
                with pytest.raises(IndexError, match=r"index out of range \[0, m\)"):
                    vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(np.array(bad, "int32")))


class TestPositionsPastTheTable(BoundsBase):
    """``arange(0, seq)`` into 16 rows, ``seq`` unbounded: the span ``[0, seq - 1]`` is checked
    (one scalar assert, the table passed through in place), the take stays a take of an arange
    (GatherToSlice makes it a slice), ``seq`` = 17 raises."""

    @I.ir_module
    class Before:
        @R.function
        def main(ids: R.Tensor(("batch", "seq"), "int64"), table: R.Tensor((16, 4), "float32")):
            batch = T.int64()
            seq = T.int64()
            with R.dataflow():
                p = R.arange(0, seq, 1, dtype="int64")
                y = R.take(table, p, axis=0)
                z = R.add(y, R.const(1.0, "float32"))
                R.output(z)
            return z

    def test_compare(self):
        after = self.transform(self.Before)
        assert _checks(after) == [
            (
                "check_span",
                MESSAGE.replace("'x' at 'ids'", "'table' at 'p'")
                + "axis 0): index out of range [0, 16)",
            )
        ]
        assert "R.call_tir_inplace(cls.check_span, (table, 0, seq - 1)" in after.script()

    def test_runs(self):
        table = np.arange(64, dtype="float32").reshape(16, 4)
        with collect_rewrites() as counts:
            vm = compile_module(self.Before, "llvm").vm()
        assert counts["CheckGatherBounds"] == 1 and counts["GatherToSlice"] == 1
        for seq in (1, 16):
            ids = tvm.runtime.tensor(np.zeros((2, seq), "int64"))
            (got,) = as_list(vm["main"](ids, tvm.runtime.tensor(table)))
            np.testing.assert_array_equal(got, table[:seq] + 1)
        with pytest.raises(IndexError, match=r"index out of range \[0, 16\)"):
            vm["main"](tvm.runtime.tensor(np.zeros((2, 17), "int64")), tvm.runtime.tensor(table))


class TestConstantInside(BoundsBase):
    """Constant indices inside the axis: proven, left alone."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 3), "float32")):
            with R.dataflow():
                y = R.take(x, R.const(np.array([0, 3, 1], "int64")), axis=0)
                R.output(y)
            return y

    Expected = Before


class TestConstantOutside(BoundsBase):
    """A constant index past a static axis: checked (raises on every call)."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 3), "float32")):
            with R.dataflow():
                y = R.take(x, R.const(np.array([0, 4], "int64")), axis=0)
                R.output(y)
            return y

    def test_compare(self):
        with collect_rewrites() as counts:
            self.transform(self.Before)
        assert counts["CheckGatherBounds"] == 1


class TestArangeInside(BoundsBase):
    """``arange(0, m)`` on an axis of ``m`` (and a static one inside 10): left alone."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("m", 10), "float32")):
            m = T.int64()
            with R.dataflow():
                rows = R.take(x, R.arange(0, m, 1, dtype="int64"), axis=0)
                cols = R.take(rows, R.arange(2, 9, 3, dtype="int64"), axis=1)
                R.output(cols)
            return cols

    Expected = Before


class TestArgmax(BoundsBase):
    """Indices of an argmax over an axis of 4, into an axis of 4: left alone."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 3), "float32"), scores: R.Tensor((2, 4), "float32")):
            with R.dataflow():
                best = R.argmax(scores, axis=1)
                y = R.take(x, best, axis=0)
                R.output(y)
            return y

    Expected = Before


class TestArgmaxOfLongerAxis(BoundsBase):
    """An argmax over 5 values into 4 rows is not proven: checked."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 3), "float32"), scores: R.Tensor((2, 5), "float32")):
            with R.dataflow():
                best = R.argmax(scores, axis=1)
                y = R.take(x, best, axis=0)
                R.output(y)
            return y

    def test_compare(self):
        with collect_rewrites() as counts:
            after = self.transform(self.Before)
        assert counts["CheckGatherBounds"] == 1
        assert _checks(after)[0][0] == "check_bounds"


class TestPositionIdsSlice(BoundsBase):
    """``position_ids[:, :seq]`` of a constant (1, 16) buffer broadcast to the batch, through
    the importer's negative-index ``where``: values of the constant, left alone."""

    @I.ir_module
    class Before:
        @R.function
        def main(ids: R.Tensor(("batch", "seq"), "int64"), table: R.Tensor((16, 4), "float32")):
            batch = T.int64()
            seq = T.int64()
            with R.dataflow():
                pos = R.const(np.arange(16, dtype="int64").reshape(1, 16), "int64")
                p = R.strided_slice(pos, (1,), (0,), (seq,), (1,), assume_inbound=True)
                e = R.broadcast_to(p, R.shape([batch, seq]))
                neg = R.less(e, R.const(0, "int64"))
                idx = R.where(neg, R.add(e, R.const(16, "int64")), e)
                y = R.take(table, idx, axis=0)
                R.output(y)
            return y

    Expected = Before


class TestTopkIndices(BoundsBase):
    """The indices of a topk over 4 values, cast to int64, into 4 rows: left alone."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 3), "float32"), scores: R.Tensor((2, 4), "float32")):
            with R.dataflow():
                top = R.topk(scores, k=2, axis=1, ret_type="both", dtype="int32")
                idx = R.astype(top[1], "int64")
                y = R.take(x, idx, axis=0)
                R.output(y)
            return y

    Expected = Before


class TestNarrowingCast(BoundsBase):
    """A constant 200 cast to int8 is -56: not a value inside the 256 rows, checked."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((256, 3), "float32")):
            with R.dataflow():
                idx = R.astype(R.const(np.array([200], "int64")), "int8")
                y = R.take(x, idx, axis=0)
                R.output(y)
            return y

    def test_compare(self):
        with collect_rewrites() as counts:
            self.transform(self.Before)
        assert counts["CheckGatherBounds"] == 1


class TestClip(BoundsBase):
    """``mode="clip"`` never reads outside the buffer: left alone."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 3), "float32"), ids: R.Tensor((2,), "int64")):
            with R.dataflow():
                y = R.take(x, ids, axis=0, mode="clip")
                R.output(y)
            return y

    Expected = Before


# ---------------------------------------------------------------------------------------------
# numerical: ONNX Gather against onnxruntime, torch.export against torch

TABLE = np.arange(12, dtype="float32").reshape(4, 3) * 0.5 - 1
OUT_OF_RANGE = [[[4]], [[1, 2], [3, 10**8]], [[-5, 0]]]


@pytest.fixture(scope="module")
def gather_model():
    graph = helper.make_graph(
        [helper.make_node("Gather", ["W", "ids"], ["y"], axis=0)],
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 3])],
        [numpy_helper.from_array(TABLE, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    vm = compile_module(tvm_fusion.load_onnx(model), "llvm").vm()
    return model, vm


def test_onnx_gather_in_range_matches_onnxruntime(gather_model):
    ort = pytest.importorskip("onnxruntime")
    model, vm = gather_model
    ids = np.array([[0, 3, -1], [-4, 2, 1]], "int64")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, {"ids": ids})
    (got,) = as_list(vm["main"](tvm.runtime.tensor(ids)))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("ids", OUT_OF_RANGE, ids=["by_1", "by_1e8", "below_minus_n"])
def test_onnx_gather_out_of_range_raises(gather_model, ids):
    _, vm = gather_model
    with pytest.raises(IndexError, match=r"index out of range \[0, 4\)") as err:
        vm["main"](tvm.runtime.tensor(np.array(ids, "int64")))
    assert (
        str(err.value)
        == MESSAGE.replace("'x'", "a constant") + "axis 0): index out of range [0, 4)"
    )


def test_exported_embedding_and_index_select():
    torch = pytest.importorskip("torch")

    class Lookup(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(4, 3)

        def forward(self, ids, cols):
            return self.emb(ids), torch.index_select(self.emb.weight, 1, cols)

    torch.manual_seed(0)
    module = Lookup().eval()
    ids, cols = torch.tensor([[0, 3], [2, 1]]), torch.tensor([2, 0])
    program = torch.export.export(module, (ids, cols))
    with collect_rewrites() as counts:
        vm = compile_module(tvm_fusion.frontend.import_exported_program(program), "llvm").vm()
    assert counts["CheckGatherBounds"] == 2
    with torch.no_grad():
        want = [t.numpy() for t in module(ids, cols)]
    got = as_list(vm["main"](tvm.runtime.tensor(ids.numpy()), tvm.runtime.tensor(cols.numpy())))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    for bad_ids, bad_cols in (([[0, 4], [0, 0]], [0, 1]), ([[0, 1], [2, 3]], [-1, 0])):
        with pytest.raises(IndexError, match=r"index out of range \[0, [34]\)"):
            vm["main"](
                tvm.runtime.tensor(np.array(bad_ids, "int64")),
                tvm.runtime.tensor(np.array(bad_cols, "int64")),
            )
    huge = np.array([[0, 10**8], [0, 0]], "int64")
    with pytest.raises(IndexError, match=r"index out of range \[0, 4\)"):
        vm["main"](tvm.runtime.tensor(huge), tvm.runtime.tensor(cols.numpy()))


def _elements_model(op: str):
    """``GatherElements(W, ids, axis=1)`` / ``ScatterElements(W, ids, upd, axis=1)`` on a
    (2, 4) table with (2, k) ids."""
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, "k"])]
    names = ["W", "ids"]
    upd = op == "ScatterElements"
    if upd:
        inputs.append(helper.make_tensor_value_info("upd", TensorProto.FLOAT, [2, "k"]))
        names.append("upd")
    table = np.arange(8, dtype="float32").reshape(2, 4)
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"], axis=1)],
        op,
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4 if upd else "k"])],
        [numpy_helper.from_array(table, "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("op", ["GatherElements", "ScatterElements"])
def test_elements_ops_match_onnxruntime_and_raise(op):
    """In-range ids (negative ones included, as ONNX allows) give ORT's numbers; an id past the
    axis of 4, below -4, or 10**8 raises one IndexError naming the op."""
    ort = pytest.importorskip("onnxruntime")
    model = _elements_model(op)
    with collect_rewrites() as counts:
        vm = compile_module(tvm_fusion.load_onnx(model), "llvm").vm()
    assert counts["CheckGatherBounds"] == 1
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    upd = np.array([[10, 20], [30, 40]], "float32")

    def feeds(ids):
        ids = np.array(ids, "int64")
        return {"ids": ids, "upd": upd} if op == "ScatterElements" else {"ids": ids}

    for ids in ([[0, 3], [-1, 1]], [[-4, 2], [3, 0]]):
        (want,) = sess.run(None, feeds(ids))
        args = [tvm.runtime.tensor(a) for a in feeds(ids).values()]
        (got,) = as_list(vm["main"](*args))
        np.testing.assert_array_equal(got, want)
    low = "-4" if op == "ScatterElements" else "0"
    for bad in ([[0, 4], [0, 0]], [[0, -5], [0, 0]], [[10**8, 0], [0, 0]]):
        with pytest.raises(IndexError, match=rf"^{op} of a constant .*\[{low}, 4\)$"):
            vm["main"](*[tvm.runtime.tensor(a) for a in feeds(bad).values()])


def test_cuda_builds_unchecked(gather_model):
    """No check on CUDA (a device-side assert would end the context): the pass leaves the
    takes alone there, with a warning, and the module builds for sm_90 (compile only)."""
    model, _ = gather_model
    with collect_rewrites() as counts:
        compile_module(tvm_fusion.load_onnx(model), cuda_target("sm_90"))
        compile_module(TestPositionsPastTheTable.Before, cuda_target("sm_90"))
    assert counts["CheckGatherBounds"] == 0
    assert counts["GatherToSlice"] == 1


if __name__ == "__main__":
    tvm.testing.main()
