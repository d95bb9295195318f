"""PlaceShapeOnHost, the run-time reads: shape tensors that are graph inputs are read once, on
the host; values computed from data (an argmax, a mask's longest row) are read once, and on CUDA
the small ops before the read run on the host VDevice. Must not fire: an int tensor of run-time
length computed from data.
"""

import numpy as np
import tvm
from place_shape_on_host_common import CUDA, ShapeBase
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion import analysis, host_target
from tvm_fusion.build import engine
from tvm_fusion.transform import PlaceShapeOnHost, collect_rewrites


class TestDataDependentTarget(ShapeBase):
    """A reshape target computed from data (argmax) exists only at run time: it is read once
    (tensor_to_shape + fresh dims) and the arithmetic after it becomes symbolic."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 6), "float32"), k: R.Tensor((2, 3), "float32")):
            a, b = T.int64(), T.int64()
            with R.dataflow():
                idx = R.argmax(k, axis=1)
                target = R.add(idx, R.const([4, 6], "int64"))
                new_shape = R.tensor_to_shape(target)
                cast = R.match_cast(new_shape, R.Shape([a, b]))
                y = R.reshape(x, R.shape([a, b]))
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 6), "float32"), k: R.Tensor((2, 3), "float32")):
            idx_0, idx_1 = T.int64(), T.int64()
            with R.dataflow():
                idx = R.argmax(k, axis=1)
                lv = R.tensor_to_shape(idx)
                lv1 = R.match_cast(lv, R.Shape([idx_0, idx_1]))
                new_shape = R.shape([idx_0 + 4, idx_1 + 6])
                cast = R.match_cast(new_shape, R.Shape([idx_0 + 4, idx_1 + 6]))
                y = R.reshape(x, R.shape([idx_0 + 4, idx_1 + 6]))
                R.output(y)
            return y


class TestDataOfRunTimeLength(ShapeBase):
    """An int tensor computed from data whose length is symbolic (one argmax per row of a
    dynamic batch) is data, not a shape: left alone."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 6), "float32"), k: R.Tensor((3, "n"), "float32")):
            a = T.int64()
            with R.dataflow():
                idx = R.argmax(k, axis=0)
                new_shape = R.tensor_to_shape(idx)
                cast = R.match_cast(new_shape, R.Shape([a]))
                y = R.zeros(R.shape([a]), "float32")
                R.output(y)
            return y

    Expected = Before


def _mask_trim_module():
    """The longest row of an attention mask, sliced out of x (symbolic batch and seq)."""
    batch, seq = tirx.Var("batch", "int64"), tirx.Var("seq", "int64")
    x = relax.Var("x", relax.TensorType([batch, seq], "float32"))
    mask = relax.Var("mask", relax.TensorType([batch, seq], "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, mask]):
        with bb.dataflow():
            lens = bb.emit(relax.op.sum(mask, axis=[1]))
            narrow = bb.emit(relax.op.astype(lens, "int32"))
            longest = bb.emit(relax.op.max(narrow, keepdims=True))
            wide = bb.emit(relax.op.astype(longest, "int64"))
            rows = relax.op.take(
                relax.op.shape_to_tensor(relax.op.shape_of(x)), relax.const(np.array([0]), "int64")
            )
            end = bb.emit(relax.op.concat([rows, wide]))
            zero = relax.const(np.array([0, 0]), "int64")
            one = relax.const(np.array([1, 1]), "int64")
            y = bb.emit_output(relax.op.dynamic_strided_slice(x, zero, end, one))
        bb.emit_func_output(y)
    return bb.get()


def test_data_read_placed_on_the_host_for_cuda():
    """Part (b), CUDA build with an llvm host: the ops between the data and the shape read
    (cast, max over the per-row lengths) run on the host VDevice after one copy of the lengths;
    the slice gets PrimValue bounds. Structural, then the lowered module: the two host ops are
    llvm kernels kept apart by KeepHostKernelsApart (FuseOps would fuse them into a function
    without a target, which the GPU rules then schedule as a device kernel)."""
    mod = _mask_trim_module()
    got = PlaceShapeOnHost(CUDA)(mod)
    host = relax.VDevice(CUDA.host, 0, "global")
    batch, seq = mod["main"].params[1].ty.shape.values
    x = relax.Var("x", relax.TensorType([batch, seq], "float32"))
    mask = relax.Var("mask", relax.TensorType([batch, seq], "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, mask]):
        with bb.dataflow():
            lens = bb.emit(relax.op.sum(mask, axis=[1]))
            on_host = bb.emit(relax.op.to_vdevice(lens, host))
            narrow = bb.emit(relax.op.astype(on_host, "int32"))
            longest = bb.emit(relax.op.max(narrow, keepdims=True))
            wide = bb.emit(relax.op.astype(longest, "int64"))
            shape = bb.emit(relax.op.tensor_to_shape(wide))
            n = tirx.Var("longest_0", "int64")
            bb.match_cast(shape, relax.ShapeType([n]))
            y = bb.emit_output(relax.op.strided_slice(x, [1], [0], [n], [1]))
        bb.emit_func_output(y)
    expected = bb.get()
    expected.update_global_info("vdevice", [relax.VDevice(CUDA, 0, "global"), host])
    # the slice's inferred extent differs in form only: this builder assumes n >= 0, the pass
    # keeps ONNX's rule for a negative end (a value read from data may be negative)
    got_slice, want_slice = (m["main"].body.blocks[0].bindings[-1].value for m in (got, expected))
    tvm.ir.assert_structural_equal(got_slice.args, want_slice.args, map_free_vars=True)
    tvm.ir.assert_structural_equal(got.global_infos, expected.global_infos)
    got_main, want_main = (m["main"].body.blocks[0].bindings[:-1] for m in (got, expected))
    tvm.ir.assert_structural_equal(got_main, want_main, map_free_vars=True)

    lowered = engine.compile_module(mod, CUDA, "tvm_fusion").lowered
    host_kernels = [
        gv.name_hint
        for gv, f in lowered.functions_items()
        if isinstance(f, tirx.PrimFunc) and f.attrs.get("target") is not None
    ]
    assert len(host_kernels) == 3, host_kernels  # astype, max, astype: one llvm kernel each
    for name in host_kernels:
        assert "threadIdx" not in lowered[name].script()
    work = analysis.shape_work(lowered, CUDA)
    assert work.copies == 1 and len(work.kernels) == 1, work  # the lengths: kernel + copy
    stock = analysis.shape_work(engine.compile_module(mod, CUDA, "stock").lowered, CUDA)
    assert len(stock.kernels) >= 4 and stock.copies == 1, stock


def test_data_read_numerics_on_llvm():
    """The same module on llvm (no copies on a CPU): equal to numpy for two masks."""
    compiled = engine.compile_module(_mask_trim_module(), host_target(), "tvm_fusion")
    x = np.random.default_rng(1).standard_normal((3, 7)).astype("float32")
    for lengths in ([2, 5, 1], [7, 7, 3]):
        mask = (np.arange(7)[None, :] < np.array(lengths)[:, None]).astype("int64")
        out = engine.TvmRunner(compiled, [x, mask]).outputs()[0]
        np.testing.assert_array_equal(out, x[:, : max(lengths)])


def _shape_input_module():
    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor(("n", 12), "float32"), target: R.Tensor((2,), "int64")):
            a, b = T.int64(), T.int64()
            with R.dataflow():
                doubled = R.multiply(target, R.const([1, 2], "int64"))
                shape = R.tensor_to_shape(doubled)
                cast = R.match_cast(shape, R.Shape([a, b]))
                y = R.reshape(x, R.shape([a, b]))
                R.output(y)
            return y

    return Module


def test_shape_input_read_once_on_host():
    """A shape tensor that is a graph input: read once (tensor_to_shape + fresh dims), the
    arithmetic on it becomes symbolic, and on CUDA the input is declared a host tensor."""
    mod = _shape_input_module()
    with collect_rewrites() as counts:
        cpu = PlaceShapeOnHost(tvm.target.Target("llvm"))(mod)
    assert counts["PlaceShapeOnHost"] == 1
    text = cpu["main"].script()
    assert "R.multiply" not in text and text.count("tensor_to_shape") == 1
    assert "target_0, target_1 * 2" in text.replace("T.int64(2)", "2")
    gpu = PlaceShapeOnHost(CUDA)(mod)
    vdevice = gpu["main"].params[1].ty.vdevice
    assert vdevice is not None and vdevice.target.kind.name == "llvm"
    # numerics on llvm: (6, 12) read as (3, 2 * 12)
    x = np.arange(72, dtype="float32").reshape(6, 12)
    compiled = engine.compile_module(mod, host_target(), "tvm_fusion")
    out = engine.TvmRunner(compiled, [x, np.array([3, 12], "int64")]).outputs()[0]
    np.testing.assert_array_equal(out, x.reshape(3, 24))
    copies = analysis.shape_work(engine.compile_module(mod, CUDA, "tvm_fusion").lowered, CUDA)
    assert copies.copies == 0 and not copies.kernels
    stock = analysis.shape_work(engine.compile_module(mod, CUDA, "stock").lowered, CUDA)
    assert stock.copies == 1 and len(stock.kernels) == 1
