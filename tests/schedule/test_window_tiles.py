"""Window convolutions (k x k) on the CPU Matmul rule: their rows are the output width, never
padded, so the tile's height divides it. A width with no divisor near the register budget (13,
a prime: SqueezeNet's and AlexNet's last stages) took one row x 2 vectors on AVX2, 2
accumulators (25 GFLOP/s of a core's 96); now one row of up to 12 vectors, the reduction in
blocks of input channels whose weights stay in L1 while the row's tiles read them (67-73
GFLOP/s). The tiles are checked on named targets' lanes and registers; the numbers against a
numpy convolution on AVX2 builds at odd widths, strides, paddings and a dilation."""

import numpy as np
import pytest
import tvm
from helpers import accumulator_tiles, fused_prim_funcs, matches_reference
from tvm import relax
from tvm.relax import op as R

from tvm_fusion import target as _target
from tvm_fusion.schedule import cpu
from tvm_fusion.schedule.cpu._conv_tiles import channel_block, window_tile
from tvm_fusion.schedule.cpu._tiles import standard_tile, unpadded_tile

AVX2 = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
ZEN3 = {"kind": "llvm", "mcpu": "znver3", "num-cores": 2}
AVX512 = {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2}
NEON = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-v1", "num-cores": 2}


def _isa(spec):
    target = tvm.target.Target(spec)
    return _target.vector_lanes(target, "float32"), _target.vector_registers(target)


def _tile(width, channels, lanes, regs):
    """(vectors, rows) of a window convolution's tile, as the rule picks it."""
    nr, _ = standard_tile(width, channels, lanes, regs, 1)
    nr, mr = window_tile(width, channels, nr, lanes, regs, 1)
    return nr // lanes, mr


@pytest.mark.parametrize("spec", [AVX2, ZEN3])
def test_avx2_window_tiles_fill_the_registers(spec):
    """16 registers: a 13 or 17 wide output (primes over the 12 accumulators' budget) takes one
    row of 8 vectors at 256 channels, 12 at 192 (it took one row x 2 vectors); 26 wide, 2 rows x
    4 vectors (was 2 x 2). Of the tiles of 8 or more accumulators, the fewest loads per FMA: 55
    wide, 5 x 2 vectors (was 11 x 1); 27 wide at 192 channels, 3 x 3 (was 9 x 1; 128 channels,
    8 vectors, keep it). 7 accumulators stay (7 and 14 wide: 7 x 1), as do 56 and 28 (4 x 2)
    and 15 (5 x 2, where 3 x 3 vectors has as few loads per FMA and fewer accumulators)."""
    lanes, regs = _isa(spec)
    assert (lanes, regs) == (8, 16)
    assert _tile(13, 256, lanes, regs) == (8, 1)
    assert _tile(13, 192, lanes, regs) == (12, 1)
    assert _tile(13, 64, lanes, regs) == (8, 1)
    assert _tile(17, 32, lanes, regs) == (4, 1)  # 4 vectors are all the channels
    assert _tile(26, 64, lanes, regs) == (4, 2)
    assert _tile(55, 64, lanes, regs) == (2, 5)
    assert _tile(27, 192, lanes, regs) == (3, 3)
    assert _tile(27, 128, lanes, regs) == (1, 9)
    assert _tile(14, 256, lanes, regs) == (1, 7)
    assert _tile(7, 512, lanes, regs) == (1, 7)
    assert _tile(56, 64, lanes, regs) == (2, 4)
    assert _tile(28, 128, lanes, regs) == (2, 4)
    assert _tile(15, 96, lanes, regs) == (2, 5)
    # 208 channels (26 vectors: one row of 2 at most), 13 wide: 13 x 1 vector, one register
    # to spare (it took one row x 2 vectors)
    assert _tile(13, 208, lanes, regs) == (1, 13)


@pytest.mark.parametrize("spec", [AVX512, NEON])
def test_32_register_window_tiles(spec):
    """32 registers (AVX-512, NEON) fit 13 rows of one or two vectors already: unchanged, as
    are tiles of 8 or more accumulators. 111 wide (3 x 37) took 3 rows x 2 vectors, 6
    accumulators: now 3 x 4 vectors (not one row of 16: fewer loads per FMA)."""
    lanes, regs = _isa(spec)
    assert regs == 32
    for width, channels in ((13, 256), (13, 192), (14, 256), (7, 512), (26, 64), (55, 64)):
        nr, _ = standard_tile(width, channels, lanes, regs, 1)
        old = unpadded_tile(width, channels, nr, lanes, regs, 1)
        assert window_tile(width, channels, nr, lanes, regs, 1) == old, (width, channels)
    assert _tile(111, 256, lanes, regs) == (4, 3)


def test_channel_blocks():
    """Blocks of input channels whose weights (channels x window x NR floats) fit 16 KiB, where
    the whole panel does not and the row has several tiles."""
    assert channel_block(64, 9, 64, 4, 13) == 4  # 9 x 64 floats a channel: 7 fit, 4 divide 64
    assert channel_block(256, 9, 96, 4, 13) == 4
    assert channel_block(48, 9, 96, 4, 13) == 4
    assert channel_block(3, 121, 64, 4, 13) == 1  # AlexNet's 11 x 11 stem: a channel a block
    assert channel_block(4, 9, 64, 4, 13) is None  # 9 KiB: the whole panel fits
    assert channel_block(64, 9, 64, 4, 1) is None  # one tile in the row: nothing to share


def _conv_module(shape, weight, bias, stride, padding, dilation):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = R.nn.conv2d(x, relax.const(weight), strides=stride, padding=padding,
                            dilation=dilation)  # fmt: skip
            y = R.nn.relu(R.add(y, relax.const(bias.reshape(1, -1, 1, 1))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _numpy_conv(x, w, bias, stride, padding, dilation):
    f, c, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    span = dilation * (kh - 1) + 1
    oh = (xp.shape[2] - span) // stride + 1
    ow = (xp.shape[3] - span) // stride + 1
    y = np.zeros((x.shape[0], f, oh, ow), "float64")
    for i in range(kh):
        for j in range(kw):
            patch = xp[
                :,
                :,
                i * dilation : i * dilation + stride * (oh - 1) + 1 : stride,
                j * dilation : j * dilation + stride * (ow - 1) + 1 : stride,
            ]
            y += np.einsum("nchw,fc->nfhw", patch, w[:, :, i, j])
    return np.maximum(y + bias.reshape(1, -1, 1, 1), 0).astype("float32")


def _accumulators(mod, target):
    (func,) = fused_prim_funcs(mod, target)
    sch = cpu.Matmul().apply(func, target, False)
    assert sch is not None
    (acc,) = accumulator_tiles(sch.mod["main"])
    return [int(d) for d in acc.shape]


def test_13_wide_row_of_8_vectors_on_avx2():
    """16->64 3x3 at 13 x 13 on AVX2: the tile is one row of 8 vectors (64 channels), the
    reduction in blocks of 4 channels outside the row's 13 tiles, so the row's 13 x 64
    accumulators are kept between blocks (one row of 2 vectors, 16 accumulators, before)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 16, 3, 3)).astype("float32")
    mod = _conv_module((1, 16, 13, 13), w, np.zeros(64, "float32"), 1, 1, 1)
    shape = _accumulators(mod, tvm.target.Target(AVX2))
    assert shape[-1] == 64 and np.prod(shape) == 13 * 64, shape


CASES = [
    # (in channels, out channels, width, kernel, stride, padding, dilation)
    (16, 64, 13, 3, 1, 1, 1),  # one row x 8 vectors, blocks of 4 channels
    (16, 64, 26, 3, 1, 1, 1),  # 2 rows x 4 vectors
    (8, 208, 13, 3, 1, 1, 1),  # 13 rows x 1 vector
    (12, 96, 17, 3, 1, 2, 2),  # 17 wide (a prime), dilation 2: one row x 12 vectors
    (3, 64, 55, 11, 4, 2, 1),  # AlexNet's stem, 13 wide: one channel a block
    (8, 32, 7, 3, 1, 1, 1),  # 7 x 1 vectors, unchanged
    (8, 32, 14, 3, 2, 1, 1),  # stride 2: 7 wide
    (8, 32, 27, 3, 1, 0, 1),  # padding 0: 25 wide (5 x 2 vectors)
    (8, 96, 27, 3, 1, 1, 1),  # 3 x 3 vectors
    (4, 32, 55, 3, 1, 1, 1),  # 5 x 2 vectors
    (3, 16, 29, 7, 2, 3, 1),  # a 7 x 7 stem, padding 3: 15 wide
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "c{}f{}w{}k{}s{}p{}d{}".format(*c))
def test_window_conv_numbers_on_avx2(case):
    c, f, width, k, stride, padding, dilation = case
    rng = np.random.default_rng(width * k)
    w = (rng.standard_normal((f, c, k, k)) / np.sqrt(c * k * k)).astype("float32")
    bias = rng.standard_normal(f).astype("float32") / 4
    batch = tvm.tirx.Var("batch", "int64")
    mod = _conv_module((batch, c, width, width), w, bias, stride, padding, dilation)
    cases = []
    for n in (1, 2):
        x = rng.standard_normal((n, c, width, width)).astype("float32")
        cases.append(([x], [_numpy_conv(x, w, bias, stride, padding, dilation)]))
    matches_reference(mod, cases, rtol=1e-4, atol=1e-4, target=tvm.target.Target(AVX2))
