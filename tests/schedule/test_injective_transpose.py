"""The CPU injective rule on a transposing copy (``block_transpose``): ``y[c, h, w] = x[h, w, c]``
read one element per cache line for each step of ``w``; the loop over ``c`` is split by the
target's lanes and its inner part moved just outside the innermost loop, so one pass over ``w``
reads ``lanes`` neighbours of every line it touches. StemChannelsLast's transpose of the pooled
stem (55 x 55 x 64 -> 64 x 55 x 55) took 122 us, 34 this way (AVX-512, two threads).
Compile-only checks follow the target's lanes; the numbers run on the host."""

import numpy as np
import pytest
import tvm
from helpers import fused_prim_funcs, run
from tvm import relax
from tvm.relax import op as R

from tvm_fusion import target as _target
from tvm_fusion import tir_util
from tvm_fusion.schedule import cpu
from tvm_fusion.schedule.cpu.injective import block_transpose, transposed_read

RNG = np.random.default_rng(7)


def _module(shape, perm, add=False):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = R.permute_dims(x, perm) if perm else x
            if add:
                y = R.add(y, relax.const(np.float32(1)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _scheduled(mod, target):
    (func,) = fused_prim_funcs(mod, target, layout_free=False)
    sch = cpu.Injective().apply(func, target, False)
    assert sch is not None
    return sch.mod["main"]


def _serial_extents(func) -> list[int]:
    return [
        int(lp.extent)
        for lp in tir_util.loops(func)
        if lp.kind == tvm.tirx.ForKind.SERIAL and isinstance(lp.extent, tvm.tirx.IntImm)
    ]


def test_nhwc_to_nchw_channels_tiled(cpu_target):
    """64 channels: an inner channel loop of the target's lanes (16 on AVX-512, 8 on AVX2, 4
    on SSE / NEON) sits outside the width's vector loops."""
    lanes = _target.vector_lanes(cpu_target, "float32")
    func = _scheduled(_module((1, 55, 55, 64), [0, 3, 1, 2]), cpu_target)
    assert lanes in _serial_extents(func)
    loops = tir_util.loops(func)
    vector = [i for i, lp in enumerate(loops) if lp.kind == tvm.tirx.ForKind.VECTORIZED]
    inner_c = [i for i, lp in enumerate(loops) if lp.kind == tvm.tirx.ForKind.SERIAL
               and isinstance(lp.extent, tvm.tirx.IntImm) and int(lp.extent) == lanes]  # fmt: skip
    assert vector and inner_c and inner_c[0] < vector[0]


def _block(func):
    sch = tvm.s_tir.Schedule(func)
    (block,) = [b for b in tir_util.blocks(func) if b.name_hint != "root"]
    return sch, sch.get_sblock(block.name_hint)


@pytest.mark.parametrize(
    "shape,perm",
    [((2, 3, 4, 5), None), ((1, 64, 13, 13), [0, 2, 3, 1]), ((8, 24), None)],
    ids=["elementwise", "nchw_to_nhwc_channels_inner", "2d_plain"],
)
def test_left_alone(shape, perm):
    """No transposed read (elementwise), or one whose read's innermost index is driven by the
    loop just outside the innermost (NCHW -> NHWC: ``w`` then ``c``): nothing to move."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    (func,) = fused_prim_funcs(_module(shape, perm, add=perm is None), target, layout_free=False)
    sch, block = _block(func)
    before = sch.mod["main"]
    assert block_transpose(sch, block, 16) is False
    tvm.ir.assert_structural_equal(sch.mod["main"], before)


def test_transposed_read_found():
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    (func,) = fused_prim_funcs(_module((1, 9, 9, 32), [0, 3, 1, 2]), target, layout_free=False)
    sch, block = _block(func)
    assert transposed_read(sch, block) == 1  # the channel loop
    (func,) = fused_prim_funcs(_module((1, 9, 9, 32), None, add=True), target, layout_free=False)
    sch, block = _block(func)
    assert transposed_read(sch, block) is None


@pytest.mark.parametrize(
    "shape,perm",
    [
        ((1, 55, 55, 64), [0, 3, 1, 2]),
        ((2, 7, 9, 24), [0, 3, 1, 2]),  # 24 channels: no whole split by 16 lanes
        ((1, 13, 13, 5), [0, 3, 1, 2]),  # fewer channels than lanes
        ((3, 40, 33), [0, 2, 1]),
        ((1, 16, 55, 55), [0, 2, 3, 1]),
    ],
)
def test_numbers_match_numpy(target, shape, perm):
    x = RNG.standard_normal(shape).astype("float32")
    out, _ = run(_module(shape, perm, add=True), [x], "tvm_fusion", target=target)
    np.testing.assert_array_equal(out[0], np.transpose(x, perm) + np.float32(1))


def test_symbolic_batch_matches_numpy(target):
    n = tvm.tirx.Var("n", "int64")
    mod = _module((n, 11, 11, 32), [0, 3, 1, 2], add=True)
    x = RNG.standard_normal((3, 11, 11, 32)).astype("float32")
    out, _ = run(mod, [x], "tvm_fusion", target=target)
    np.testing.assert_array_equal(out[0], np.transpose(x, [0, 3, 1, 2]) + np.float32(1))
