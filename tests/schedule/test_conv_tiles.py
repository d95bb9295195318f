"""Convolutions on the CPU Matmul rule (ViT's patch embedding, Whisper's conv front end): the
output is ``(batch, channels, h, w)``, the vector axis (channels) is not the output's last axis,
so the register tile's accumulators are laid out channels-last; with the output's own layout
they were a strided ``(channels, w)`` block that LLVM gathered and scattered through memory at
every reduction step (ViT's patch embedding at batch 8: 96 us for 1.6 MFLOP, 8 us now).
Symbolic batch, odd sizes; the tiles checked compile-only on AVX2, AVX-512 and NEON targets
(``cpu_target``), the numbers on the host against stock TVM's pipeline."""

import numpy as np
import pytest
import tvm
from helpers import (
    accumulator_tiles,
    compare_pipelines,
    fused_prim_funcs,
    matches_reference,
    run,
)
from tvm import relax
from tvm.relax import op as R

from tvm_fusion import analysis, tir_util
from tvm_fusion import target as _target
from tvm_fusion.schedule import cpu

RNG = np.random.default_rng(27)
W2 = RNG.standard_normal((32, 3, 4, 4)).astype("float32") / 8  # patch 4, 32 channels
W1 = RNG.standard_normal((32, 5, 3)).astype("float32") / 4  # kernel 3, 32 channels
BIAS = RNG.standard_normal(32).astype("float32")
W20 = RNG.standard_normal((20, 5, 3)).astype("float32") / 4  # 20 channels: padded to the tile


def _patch_embedding(bb, x):
    y = R.nn.conv2d(x, relax.const(W2), strides=[4, 4])
    return R.add(y, relax.const(BIAS.reshape(1, 32, 1, 1)))


def _conv_gelu(bb, x):
    y = R.nn.conv1d(x, relax.const(W1), strides=[2], padding=[1, 1])
    return R.nn.gelu(R.add(y, relax.const(BIAS.reshape(1, 32, 1))))


def _conv_20_channels(bb, x):
    return R.nn.conv1d(x, relax.const(W20), padding=[1, 1])


CASES = {
    # (b, 3, 12, 20) -> (b, 32, 3, 5): w = 5 is no multiple of anything
    "patch_embedding": (_patch_embedding, (3, 12, 20)),
    # (b, 5, 14) -> (b, 32, 7)
    "conv1d_gelu": (_conv_gelu, (5, 14)),
    # (b, 5, 9) -> (b, 20, 9): channels that no vector tile divides
    "conv1d_20_channels": (_conv_20_channels, (5, 9)),
}


def _module(build, shape):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(build(bb, x))
        bb.emit_func_output(out)
    return bb.get()


def _conv_prim_func(mod, target):
    (conv,) = fused_prim_funcs(mod, target, containing="conv")
    return conv


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("batch", [2, "symbolic"])
def test_conv_accumulators_channels_last(name, batch, cpu_target):
    """Compile-only, on AVX2, AVX-512 and NEON targets: the tile follows the target's lanes and
    vector registers. The output width (5, 7, 9: rows that pad_einsum cannot pad in a
    convolution) is tiled by a height that divides it, sized on the register file: on AVX2
    (16 registers) 5 rows x 2 vectors and 7 rows x 1 vector (it was 1 row x 2 vectors)."""
    target = cpu_target
    build, shape = CASES[name]
    n = tvm.tirx.Var("batch", "int64") if batch == "symbolic" else batch
    func = _conv_prim_func(_module(build, (n, *shape)), target)
    sch = cpu.Matmul().apply(func, target, False)
    assert sch is not None
    lanes = _target.vector_lanes(target, "float32")
    regs = _target.vector_registers(target)
    (acc,) = accumulator_tiles(sch.mod["main"])
    # a register tile: rows of channel vectors, the channels innermost (whole vectors, or, for
    # 20 channels, which pad_einsum cannot pad in a convolution, a tile width dividing them)
    assert tir_util.num_elements(acc) is not None, acc.shape
    channels, last = int(func.params[-1].shape[1]), int(acc.shape[-1])
    if channels % lanes == 0:
        assert last % lanes == 0, acc.shape
    else:
        assert last == max(w for w in range(1, lanes + 1) if channels % w == 0), acc.shape
    rows = tir_util.num_elements(acc) // last
    assert rows > 1, acc.shape  # more than one row
    # the accumulators, one row's weight vectors and the broadcast input fit the registers
    vectors = -(-last // lanes)
    assert rows * vectors + vectors + 1 <= regs, (acc.shape, regs)


@pytest.mark.parametrize("name", list(CASES))
def test_conv_numbers(name, target):
    build, shape = CASES[name]
    mod = _module(build, (tvm.tirx.Var("batch", "int64"), *shape))
    for batch in (1, 3):
        data = RNG.standard_normal((batch, *shape)).astype("float32")
        ours, _stock = compare_pipelines(mod, [data], rtol=1e-4, atol=1e-4)
    rules = {i.name: i.rule for i in analysis.schedule_info(ours.lowered) if "conv" in i.name}
    assert set(rules.values()) == {"Matmul"}, rules


# 1x1 convolutions, their rows (h, w) merged into one GEMM row axis: 7 x 7 (ResNet's last
# stage: 49 rows) and 13 x 13 (169) rows that no tile height near the register budget divides
W1X1 = RNG.standard_normal((32, 8, 1, 1)).astype("float32") / 3
BIAS1X1 = RNG.standard_normal(32).astype("float32")


def _conv1x1_relu(bb, x):
    y = R.nn.conv2d(x, relax.const(W1X1))
    return R.nn.relu(R.add(y, relax.const(BIAS1X1.reshape(1, 32, 1, 1))))


@pytest.mark.parametrize("hw", [7, 13])
@pytest.mark.parametrize("batch", [1, "symbolic"])
def test_conv1x1_merged_rows_full_tile(hw, batch, cpu_target):
    """Compile-only: merged rows that the standard tile's height does not divide are padded to
    it (through flat copies: pad_einsum refuses the ``x[.., v // 7, v % 7]`` read), so the tile
    is the standard two vectors of channels x half the register file in accumulators. They
    were left unpadded: on AVX2 (16 registers) 49 rows took 7 rows x 1 vector, 1.9x ONNX
    Runtime's time on ResNet-50's 1x1 512->2048 layer, 0.9x padded to 52 rows of 4 x 2."""
    target = cpu_target
    n = tvm.tirx.Var("batch", "int64") if batch == "symbolic" else batch
    func = _conv_prim_func(_module(_conv1x1_relu, (n, 8, hw, hw)), target)
    sch = cpu.Matmul().apply(func, target, False)
    assert sch is not None
    lanes = _target.vector_lanes(target, "float32")
    regs = _target.vector_registers(target)
    (acc,) = accumulator_tiles(sch.mod["main"])
    last = int(acc.shape[-1])
    rows = tir_util.num_elements(acc) // last
    assert last == 2 * lanes, acc.shape  # 32 channels: two vectors on every target here
    assert rows * 2 >= 3 * regs // 8, (acc.shape, regs)
    assert rows * 2 + 2 + 1 <= regs, (acc.shape, regs)


@pytest.mark.parametrize("hw", [1, 5, 7, 13, 14])
@pytest.mark.parametrize("channels", [32, 20])  # 20: the columns padded too
def test_conv1x1_merged_rows_numbers(hw, channels, target):
    w, bias = W1X1[:channels], BIAS1X1[:channels].reshape(1, channels, 1, 1)

    def conv(bb, x):
        return R.nn.relu(R.add(R.nn.conv2d(x, relax.const(w)), relax.const(bias)))

    mod = _module(conv, (tvm.tirx.Var("batch", "int64"), 8, hw, hw))
    cases = []
    for batch in (1, 3):
        x = RNG.standard_normal((batch, 8, hw, hw)).astype("float32")
        y = np.einsum("fc,nchw->nfhw", w[:, :, 0, 0], x) + bias
        cases.append(([x], [np.maximum(y, 0)]))
    compiled = matches_reference(mod, cases, rtol=1e-5, atol=1e-5)
    rules = {i.name: i.rule for i in analysis.schedule_info(compiled.lowered) if "conv" in i.name}
    assert set(rules.values()) == {"Matmul"}, rules


# ResNet-50's and SqueezeNet's 1x1 layers in small: K = 256 input channels, output channels
# that 3 vectors do not divide (SqueezeNet's final 1000; 999) or pad too much for (77)
W_WIDE = (RNG.standard_normal((1000, 256, 1, 1)) / 16).astype("float32")
BIAS_WIDE = RNG.standard_normal(1000).astype("float32")
AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})


def _conv1x1_wide(channels):
    w, bias = W_WIDE[:channels], BIAS_WIDE[:channels].reshape(1, channels, 1, 1)

    def conv(bb, x):
        return R.nn.relu(R.add(R.nn.conv2d(x, relax.const(w)), relax.const(bias)))

    return conv, w, bias


@pytest.mark.parametrize(
    "channels,hw,wide",
    [(1000, 13, True), (999, 7, True), (1000, 14, True), (77, 13, False), (48, 7, True)],
)
def test_conv1x1_wide_tile_on_avx2(channels, hw, wide):
    """1x1 convolutions of K >= 256 get the GEMM's 4 rows x 3 vectors on AVX2 (12 accumulators),
    their channels padded to 3 vectors in the weights' compile-time packing and their merged rows
    to 4 through the flat copies (169 rows: 172). Before, pad_einsum refused the convolution's
    ``x[.., v // 13, v % 13]`` read, so the wide tile was dropped: SqueezeNet's 1000 channels
    (8 x 125) took tiles of ONE vector, 3x the time of 4 x 3 (Zen 3, alternating, load 4.4);
    ResNet-50's 512->2048 at 7 x 7 0.66x, 256->1024 at 14 x 14 0.93x. The numbers equal numpy's
    (symbolic batch, run at 2)."""
    conv, w, bias = _conv1x1_wide(channels)
    mod = _module(conv, (tvm.tirx.Var("batch", "int64"), 256, hw, hw))
    func = _conv_prim_func(mod, AVX2)
    sch = cpu.Matmul().apply(func, AVX2, False)
    assert sch is not None
    (acc,) = accumulator_tiles(sch.mod["main"])
    last = int(acc.shape[-1])
    rows = tir_util.num_elements(acc) // last
    assert ((last, rows) == (24, 4)) == wide, acc.shape
    x = RNG.standard_normal((2, 256, hw, hw)).astype("float32")
    y = np.maximum(np.einsum("fc,nchw->nfhw", w[:, :, 0, 0], x) + bias, 0)
    out, _ = run(mod, [x], "tvm_fusion", target=AVX2)
    np.testing.assert_allclose(out[0], y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "hw,strides,padding,tile",
    [
        (14, (2, 2), 0, (24, 4)),  # ResNet-50's downsampling 1x1: 7 x 7 = 49 rows, padded to 52
        (13, (2, 2), 0, (24, 4)),  # an odd image: rows 0, 2, .., 12
        (9, (3, 2), 1, None),  # unequal strides, padded input; 4 x 5 = 20 rows
    ],
)
def test_conv1x1_strided_rows_compacted(hw, strides, padding, tile):
    """A strided 1x1 convolution reads its input through a compact copy (``x[.., ::2, ::2]``,
    rows last), so that its rows merge as a stride-1 convolution's and take the wide tile on
    AVX2. Read in place (``x[.., 2h, 2w]``) the rows stayed apart: tiles of 7 rows x ONE
    vector for ResNet-50's 1024->2048 at 14 x 14 -> 7 x 7, every column panel streaming the
    image again (0.67-0.76x the time now, 2 threads, alternating, load average 6). The numbers
    equal numpy's."""
    conv_w, bias = W_WIDE[:96], BIAS_WIDE[:96].reshape(1, 96, 1, 1)

    def conv(bb, x):
        y = R.nn.conv2d(x, relax.const(conv_w), strides=strides, padding=padding)
        return R.add(y, relax.const(bias))

    mod = _module(conv, (1, 256, hw, hw))
    sch = cpu.Matmul().apply(_conv_prim_func(mod, AVX2), AVX2, False)
    assert sch is not None
    (acc,) = accumulator_tiles(sch.mod["main"])
    if tile is not None:
        last = int(acc.shape[-1])
        assert (last, tir_util.num_elements(acc) // last) == tile, acc.shape
    x = RNG.standard_normal((1, 256, hw, hw)).astype("float32")
    xp = np.pad(x, [(0, 0), (0, 0), (padding, padding), (padding, padding)])
    y = np.einsum("fc,nchw->nfhw", conv_w[:, :, 0, 0], xp[:, :, :: strides[0], :: strides[1]])
    out, _ = run(mod, [x], "tvm_fusion", target=AVX2)
    np.testing.assert_allclose(out[0], y + bias, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hw,strides", [(7, 1), (13, 2)])
def test_conv1x1_output_parameter_wide_tile(hw, strides):
    """A 1x1 convolution with no epilogue writes a parameter, which keeps its shape: its rows
    are padded through a flat intermediate, copied out on the tile (ResNet-50's convolutions
    before their batch norm is folded: 512->2048 at 7 x 7 took tiles of 7 rows x ONE vector,
    0.62x the time now, single thread, CPU time, alternating, load average 6)."""
    w = W_WIDE[:1000]
    mod = _module(lambda bb, x: R.nn.conv2d(x, relax.const(w), strides=strides), (1, 256, hw, hw))
    sch = cpu.Matmul().apply(_conv_prim_func(mod, AVX2), AVX2, False)
    assert sch is not None
    (acc,) = accumulator_tiles(sch.mod["main"])
    assert (int(acc.shape[-1]), tir_util.num_elements(acc) // int(acc.shape[-1])) == (24, 4)
    x = RNG.standard_normal((1, 256, hw, hw)).astype("float32")
    y = np.einsum("fc,nchw->nfhw", w[:, :, 0, 0], x[:, :, ::strides, ::strides])
    out, _ = run(mod, [x], "tvm_fusion", target=AVX2)
    np.testing.assert_allclose(out[0], y, rtol=1e-4, atol=1e-4)


def test_strided_rows_compacted_only_for_a_wider_tile():
    """The compact copy costs a pass over the input: only where the merged rows get a tile of
    more accumulators than the output's own rows (AVX2: 7 x 7 = 49 rows, 4 x 3 vectors, where
    7 rows took 7 x 1; 28 x 28 rows and 128 channels: 4 x 2 vectors either way, and the copy
    alone made ResNet-50's 256->128 at 56 x 56 -> 28 x 28 1.24x slower)."""
    from tvm_fusion.schedule.cpu._tiles import compact_pays

    lanes, regs = _target.vector_lanes(AVX2, "float32"), _target.vector_registers(AVX2)
    assert compact_pays(49, 7, 2048, 1024, lanes, regs)
    assert compact_pays(196, 14, 1024, 512, lanes, regs)
    assert not compact_pays(784, 28, 128, 256, lanes, regs)
    w = (RNG.standard_normal((128, 64, 1, 1)) / 8).astype("float32")
    mod = _module(lambda bb, x: R.nn.conv2d(x, relax.const(w), strides=2), (1, 64, 56, 56))
    sch = cpu.Matmul().apply(_conv_prim_func(mod, AVX2), AVX2, False)
    assert sch is not None and "reindex" not in sch.mod["main"].script()
