"""KeepLayoutFreeWeights: the layout-free mark stays on GEMM weights only (a bias marked
layout-free got a non-bijective layout from MetaSchedule's RewriteLayout and tuned to wrong
numbers). AttachLayoutFreeBuffers: a PrimFunc with nothing to mark is not copied (the stock
pass's copy of a symbolic cumsum did not build)."""

import numpy as np
import tvm
from helpers import run
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvm_fusion
from tvm_fusion import models
from tvm_fusion.build import pipeline, tuning
from tvm_fusion.schedule import AttachLayoutFreeBuffers, KeepLayoutFreeWeights


def _gemm_bias(layout_free):
    @I.ir_module
    class Module:
        @T.prim_func(s_tir=True)
        def main(
            x: T.Buffer((4, 8), "float32"),
            w: T.Buffer((8, 6), "float32"),
            c: T.Buffer((6,), "float32"),
            out: T.Buffer((4, 3), "float32"),
        ):
            T.func_attr({"layout_free_buffers": layout_free, "tirx.noalias": True})
            y = T.sblock_alloc_buffer((4, 6))
            for i, j, k in T.grid(4, 6, 8):
                with T.sblock("gemm"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        y[vi, vj] = T.float32(0)
                    y[vi, vj] = y[vi, vj] + x[vi, vk] * w[vk, vj]
            for i, j in T.grid(4, 3):
                with T.sblock("gate"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    out[vi, vj] = (y[vi, vj] + c[vj]) * (y[vi, vj + 3] + c[vj + 3])

    return Module


def _shared_weight(layout_free):
    @I.ir_module
    class Module:
        @T.prim_func(s_tir=True)
        def main(
            x: T.Buffer((4, 8), "float32"),
            w: T.Buffer((8, 8), "float32"),
            out: T.Buffer((4, 8), "float32"),
        ):
            T.func_attr({"layout_free_buffers": layout_free, "tirx.noalias": True})
            y = T.sblock_alloc_buffer((4, 8))
            for i, j, k in T.grid(4, 8, 8):
                with T.sblock("gemm0"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        y[vi, vj] = T.float32(0)
                    y[vi, vj] = y[vi, vj] + x[vi, vk] * w[vk, vj]
            for i, j, k in T.grid(4, 8, 8):
                with T.sblock("gemm1"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        out[vi, vj] = T.float32(0)
                    out[vi, vj] = out[vi, vj] + y[vi, vk] * w[vk, vj]

    return Module


def test_bias_loses_the_mark_weight_keeps_it():
    after = KeepLayoutFreeWeights()(_gemm_bias([1, 2]))
    tvm.ir.assert_structural_equal(after, _gemm_bias([1]))


def test_weights_only_is_left_alone():
    before = _gemm_bias([1])
    assert KeepLayoutFreeWeights()(before).same_as(before)


def test_weight_read_by_two_blocks_loses_the_mark():
    after = KeepLayoutFreeWeights()(_shared_weight([1]))
    assert "layout_free_buffers" not in after["main"].attrs


def test_gate_group_marks_its_weight_not_its_bias():
    inst = models.build("gate_2890", "small")
    fused = tuning.fused_module(inst.mod, tvm_fusion.host_target())
    (gate,) = [
        f
        for gv, f in fused.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and f.attrs.get("tvm_fusion.gate_fusion", None)
    ]
    names = [p.name for p in gate.params]
    assert [names[int(i)] for i in gate.attrs["layout_free_buffers"]] == ["B"], names


@I.ir_module
class _CumsumOfMask:
    @R.function
    def main(m: R.Tensor(("b", "s"), "int64"), w: R.Tensor((8, 4), "float32")):
        with R.dataflow():
            pos = R.multiply(R.cumsum(m, axis=1), m)
            y = R.matmul(w, R.const(np.ones((4, 2), "float32")))
            R.output(pos, y)
        return pos, y


def _legalized():
    target = tvm_fusion.host_target()
    with target:
        seq = tvm.transform.Sequential(
            [
                *pipeline._backend(target).library_dispatch_passes(target),
                relax.transform.LegalizeOps(),
            ]
        )
        return seq(_CumsumOfMask)


def test_attach_keeps_unmarked_prim_funcs_as_they_were():
    """OPT's positions: the stock pass's ``renew_defs`` left the vars of the symbolic cumsum's
    output layout undefined (MakePackedAPI: "variables (b, s) are used, but are not passed in
    as API arguments"); a PrimFunc with nothing to mark is kept, the constant weight marked."""
    before = _legalized()
    after = AttachLayoutFreeBuffers()(before)
    funcs = {
        gv.name_hint: f for gv, f in after.functions_items() if isinstance(f, tvm.tirx.PrimFunc)
    }
    (cumsum,) = [f for name, f in funcs.items() if name.startswith("cumsum")]
    assert cumsum.body.same_as(before["cumsum"].body)
    assert list(cumsum.attrs["layout_free_buffers"]) == []
    (matmul,) = [f for name, f in funcs.items() if name.startswith("matmul")]
    assert [int(i) for i in matmul.attrs["layout_free_buffers"]] == [1]


def test_symbolic_cumsum_compiles_and_matches():
    mask = np.ones((3, 7), "int64")
    mask[-1, :2] = 0
    w = np.random.default_rng(0).standard_normal((8, 4)).astype("float32")
    (pos, y), _ = run(_CumsumOfMask, [mask, w])
    np.testing.assert_array_equal(pos, np.cumsum(mask, axis=1) * mask)
    np.testing.assert_allclose(y, w @ np.ones((4, 2), "float32"), rtol=1e-6)
