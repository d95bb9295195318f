"""A 1x1 convolution's reduction in blocks of input channels on AVX2
(``_conv.pointwise_k_block``): Inception v2's 576->128 at 14 x 14 streamed its 36 KiB weight
panel from L2 for every tile of 4 rows; in blocks of 192 channels each block stays in L1 (0.72-
0.81x the time at 576->128 and 576->224, Zen 3, 2 threads, alternating). Checked on the
schedule (the channel loop split) and on the numbers against numpy at odd sizes."""

import numpy as np
import pytest
import tvm
from helpers import fused_prim_funcs, run
from tvm import relax
from tvm.relax import op as R

from tvm_fusion import tir_util
from tvm_fusion.schedule import cpu
from tvm_fusion.schedule.cpu._conv import pointwise_k_block

RNG = np.random.default_rng(39)
AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})


@pytest.mark.parametrize(
    "k,panels,expected",
    [
        (576, [1, 8], 192),  # Inception v2's 576 -> 128 (8 panels of 16)
        (320, [2], 160),
        (1000, [8], 200),
        (256, [8], None),  # short enough: one block
        (260, [8], None),  # no multiple of 8 divides it
        (576, [3], None),  # 3 panels on 2 cores: one idle half the time
        (576, [9], 192),  # 4 panels a core or more
        (576, [1], None),  # one panel: a core idle
    ],
)
def test_pointwise_k_block(k, panels, expected):
    assert pointwise_k_block(k, panels, 2) == expected


def _module(w, bias, shape):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = R.nn.conv2d(x, relax.const(w))
            y = R.nn.relu(R.add(y, relax.const(bias.reshape(1, -1, 1, 1))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("hw", [7, 13])
def test_conv1x1_reduction_blocked_on_avx2(hw):
    """320 input channels, 32 output channels (2 panels of 2 vectors) at 7 x 7 (49 rows, padded
    through the flat copies) and 13 x 13: the channel loop runs in 2 blocks of 160, not one
    loop of 320 (only the copies keep one); the numbers equal numpy's (batch 2 of a symbolic
    batch)."""
    w = (RNG.standard_normal((32, 320, 1, 1)) / 16).astype("float32")
    bias = RNG.standard_normal(32).astype("float32")
    mod = _module(w, bias, (tvm.tirx.Var("batch", "int64"), 320, hw, hw))
    (func,) = fused_prim_funcs(mod, AVX2, containing="conv")
    sch = cpu.Matmul().apply(func, AVX2, False)
    assert sch is not None
    loops = tir_util.loops(sch.mod["main"])
    extents = [int(lp.extent) for lp in loops if isinstance(lp.extent, tvm.tirx.IntImm)]
    assert 160 in extents, extents  # the reduction over 320 channels in 2 blocks
    x = RNG.standard_normal((2, 320, hw, hw)).astype("float32")
    y = np.maximum(np.einsum("fc,nchw->nfhw", w[:, :, 0, 0], x) + bias.reshape(1, -1, 1, 1), 0)
    out, _ = run(mod, [x], "tvm_fusion", target=AVX2)
    np.testing.assert_allclose(out[0], y, rtol=1e-4, atol=1e-4)
