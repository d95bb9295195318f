"""PlaceShapeOnHost: shape arithmetic on int tensors becomes symbolic shapes (no kernels, no
device-to-host copies): reshape targets and slice bounds computed from Shape, a Range limit read
from a shape, slices to the end of a symbolic axis or within the function's dim bounds.

Must not fire: a shape value that also feeds arithmetic on data keeps its kernel; slices whose
extent is already plain. The run-time reads (shape inputs, values computed from data) are tested
in test_place_shape_on_host_reads.py, ONNX models against ONNX Runtime in
test_place_shape_on_host_onnx.py.
"""

import numpy as np
import pytest
import tvm
from place_shape_on_host_common import ShapeBase
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion import analysis, host_target
from tvm_fusion.build import engine


class TestReshapeTarget(ShapeBase):
    """Shape -> Gather -> Mul -> Concat -> Reshape (symbolic batch and seq): the target becomes
    R.shape([batch * seq, 3, 4]) and the int64 chain disappears."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("batch", "seq", 12), "float32")):
            batch, seq = T.int64(), T.int64()
            m = T.int64()
            with R.dataflow():
                shp = R.shape_to_tensor(R.shape_of(x))
                b = R.take(shp, R.const([0], "int64"), axis=0)
                s = R.take(shp, R.const([1], "int64"), axis=0)
                bs = R.multiply(b, s)
                target = R.concat((bs, R.const([3, 4], "int64")), axis=0)
                new_shape = R.tensor_to_shape(target)
                cast = R.match_cast(new_shape, R.Shape([m, 3, 4]))
                y = R.reshape(x, R.shape([m, 3, 4]))
                z = R.nn.relu(y)
                R.output(z)
            return z

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("batch", "seq", 12), "float32")):
            batch, seq = T.int64(), T.int64()
            with R.dataflow():
                new_shape = R.shape([batch * seq, 3, 4])
                cast = R.match_cast(new_shape, R.Shape([batch * seq, 3, 4]))
                y = R.reshape(x, R.shape([batch * seq, 3, 4]))
                z = R.nn.relu(y)
                R.output(z)
            return z


class TestSliceBounds(ShapeBase):
    """dynamic_strided_slice with ends = shape / 2 becomes strided_slice with symbolic bounds
    (provably within the input: 0 <= n // 2 <= n)."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 8), "float32")) -> R.Tensor(dtype="float32", ndim=2):
            n = T.int64()
            with R.dataflow():
                shp = R.shape_to_tensor(R.shape_of(x))
                half = R.floor_divide(shp, R.const(2, "int64"))
                y = R.dynamic_strided_slice(
                    x, R.const([0, 0], "int64"), half, R.const([1, 1], "int64")
                )
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("n", 8), "float32")) -> R.Tensor(dtype="float32", ndim=2):
            n = T.int64()
            with R.dataflow():
                y = R.strided_slice(x, [0, 1], [0, 0], [n // 2, 4], [1, 1], assume_inbound=True)
                R.output(y)
            return y


class TestSliceToEnd(ShapeBase):
    """``x[:, 1:]`` as exporters write it (end INT64_MAX) has the extent
    ``min(INT64_MAX, 2 * n) - min(1, 2 * n)``; it is matched to ``2 * n - 1``, so that a reshape
    of the slice (XLNet's rel_shift) keeps its element count provably."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", "n * 2"), "float32")):
            n = T.int64()
            with R.dataflow():
                y = R.strided_slice(x, [1], [1], [9223372036854775807], [1])
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("n", "n * 2"), "float32")):
            n = T.int64()
            with R.dataflow():
                lv = R.strided_slice(x, [1], [1], [9223372036854775807], [1])
                lv1 = R.match_cast(lv, R.Tensor((n, n * 2 - 1), "float32"))
                y: R.Tensor((n, n * 2 - 1), "float32") = lv1
                R.output(y)
            return y


class TestSliceToEndNotFired(ShapeBase):
    """From 0, or to a bounded end, or over a static axis: the extent is already plain."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 8), "float32"), z: R.Tensor(("n",), "float32")):
            with R.dataflow():
                a = R.strided_slice(x, [1], [1], [9223372036854775807], [1])
                b = R.strided_slice(z, [0], [0], [9223372036854775807], [1])
                c = R.strided_slice(z, [0], [1], [3], [1])
                R.output(a, b, c)
            return (a, b, c)

    Expected = Before


class TestSliceWithinBound(ShapeBase):
    """``pos[:, :s]`` of a (1, 16) buffer is inferred ``min(s, 16)`` long, which does not unify
    with ``s`` (the add's shape was unknown: no pipeline built ALBERT); the function's bound
    ``s <= 16`` (torch.export's ``Dim(max=16)``) proves it in bounds: ``assume_inbound``."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", "s"), "float32"), pos: R.Tensor((1, 16), "float32")):
            R.func_attr({"tir_var_upper_bound": {"s": 16}})
            s = T.int64()
            with R.dataflow():
                p = R.strided_slice(pos, [1], [0], [s], [1])
                y = R.add(x, p)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("b", "s"), "float32"), pos: R.Tensor((1, 16), "float32")):
            R.func_attr({"tir_var_upper_bound": {"s": 16}})
            b, s = T.int64(), T.int64()
            with R.dataflow():
                p = R.strided_slice(pos, [1], [0], [s], [1], assume_inbound=True)
                y: R.Tensor((b, s), "float32") = R.add(x, p)
                R.output(y)
            return y


class TestSliceWithinBoundNotFired(ShapeBase):
    """Must not fire: a bound above the axis (``s <= 17`` of 16), and no bound at all."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", "s"), "float32"), pos: R.Tensor((1, 16), "float32")):
            R.func_attr({"tir_var_upper_bound": {"s": 17}})
            s = T.int64()
            with R.dataflow():
                p = R.strided_slice(pos, [1], [0], [s], [1])
                R.output(p)
            return p

        @R.function
        def unbounded(pos: R.Tensor((1, 16), "float32"), x: R.Tensor(("s",), "float32")):
            s = T.int64()
            with R.dataflow():
                p = R.strided_slice(pos, [1], [0], [s], [1])
                R.output(p)
            return p

    Expected = Before


def test_position_buffer_slice_torch_export():
    """Found by scripts/holdout.py (ALBERT through torch.export): a position-id buffer sliced
    to the sequence length, added to the embeddings, builds and matches torch."""
    torch = pytest.importorskip("torch")

    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("position_ids", torch.arange(16).expand((1, -1)))
            self.pos = torch.nn.Embedding(16, 6)

        def forward(self, x):
            return x + self.pos(self.position_ids[:, : x.shape[1]])

    from tvm.relax.frontend.torch import from_exported_program

    torch.manual_seed(0)
    module = Embed().eval()
    dims = {0: torch.export.Dim("b", max=8), 1: torch.export.Dim("s", max=16)}
    program = torch.export.export(module, (torch.randn(2, 5, 6),), dynamic_shapes=(dims,))
    compiled = engine.compile_module(from_exported_program(program), host_target(), "tvm_fusion")
    for shape in [(3, 7, 6), (1, 16, 6)]:
        data = np.random.default_rng(1).standard_normal(shape).astype("float32")
        got = compiled.vm()["main"](tvm.runtime.tensor(data))[0].numpy()
        want = module(torch.from_numpy(data)).detach().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_slice_to_end_numerics():
    """The matched slice computes the same numbers (the pipeline, llvm)."""
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, n * 2], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.strided_slice(x, [1], [1], [9223372036854775807], [1]))
            out = bb.emit_output(relax.op.reshape(y, relax.ShapeExpr([n * 2 - 1, n])))
        bb.emit_func_output(out)
    compiled = engine.compile_module(bb.get(), host_target(), "tvm_fusion")
    data = np.arange(3 * 6, dtype="float32").reshape(3, 6)
    got = compiled.vm()["main"](tvm.runtime.tensor(data)).numpy()
    np.testing.assert_array_equal(got, data[:, 1:].reshape(5, 3))


class TestSliceClampedBegin(ShapeBase):
    """``x[:, 1:2 * n]`` with the begin clamped by the importer to the symbolic end
    (``min(1, 2 * n)``, XLNet's rel_shift through onnx_ops.Slice) has the extent
    ``max(2 * n - 1, 0)``; it is matched to ``2 * n - 1`` like a slice to the end."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", "n * 2"), "float32")):
            n = T.int64()
            with R.dataflow():
                y = R.strided_slice(x, [1], [T.min(1, n * 2)], [n * 2], [1], assume_inbound=True)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("n", "n * 2"), "float32")):
            n = T.int64()
            with R.dataflow():
                lv = R.strided_slice(x, [1], [T.min(1, n * 2)], [n * 2], [1], assume_inbound=True)
                lv1 = R.match_cast(lv, R.Tensor((n, n * 2 - 1), "float32"))
                y: R.Tensor((n, n * 2 - 1), "float32") = lv1
                R.output(y)
            return y


class TestSliceClampedBeginNotFired(ShapeBase):
    """The begin clamped to another value than the end, or an end not within the axis: the
    extent stays as inferred."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", "n * 2"), "float32"), y: R.Tensor(("m",), "float32")):
            n, m = T.int64(), T.int64()
            with R.dataflow():
                a = R.strided_slice(x, [1], [T.min(1, m)], [n * 2], [1], assume_inbound=True)
                b = R.strided_slice(x, [1], [T.min(1, m)], [m], [1], assume_inbound=True)
                R.output(a, b)
            return (a, b)

    Expected = Before


def test_slice_clamped_begin_numerics():
    """The matched slice and the reshape after it (now a view) compute the same numbers."""
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, n * 2], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            begin, end = tirx.min(tirx.IntImm("int64", 1), n * 2), n * 2
            y = bb.emit(relax.op.strided_slice(x, [1], [begin], [end], [1], assume_inbound=True))
            out = bb.emit_output(relax.op.reshape(y, relax.ShapeExpr([n * 2 - 1, n])))
        bb.emit_func_output(out)
    compiled = engine.compile_module(bb.get(), host_target(), "tvm_fusion")
    assert analysis.kernel_count(compiled.lowered) == 1  # the slice; the reshape is a view
    data = np.arange(3 * 6, dtype="float32").reshape(3, 6)
    got = compiled.vm()["main"](tvm.runtime.tensor(data)).numpy()
    np.testing.assert_array_equal(got, data[:, 1:].reshape(5, 3))


class TestShapeFeedsData(ShapeBase):
    """size(x) divides data: there is no shape consumer, nothing to rewrite."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 4), "float32")):
            with R.dataflow():
                size = R.astype(R.size(x), "float32")
                y = R.divide(x, size)
                R.output(y)
            return y

    Expected = Before


class TestArangeLimit(ShapeBase):
    """Range(0, seq) via tensor_to_shape + match_cast to a fresh dim: the dim is bound to seq
    and the ops after it get known shapes (the importer left R.Tensor(ndim=2))."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("batch", "seq"), "float32")):
            batch, seq = T.int64(), T.int64()
            r = T.int64()
            with R.dataflow():
                s = R.take(R.shape_to_tensor(R.shape_of(x)), R.const([1], "int64"), axis=0)
                limit = R.tensor_to_shape(s)
                cast = R.match_cast(limit, R.Shape([r]))
                pos = R.astype(R.arange(0, r, 1, dtype="int64"), "float32")
                y: R.Tensor(dtype="float32", ndim=2) = R.add(x, pos)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("batch", "seq"), "float32")):
            batch, seq = T.int64(), T.int64()
            with R.dataflow():
                limit = R.shape([seq])
                cast = R.match_cast(limit, R.Shape([seq]))
                lv = R.arange(0, seq, 1, dtype="int64")
                pos = R.astype(lv, "float32")
                y: R.Tensor((batch, seq), dtype="float32") = R.add(x, pos)
                R.output(y)
            return y


def test_pipeline_flag_switches_it_off():
    mod = TestReshapeTarget.Before
    seq = relax.get_pipeline("tvm_fusion", target=host_target(), place_shape_on_host=False)
    with host_target():
        lowered = seq(mod)
    assert analysis.shape_work(lowered).kernels  # the int64 chain is kernels again
