"""GatherToSlice: take(x, arange) -> strided_slice.

Must not fire: repeated indices (step 0 as a constant), non-progression constants (also through
a reshape), indices that may be negative, clip/wrap mode with an unprovable bound, a 2-D index
tensor flattened, a 2-D index whose rows differ, a reshape to a length not provably the
progression's.
"""

import numpy as np
import pytest
import tvm
import tvm.testing
from helpers import Base, compare_pipelines
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvm_fusion
from tvm_fusion import analysis, models
from tvm_fusion.transform import GatherToSlice, collect_rewrites


class GatherBase(Base):
    transform = GatherToSlice()


class TestArange(GatherBase):
    """take(x, arange(1, 9, 2)) on axis 1 -> strided_slice(begin 1, end 8, stride 2)."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                idx = R.arange(1, 9, 2, dtype="int64")
                y = R.take(x, idx, axis=1)
                z = R.exp(y)
                R.output(z)
            return z

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                y = R.strided_slice(x, [1], [1], [8], [2], assume_inbound=True)
                z = R.exp(y)
                R.output(z)
            return z


class TestNegativeStep(GatherBase):
    """arange(9, -1, -3) = [9, 6, 3, 0]: the last index is 0, so end is -(dim + 1)."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((10, 3), "float32")):
            with R.dataflow():
                idx = R.arange(9, -1, -3, dtype="int64")
                y = R.take(x, idx, axis=0)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((10, 3), "float32")):
            with R.dataflow():
                y = R.strided_slice(x, [0], [9], [-11], [-3], assume_inbound=False)
                R.output(y)
            return y


class TestConstantProgression(GatherBase):
    """A constant index tensor (what FoldConstant leaves of an arange) with a negative axis."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 6), "float32")):
            with R.dataflow():
                y = R.take(x, R.const(np.array([2, 3, 4], "int64"), "int64"), axis=-1)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 6), "float32")):
            with R.dataflow():
                y = R.strided_slice(x, [1], [2], [5], [1], assume_inbound=True)
                R.output(y)
            return y


class TestDynamicBound(GatherBase):
    """A symbolic klen (XLNet's index_select(x, 3, arange(klen))): the slice ends at klen.

    take's default mode "fast" promises in-bound indices, so klen <= w need not be proven.
    """

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", 2, "w"), "float32"), k: R.Tensor(("klen",), "float32")):
            klen = T.int64()
            with R.dataflow():
                idx = R.arange(0, klen, 1, dtype="int64")
                y = R.take(x, idx, axis=2)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("b", 2, "w"), "float32"), k: R.Tensor(("klen",), "float32")):
            klen = T.int64()
            with R.dataflow():
                y = R.strided_slice(x, [2], [0], [klen], [1], assume_inbound=True)
                R.output(y)
            return y


class TestOnnxNormalisation(GatherBase):
    """The ONNX importer's where(less(i, 0), add(i, dim), i) around non-negative indices."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3, 20), "float32")):
            with R.dataflow():
                idx = R.const(np.arange(8, dtype="int64"), "int64")
                shp = R.shape_to_tensor(R.shape_of(x))
                neg = R.less(idx, R.const(0, "int64"))
                dim = R.take(shp, R.const(2, "int64"), axis=0, mode="wrap")
                wrapped = R.add(idx, dim)
                fixed = R.where(neg, wrapped, idx)
                y = R.take(x, fixed, axis=2, mode="fast")
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 3, 20), "float32")):
            with R.dataflow():
                y = R.strided_slice(x, [2], [0], [8], [1], assume_inbound=True)
                R.output(y)
            return y


class TestNegativeIndicesWrapped(GatherBase):
    """arange(-4, 0) through the importer's normalisation is [dim - 4, dim): a slice."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                idx = R.arange(-4, 0, 1, dtype="int64")
                neg = R.less(idx, R.const(0, "int64"))
                wrapped = R.add(idx, R.const(10, "int64"))
                fixed = R.where(neg, wrapped, idx)
                y = R.take(x, fixed, axis=1)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                y = R.strided_slice(x, [1], [6], [10], [1], assume_inbound=True)
                R.output(y)
            return y


class TestReshapedArange(GatherBase):
    """A reshape of the progression to 1-D of the same length keeps its values."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                idx = R.arange(1, 9, 2, dtype="int64")
                flat = R.reshape(idx, R.shape([4]))
                y = R.take(x, flat, axis=1)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                y = R.strided_slice(x, [1], [1], [8], [2], assume_inbound=True)
                R.output(y)
            return y


class TestDynamoRelShift(GatherBase):
    """XLNet's rel_shift ``index_select(x, 3, arange(klen))`` as the dynamo exporter writes it:
    Range -> Cast -> Mul 1 -> Add 0 -> Reshape([klen]) -> the importer's normalisation ->
    Gather, on an axis of symbolic length ``2 * seq - 1``."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", 2, "seq", "seq * 2 - 1"), "float32")):
            seq = T.int64()
            with R.dataflow():
                a = R.arange(0, seq, 1, dtype="int64")
                c = R.astype(a, dtype="int64")
                m = R.multiply(c, R.const(1, "int64"))
                s = R.add(m, R.const(0, "int64"))
                idx = R.reshape(s, R.shape([seq]))
                shp = R.shape_to_tensor(R.shape_of(x))
                neg = R.less(idx, R.const(0, "int64"))
                dim = R.take(shp, R.const(3, "int64"), axis=0, mode="wrap")
                wrapped = R.add(idx, dim)
                fixed = R.where(neg, wrapped, idx)
                y = R.take(x, fixed, axis=3, mode="fast")
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("b", 2, "seq", "seq * 2 - 1"), "float32")):
            seq = T.int64()
            with R.dataflow():
                y = R.strided_slice(x, [3], [0], [seq], [1], assume_inbound=True)
                R.output(y)
            return y


class TestNoFireReshapedNotProgression(GatherBase):
    """A reshape keeps the values: a non-progression stays a gather."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                idx = R.const(np.array([0, 1, 3], "int64"), "int64")
                flat = R.reshape(idx, R.shape([3]))
                y = R.take(x, flat, axis=1)
                R.output(y)
            return y

    Expected = Before


class TestNoFireReshapedFrom2D(GatherBase):
    """Only a 1-D progression is read through a reshape; a 2-D index tensor flattened is not
    analysed (conservative)."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                idx = R.const(np.array([[0, 1], [3, 2]], "int64"), "int64")
                flat = R.reshape(idx, R.shape([4]))
                y = R.take(x, flat, axis=1)
                R.output(y)
            return y

    Expected = Before


class TestNoFireReshapedOtherLength(GatherBase):
    """Dynamic: a reshape to a length not provably the progression's is not trusted."""

    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((2, "w"), "float32"),
            k: R.Tensor(("n",), "float32"),
            j: R.Tensor(("m",), "float32"),
        ):
            n = T.int64()
            m = T.int64()
            with R.dataflow():
                idx = R.arange(0, n, 1, dtype="int64")
                flat = R.reshape(idx, R.shape([m]))
                y = R.take(x, flat, axis=1)
                R.output(y)
            return y

    Expected = Before


class TestPositionIdsSlice(GatherBase):
    """The position-embedding lookup of DistilBERT / CLIP / GPT-2 exports:
    ``embedding(position_ids[:, :seq])`` with ``position_ids`` a (1, max_pos) arange buffer,
    through the importer's negative-index ``where``: a slice of the table with the index's
    unit row in front (a view), at a symbolic ``seq``."""

    @I.ir_module
    class Before:
        @R.function
        def main(ids: R.Tensor(("batch", "seq"), "int64"), table: R.Tensor((16, 4), "float32")):
            seq = T.int64()
            with R.dataflow():
                pos = R.const(np.arange(16, dtype="int64").reshape(1, 16), "int64")
                p = R.strided_slice(pos, (1,), (0,), (seq,), (1,), assume_inbound=True)
                neg = R.less(p, R.const(0, "int64"))
                wrapped = R.add(p, R.const(16, "int64"))
                idx = R.where(neg, wrapped, p)
                y = R.take(table, idx, axis=0)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(ids: R.Tensor(("batch", "seq"), "int64"), table: R.Tensor((16, 4), "float32")):
            seq = T.int64()
            with R.dataflow():
                lv = R.strided_slice(table, (0,), (0,), (seq,), (1,), assume_inbound=True)
                y = R.expand_dims(lv, axis=[0])
                R.output(y)
            return y


class TestPositionIdsExpanded(GatherBase):
    """The same index broadcast to the batch: the slice broadcast to the take's shape."""

    @I.ir_module
    class Before:
        @R.function
        def main(ids: R.Tensor(("batch", "seq"), "int64"), table: R.Tensor((16, 4), "float32")):
            batch = T.int64()
            seq = T.int64()
            with R.dataflow():
                pos = R.const(np.arange(16, dtype="int64").reshape(1, 16), "int64")
                p = R.strided_slice(pos, (1,), (2,), (seq + 2,), (1,), assume_inbound=True)
                e = R.broadcast_to(p, R.shape([batch, seq]))
                y = R.take(table, e, axis=0)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(ids: R.Tensor(("batch", "seq"), "int64"), table: R.Tensor((16, 4), "float32")):
            batch = T.int64()
            seq = T.int64()
            with R.dataflow():
                lv = R.strided_slice(table, (0,), (2,), (seq + 2,), (1,), assume_inbound=True)
                lv1 = R.expand_dims(lv, axis=[0])
                y = R.broadcast_to(lv1, R.shape([batch, seq, 4]))
                R.output(y)
            return y


class TestNoFireRowsDiffer(GatherBase):
    """A 2-D index whose rows are different progressions stays a gather."""

    @I.ir_module
    class Before:
        @R.function
        def main(table: R.Tensor((16, 4), "float32")):
            with R.dataflow():
                idx = R.const(np.array([[0, 1, 2], [0, 2, 4]], "int64"), "int64")
                y = R.take(table, idx, axis=0)
                R.output(y)
            return y

    Expected = Before


@pytest.mark.parametrize("seq", [1, 5, 11])
def test_position_ids_numerics(seq):
    """Before and after the rewrite give the same rows, at several sequence lengths."""
    rng = np.random.default_rng(seq)
    ids = rng.integers(0, 16, (3, seq)).astype("int64")
    table = rng.standard_normal((16, 4)).astype("float32")
    for case in (TestPositionIdsSlice, TestPositionIdsExpanded):
        with collect_rewrites() as counts:
            compare_pipelines(case.Before, [ids, table])
        assert counts.get("GatherToSlice") == 1


class TestTakeBackwardPad(GatherBase):
    """take_backward of a contiguous static range is a zero padding of the gradient."""

    @I.ir_module
    class Before:
        @R.function
        def main(g: R.Tensor((2, 4), "float32"), x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                idx = R.arange(3, 7, 1, dtype="int64")
                y = R.grad.take_backward(g, x, idx, axis=1)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(g: R.Tensor((2, 4), "float32"), x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                y = R.nn.pad(g, [0, 0, 3, 3])
                R.output(y)
            return y


class TestTakeBackward(GatherBase):
    """What Gradient makes of a take: take_backward with a strided arange becomes a
    slice_scatter."""

    @I.ir_module
    class Before:
        @R.function
        def main(g: R.Tensor((2, 4), "float32"), x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                idx = R.arange(1, 9, 2, dtype="int64")
                y = R.grad.take_backward(g, x, idx, axis=1)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(g: R.Tensor((2, 4), "float32"), x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                base = R.zeros_like(x)
                y = R.slice_scatter(base, g, 1, 8, 2, axis=1)
                R.output(y)
            return y


class TestTakeBackwardDynamic(GatherBase):
    """Dynamic klen: the scatter ends at klen."""

    @I.ir_module
    class Before:
        @R.function
        def main(g: R.Tensor(("b", "klen"), "float32"), x: R.Tensor(("b", "w"), "float32")):
            klen = T.int64()
            with R.dataflow():
                idx = R.arange(0, klen, 1, dtype="int64")
                y = R.grad.take_backward(g, x, idx, axis=1)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(g: R.Tensor(("b", "klen"), "float32"), x: R.Tensor(("b", "w"), "float32")):
            klen = T.int64()
            with R.dataflow():
                base = R.zeros_like(x)
                y = R.slice_scatter(base, g, 0, klen, 1, axis=1)
                R.output(y)
            return y


class TestNoFireTakeBackwardRepeated(GatherBase):
    """Repeated indices: the gradient must add them up, a scatter-add stays."""

    @I.ir_module
    class Before:
        @R.function
        def main(g: R.Tensor((2, 3), "float32"), x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                idx = R.const(np.array([3, 3, 3], "int64"), "int64")
                y = R.grad.take_backward(g, x, idx, axis=1)
                R.output(y)
            return y

    Expected = Before


class TestNoFireRepeated(GatherBase):
    """Repeated indices are a gather, not a slice."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                y = R.take(x, R.const(np.array([3, 3, 3], "int64"), "int64"), axis=1)
                R.output(y)
            return y

    Expected = Before


class TestNoFireNotProgression(GatherBase):
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                y = R.take(x, R.const(np.array([0, 1, 3], "int64"), "int64"), axis=1)
                R.output(y)
            return y

    Expected = Before


class TestNoFireNegative(GatherBase):
    """Negative indices without the importer's normalisation: left to take's own semantics."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                idx = R.arange(-2, 3, 1, dtype="int64")
                y = R.take(x, idx, axis=1, mode="wrap")
                R.output(y)
            return y

    Expected = Before


class TestNoFireClipUnproven(GatherBase):
    """mode="clip" with an upper bound that may exceed the axis must keep clipping."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, "w"), "float32"), k: R.Tensor(("klen",), "float32")):
            klen = T.int64()
            with R.dataflow():
                idx = R.arange(0, klen, 1, dtype="int64")
                y = R.take(x, idx, axis=1, mode="clip")
                R.output(y)
            return y

    Expected = Before


class TestNoFireOutOfRange(GatherBase):
    """A constant index past the axis: take(fast) is undefined there; leave it alone."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float32")):
            with R.dataflow():
                idx = R.arange(2, 6, 1, dtype="int64")
                y = R.take(x, idx, axis=1)
                R.output(y)
            return y

    Expected = Before


class TestNoFireMisdeclaredArange(GatherBase):
    """0.27 declares R.arange(7, 0, -1) with 9 elements (it computes 7): not trusted."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                idx = R.arange(7, 0, -1, dtype="int64")
                y = R.take(x, idx, axis=1)
                R.output(y)
            return y

    Expected = Before


class TestNoFire2DIndex(GatherBase):
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                y = R.take(x, R.const(np.array([[0, 1], [2, 3]], "int64"), "int64"), axis=1)
                R.output(y)
            return y

    Expected = Before


# ---------------------------------------------------------------------------------------------
# Numerics, counts, fusion, gradient


@pytest.mark.parametrize(
    "start, stop, step, as_const",
    [
        (0, 8, 1, False),
        (1, 9, 2, False),
        (3, 4, 1, False),
        (9, -1, -3, True),
        (7, 0, -1, True),
        (8, 2, -2, True),
    ],
)
def test_numerics_vs_stock(start, stop, step, as_const):
    """Negative steps as constants: 0.27's R.arange declares a wrong length for them."""
    x = relax.Var("x", relax.TensorType((3, 10), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            idx = (
                relax.const(np.arange(start, stop, step, dtype="int64"), "int64")
                if as_const
                else bb.emit(relax.op.arange(start, stop, step, "int64"))
            )
            y = bb.emit(relax.op.take(x, idx, axis=1))
            out = bb.emit_output(relax.op.multiply(y, relax.const(2.0, "float32")))
        bb.emit_func_output(out)
    mod = bb.get()
    data = np.random.default_rng(0).standard_normal((3, 10)).astype("float32")
    with collect_rewrites() as counts:
        ours, _ = compare_pipelines(
            mod,
            [data],
            rtol=0,
            atol=0,
            reference=[np.take(data, np.arange(start, stop, step), 1) * 2],
        )
    assert counts["GatherToSlice"] == 1


def test_workload_fuses_and_counts(target):
    inst = models.build("take_arange", "small")
    report = analysis.fusion_report(inst.mod, target)
    assert report.rewrites == {"GatherToSlice": 1}
    assert report.stock_kernels == 2 and report.ours_kernels == 1
    ours, _ = compare_pipelines(
        inst.mod,
        inst.input_list(),
        rtol=1e-6,
        atol=1e-6,
        reference=inst.reference(*inst.input_list()),
    )


def test_onnx_range_gather_end_to_end():
    inst = models.build("take_arange", "small")
    mod = tvm_fusion.load_onnx(inst.onnx_model)
    with collect_rewrites() as counts:
        compare_pipelines(
            mod,
            inst.input_list(),
            rtol=1e-6,
            atol=1e-6,
            reference=inst.reference(*inst.input_list()),
        )
    assert counts["GatherToSlice"] == 1


def test_disabled_by_pass_context_and_flag(target):
    inst = models.build("take_arange", "small")
    with tvm.transform.PassContext(disabled_pass=["GatherToSlice"]):
        report = analysis.fusion_report(inst.mod, target)
    assert report.rewrites == {} and report.ours_kernels == 2
    report = analysis.fusion_report(inst.mod, target, gather_to_slice=False)
    assert report.rewrites == {}


def test_gradient_after_rewrite_matches_stock_take():
    """relax.transform.Gradient works on the slice (registered by tvm_fusion) and agrees with
    the stock gradient of take."""
    x = relax.Var("x", relax.TensorType((3, 12), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            idx = bb.emit(relax.op.arange(1, 11, 3, "int64"))
            y = bb.emit(relax.op.take(x, idx, axis=1))
            out = bb.emit_output(relax.op.sum(relax.op.multiply(y, y)))
        bb.emit_func_output(out)
    mod = bb.get()
    sliced = GatherToSlice()(mod)
    assert "strided_slice" in sliced.script()
    data = np.random.default_rng(1).standard_normal((3, 12)).astype("float32")
    grads = []
    for m in (mod, sliced):
        g = relax.transform.Gradient("main")(m)
        ex = tvm.compile(g, tvm_fusion.host_target(), relax_pipeline="tvm_fusion")
        vm = relax.VirtualMachine(ex, tvm.cpu())
        _, (grad,) = vm["main_adjoint"](tvm.runtime.tensor(data))
        grads.append(grad.numpy())
    expect = np.zeros_like(data)
    expect[:, 1:11:3] = 2 * data[:, 1:11:3]
    np.testing.assert_allclose(grads[0], expect, rtol=1e-6)
    np.testing.assert_allclose(grads[1], expect, rtol=1e-6)


@pytest.mark.parametrize(
    ("start", "stop", "step"), [(1, 11, 3), (10, 0, -2), (11, -1, -3), (2, 9, 1), (0, 12, 1)]
)
def test_gradient_before_the_pass_matches_stock(start, stop, step):
    """Gradient first (take_backward in the graph), then our pipeline: the scatter-add becomes
    a slice_scatter and the gradient is unchanged."""
    wn = np.arange(len(range(start, stop, step)) * 3, dtype="float32").reshape(3, -1)
    x = relax.Var("x", relax.TensorType((3, 12), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            if step > 0:
                idx = bb.emit(relax.op.arange(start, stop, step, "int64"))
            else:  # R.arange infers a wrong length for negative steps in 0.27
                idx = relax.const(np.arange(start, stop, step), "int64")
            y = bb.emit(relax.op.take(x, idx, axis=1))
            out = bb.emit_output(relax.op.sum(relax.op.multiply(y, relax.const(wn))))
        bb.emit_func_output(out)
    grad_mod = relax.transform.Gradient("main")(bb.get())
    rewritten = GatherToSlice()(grad_mod)
    assert "take_backward" not in rewritten.script()
    data = np.random.default_rng(1).standard_normal((3, 12)).astype("float32")
    expect = np.zeros_like(data)
    expect[:, list(range(start, stop, step))] = wn
    for pipeline in ("default", "tvm_fusion"):
        ex = tvm.compile(grad_mod, tvm_fusion.host_target(), relax_pipeline=pipeline)
        vm = relax.VirtualMachine(ex, tvm.cpu())
        _, (grad,) = vm["main_adjoint"](tvm.runtime.tensor(data))
        np.testing.assert_allclose(grad.numpy(), expect, rtol=1e-6)


if __name__ == "__main__":
    tvm.testing.main()
