"""The CPU GEMM rules' accumulators live in registers only: their tile buffer is a ``global``
``cache_write`` (a stack buffer that LLVM promotes whole), not ``local``. With ``local``, TVM
0.27 lowers the tile through a buffer LLVM keeps in memory: each tile was zeroed by a call to
``memset`` and its accumulators stored twice (to that buffer, then to the output). Over a short
reduction that is most of the tile's time: Winograd's batched GEMM 36 x 196 x 16 @ 16 x 64
(SqueezeNet), see bench/cnn.md.

Compile-only over the target matrix and an Intel AVX-512 CPU (where LLVM zeroed that buffer with
``memset``; on Zen 4 with stores): the kernel's assembly allocates no workspace and calls no
``memset``; numbers on the host build, the reduction short and long, with an epilogue."""

import re

import numpy as np
import pytest
import tvm
from helpers import run
from tvm import relax
from tvm.relax import op as R

from tvm_fusion import analysis
from tvm_fusion.build import engine


def _gemm(shape_x, shape_w, relu: bool = False, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal(shape_w).astype("float32")
    x = relax.Var("x", relax.TensorType(shape_x, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = R.matmul(x, relax.const(w))
            gv = bb.emit_output(R.nn.relu(y) if relu else y)
        bb.emit_func_output(gv)
    return bb.get(), w


def _grouped_conv(groups: int = 2, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((8 * groups, 4, 3, 3)).astype("float32")
    x = relax.Var("x", relax.TensorType((1, 4 * groups, 16, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(R.nn.conv2d(x, relax.const(w), groups=groups))
        bb.emit_func_output(gv)
    return bb.get(), w


def _kernel_asm(mod, target, rule: str) -> str:
    compiled = engine.compile_module(mod, target, "tvm_fusion", channels_last=False)
    funcs = [
        (gv.name_hint, f)
        for gv, f in compiled.lowered.functions.items()
        if isinstance(f, tvm.tirx.PrimFunc)
        and f.attrs is not None
        and f.attrs.get("tvm_fusion.schedule_rule") == rule
    ]
    assert funcs, [i.rule for i in analysis.schedule_info(compiled.lowered)]
    name, func = funcs[0]
    lib = tvm.compile(tvm.IRModule({name: func.with_attr("global_symbol", name)}), target)
    mod = lib.mod if hasattr(lib, "mod") else lib
    return mod.inspect_source("asm")


FMA = r"\bv?fmadd|\bfmla\b"  # x86 (AVX2, AVX-512), AArch64
INTEL_AVX512 = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})


def _in_registers(asm: str) -> None:
    assert "TVMBackendAllocWorkspace" not in asm, "the accumulator tile is a workspace"
    assert "memset" not in asm, "the accumulator tile is zeroed in memory"


@pytest.mark.parametrize("k", [16, 64])
def _gemm_tile_in_registers(target, k):
    for mod in (_gemm((36, 196, k), (36, k, 64))[0], _gemm((29, k), (k, 40), relu=True)[0]):
        asm = _kernel_asm(mod, target, "Matmul")
        _in_registers(asm)
        if "x86-64-v2" not in str(target):
            assert re.search(FMA, asm), "no FMA in the GEMM kernel"


@pytest.mark.parametrize("k", [16, 64])
def test_gemm_tile_in_registers(cpu_target, k):
    """Winograd's batched GEMM and a plain one with rows padded to the tile (tiles under 1024
    bytes on every target). SSE4.2 has no FMA; there the multiply-adds are checked by the
    numbers below only."""
    _gemm_tile_in_registers(cpu_target, k)


@pytest.mark.parametrize("k", [16, 64])
def test_gemm_tile_in_registers_intel(k):
    _gemm_tile_in_registers(INTEL_AVX512, k)


@pytest.mark.parametrize("mcpu", ["znver3", "znver4", "sapphirerapids"])
def test_grouped_conv_tile_in_registers(mcpu):
    """The grouped rule's tile likewise (on 4 lanes the window rule takes this convolution)."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    _in_registers(_kernel_asm(_grouped_conv()[0], target, "GroupedConv"))


@pytest.mark.parametrize("mcpu", ["znver4", "sapphirerapids"])
@pytest.mark.parametrize("cols", [16, 64])
def test_avx512_tile_of_rows_in_eights_stays_on_the_stack(mcpu, cols):
    """64 rows: 8 rows x 2 vectors (or 16 x 1) of AVX-512 float32 accumulators are 1024 bytes,
    which TVM 0.27 allocates as a workspace (kMaxStackAlloca is exclusive): the tile takes 4 x 2
    (8 x 1) instead, _tiles.STACK_TILE_BYTES."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    asm = _kernel_asm(_gemm((64, 64), (64, cols))[0], target, "Matmul")
    _in_registers(asm)
    assert re.search(FMA, asm)


def test_avx512_register_tiles_under_the_stack_limit():
    """Every GEMM and window-convolution tile of AVX-512 float32 accumulators is under 1024
    bytes, so it stays in registers; AVX2's tiles are unchanged (16 registers never fill it)."""
    from tvm_fusion.schedule.cpu._conv_tiles import window_tile
    from tvm_fusion.schedule.cpu._tiles import standard_tile

    for lanes, regs in ((16, 32), (8, 16), (4, 32)):
        for m in [1, 2, 5, 7, 8, 13, 14, 16, 27, 55, 56, 64, 97, 136, 256, 3136]:
            for j in [3, 16, 32, 48, 64, 96, 99, 128, 256, 2039]:
                nr, mr = standard_tile(m, j, lanes, regs, 1)
                assert mr * nr * 4 < 1024, (m, j, lanes, nr, mr)
                if j % lanes == 0:
                    wn, wm = window_tile(m, j, nr, lanes, regs, 1)
                    assert wm * wn * 4 < 1024, (m, j, lanes, wn, wm)
    assert standard_tile(64, 64, 16, 32, 1) == (32, 4)
    assert standard_tile(56, 64, 16, 32, 1) == (32, 7)
    assert standard_tile(64, 64, 8, 16, 1) == (16, 4)  # AVX2 as before


@pytest.mark.parametrize(
    "shape_x, shape_w, relu",
    [
        ((36, 196, 16), (36, 16, 64), False),  # Winograd's batched GEMM
        ((29, 640), (640, 40), True),  # rows padded to the tile, a long reduction, an epilogue
        ((1, 7), (7, 3), False),  # one row, a narrow axis
        ((64, 64), (64, 64), True),  # rows in eights: 4 x 2 AVX-512 vectors, not 8 x 2
    ],
)
def test_gemm_numbers(shape_x, shape_w, relu):
    mod, w = _gemm(shape_x, shape_w, relu)
    x = np.random.default_rng(1).standard_normal(shape_x).astype("float32")
    (out,), compiled = run(mod, [x])
    expect = x @ w
    np.testing.assert_allclose(out, np.maximum(expect, 0) if relu else expect, rtol=1e-4, atol=1e-4)
    assert "Matmul" in {i.rule for i in analysis.schedule_info(compiled.lowered)}


def test_grouped_conv_numbers():
    import torch

    mod, w = _grouped_conv()
    x = np.random.default_rng(1).standard_normal((1, 8, 16, 16)).astype("float32")
    (out,), compiled = run(mod, [x])
    expect = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), groups=2).numpy()
    np.testing.assert_allclose(out, expect, rtol=1e-4, atol=1e-4)
    assert "GroupedConv" in {i.rule for i in analysis.schedule_info(compiled.lowered)}


def _conv64(shape_x, channels: int, kernel: int, seed: int = 0):
    """A float64 convolution, bias and ReLU (NCHW, stride 1, padding 1)."""
    c = shape_x[1]
    w = np.random.default_rng(seed).standard_normal((channels, c, kernel, kernel))
    x = relax.Var("x", relax.TensorType(shape_x, "float64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = R.nn.conv2d(x, relax.const(w, "float64"), padding=[kernel // 2] * 2)
            gv = bb.emit_output(R.nn.relu(y))
        bb.emit_func_output(gv)
    return bb.get(), w


@pytest.mark.parametrize(
    "shape_x, channels, kernel", [((1, 8, 12, 12), 32, 3), ((1, 8, 5, 12), 48, 3)]
)
def test_float64_tiles_stay_under_the_stack_limit(cpu_target, shape_x, channels, kernel):
    """Float64 accumulators are 8 bytes: the window and unpadded tiles count them so (they
    counted 4: AVX-512's 3x3 tile below was 12 rows x 2 vectors of float64, 1536 bytes, a
    workspace)."""
    from helpers import accumulator_tiles, fused_prim_funcs

    from tvm_fusion import tir_util
    from tvm_fusion.schedule import cpu

    mod = _conv64(shape_x, channels, kernel)[0]
    (conv,) = fused_prim_funcs(mod, cpu_target, containing="conv")
    sch = cpu.Matmul().apply(conv, cpu_target, False)
    assert sch is not None
    (acc,) = accumulator_tiles(sch.mod["main"])
    assert acc.dtype == "float64"
    assert tir_util.num_elements(acc) * 8 < 1024, acc.shape


@pytest.mark.parametrize(
    "shape_x, channels, kernel", [((1, 8, 12, 12), 32, 3), ((1, 8, 5, 12), 48, 3)]
)
def test_float64_conv_numbers(shape_x, channels, kernel):
    import torch

    mod, w = _conv64(shape_x, channels, kernel)
    x = np.random.default_rng(1).standard_normal(shape_x)
    (out,), compiled = run(mod, [x], channels_last=False)
    expect = (
        torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), padding=kernel // 2)
        .clamp(min=0)
        .numpy()
    )
    np.testing.assert_allclose(out, expect, rtol=1e-10, atol=1e-10)
    assert "Matmul" in {i.rule for i in analysis.schedule_info(compiled.lowered)}
