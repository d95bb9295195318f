"""A 1x1 convolution's reduction in blocks of input channels (``_conv.pointwise_k_block``):
Inception v2's 576->128 at 14 x 14 streamed its 36 KiB weight panel from L2 for every tile of 4
rows; in blocks of 192 channels each block stays in L1 (0.72-0.81x the time at 576->128 and
576->224, Zen 3, 2 threads, alternating). The block is sized on the panel's width (24 KiB of
it): on AVX-512 a panel of 32 floats takes blocks of at most 128 channels (SqueezeNet's
512->1000 at 13 x 13 0.89x the time, ResNet-50's 1024->256 at 14 x 14 0.85x, Intel Xeon, 2
threads). Checked on the schedule (the channel loop split) over the target matrix and on the
numbers against numpy at odd sizes."""

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


@pytest.mark.parametrize(
    "k,row_bytes,expected",
    [
        (512, 128, 128),  # AVX-512, 2 vectors of 16 floats: at most 192 (24 KiB / 128 B)
        (576, 128, 192),  # 3 blocks of 192
        (1000, 128, 40),  # the largest multiple of 8 up to 192 that divides 1000
        (192, 128, None),  # one block already
        (576, 96, 192),  # AVX2, 3 vectors of 8: at most 256, as before
        (576, 64, 192),  # AVX2, 2 vectors: at most 256
        (1024, 256, 64),  # a wide tile of 4 vectors of 16
        (1024, 4096, None),  # a panel too wide for any block of 8
    ],
)
def test_pointwise_k_block_follows_the_panel(k, row_bytes, expected):
    assert pointwise_k_block(k, [8], 2, row_bytes) == expected


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


def _k_extents(func, target):
    sch = cpu.Matmul().apply(func, target, False)
    assert sch is not None
    loops = tir_util.loops(sch.mod["main"])
    return sch, [int(lp.extent) for lp in loops if isinstance(lp.extent, tvm.tirx.IntImm)]


def _update_loops(sch):
    """(kind, extent) of the loops around the GEMM's update block."""
    (name,) = [b for b in tir_util.block_names(sch.mod["main"]) if b.endswith("_update")]
    loops = sch.get_loops(sch.get_sblock(name))
    return [(sch.get(lp).kind, int(sch.get(lp).extent)) for lp in loops]


@pytest.mark.parametrize("hw", [13, 7])
def test_reduction_block_follows_the_target(cpu_target, hw):
    """512 input channels, 64 output channels at 13 x 13 and 7 x 7 (the channels as vectors):
    the loops are ``panel, k block, row tile, k, row, vector`` and a k block is the largest
    multiple of 8 dividing 512 whose panel block (k x the panel's NR floats) is at most 24 KiB:
    128 on AVX-512 (panels of 2 x 16 floats), 256 on AVX2 (2 x 8). It follows the target's
    panel, not the host."""
    w = (RNG.standard_normal((64, 512, 1, 1)) / 16).astype("float32")
    bias = RNG.standard_normal(64).astype("float32")
    (func,) = fused_prim_funcs(_module(w, bias, (1, 512, hw, hw)), cpu_target, containing="conv")
    sch, _ = _k_extents(func, cpu_target)
    loops = _update_loops(sch)
    assert loops[-1][0] == tvm.tirx.ForKind.VECTORIZED, loops
    nr = loops[-1][1] * loops[-2][1]
    kc = loops[-4][1]
    most = min(256, 24 * 1024 // (nr * 4))
    assert kc == max(b for b in range(8, most + 1, 8) if 512 % b == 0), (nr, loops)
    assert 512 // kc in [e for _, e in loops[:-4]], loops  # the k blocks, outside the row tiles


def test_channels_as_rows_not_blocked():
    """The other orientation (8 x 8: the output channels as rows, hw the vector axis) keeps
    its reduction whole: blocked, 512->256 at 28 x 28 took 1.46x the time on AVX-512."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    w = (RNG.standard_normal((64, 512, 1, 1)) / 16).astype("float32")
    bias = RNG.standard_normal(64).astype("float32")
    (func,) = fused_prim_funcs(_module(w, bias, (1, 512, 8, 8)), target, containing="conv")
    _, extents = _k_extents(func, target)
    assert 512 in extents and not any(e in extents for e in (64, 128, 256)), extents


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


def test_conv1x1_blocked_numbers_on_the_host(target):
    """The host's own build (blocks of 104 of 520 channels on AVX-512, 260 or none elsewhere),
    40 output channels (a partial panel), 13 x 13, a symbolic batch of 2: numpy's numbers."""
    w = (RNG.standard_normal((40, 520, 1, 1)) / 16).astype("float32")
    bias = RNG.standard_normal(40).astype("float32")
    mod = _module(w, bias, (tvm.tirx.Var("batch", "int64"), 520, 13, 13))
    x = RNG.standard_normal((2, 520, 13, 13)).astype("float32")
    y = np.maximum(np.einsum("fc,nchw->nfhw", w[:, :, 0, 0], x) + bias.reshape(1, -1, 1, 1), 0)
    out, _ = run(mod, [x], "tvm_fusion", target=target)
    np.testing.assert_allclose(out[0], y, rtol=1e-4, atol=1e-4)
