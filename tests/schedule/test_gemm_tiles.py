"""Register tiles of the CPU Matmul rule on AVX2 (16 vector registers): 12 accumulators, as
MLAS's kernels hold, where 8 are just the FMAs in flight on two FMA ports of 4 cycles' latency.
4 rows x 3 vectors for a GEMM of K >= 256 whose B is a constant or a model input; 6 x 2 vectors
or a divisor of the rows (165 rows: 5) otherwise. AVX-512 (32 registers) keeps its tiles. The
tiles follow the named targets' lanes and registers (compile-only); the numbers are checked
against numpy on AVX2 builds at odd shapes."""

import numpy as np
import pytest
import tvm
from helpers import fused_prim_funcs, run
from tvm import relax, tirx
from tvm.relax import op as R

from tvm_fusion import target as _target
from tvm_fusion import tir_util
from tvm_fusion.build import engine
from tvm_fusion.schedule import cpu
from tvm_fusion.schedule.cpu._tiles import row_block, standard_tile, wide_tile

AVX2 = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
ZEN3 = {"kind": "llvm", "mcpu": "znver3", "num-cores": 2}
AVX512 = {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2}


def _isa(spec):
    target = tvm.target.Target(spec)
    return _target.vector_lanes(target, "float32"), _target.vector_registers(target)


@pytest.mark.parametrize("spec", [AVX2, ZEN3])
def test_avx2_tiles_hold_12_accumulators(spec):
    """Static rows on 16 registers: 6 rows x 2 vectors, or the divisor of the rows that fills
    most of 12 accumulators (165 and 55 rows: 5; 258: 6), where 8 accumulators gave 165 rows
    tiles of 3 (6 accumulators, latency-bound); 4 x 3 vectors for K >= 256, a run-time B
    included (136 x 1021 @ 1021 x 2039: 2039 columns padded to 2040). Symbolic rows keep 4 x 2
    vectors; K = 128 keeps the standard tile."""
    lanes, regs = _isa(spec)
    assert (lanes, regs) == (8, 16)
    assert standard_tile(165, 99, lanes, regs, 1) == (16, 5)
    assert standard_tile(55, 99, lanes, regs, 1) == (16, 5)
    assert standard_tile(258, 389, lanes, regs, 1) == (16, 6)
    assert standard_tile(136, 2039, lanes, regs, 1) == (16, 4)  # 136 = 4 x 34
    assert standard_tile(tirx.Var("m", "int64"), 512, lanes, regs, 1) == (16, 4)
    assert wide_tile(136, 2039, 1021, lanes, regs, 1) == (24, 4)
    assert wide_tile(136, 2039, 128, lanes, regs, 1) is None
    assert wide_tile(165, 99, 2914, lanes, regs, 1) is None  # rows not in 4s, 21 of 120 padding


def test_avx512_tiles_unchanged():
    """32 registers: half of them accumulators, no wide tile (as before the AVX2 change), and
    under 1024 bytes of them (_tiles.STACK_TILE_BYTES): 136 rows take 4 x 2 vectors, not 8."""
    lanes, regs = _isa(AVX512)
    assert (lanes, regs) == (16, 32)
    assert standard_tile(165, 99, lanes, regs, 1) == (16, 15)
    assert standard_tile(55, 99, lanes, regs, 1) == (16, 11)
    assert standard_tile(258, 389, lanes, regs, 1) == (32, 6)
    assert standard_tile(136, 2039, lanes, regs, 1) == (32, 4)
    assert wide_tile(136, 2039, 1021, lanes, regs, 1) is None


def _runtime_matmul(m, k, n):
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    w = relax.Var("w", relax.TensorType((k, n), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(R.matmul(x, w))
        bb.emit_func_output(out)
    return bb.get()


def _update_extents(mod, target):
    (func,) = fused_prim_funcs(mod, target)
    sch = cpu.Matmul().apply(func, target, False)
    assert sch is not None
    main = sch.mod["main"]
    (update,) = [b for b in tir_util.block_names(main) if b.endswith("_update")]
    extents = [int(sch.get(loop).extent) for loop in sch.get_loops(sch.get_sblock(update))]
    return extents, main


@pytest.mark.parametrize(
    "shape,tile",
    [
        ((36, 300, 95), [4, 3]),  # K >= 256: 4 x 3 vectors, 95 columns packed as 96
        ((55, 64, 99), [5, 2]),  # 55 rows: tiles of 5 x 2 vectors, no padded rows
    ],
)
def test_runtime_weight_tiles_on_avx2(shape, tile):
    """B a model input (no compile-time packing): the AVX2 tiles above, B's padded columns
    packed per call; the numbers equal numpy's. On AVX-512 the same GEMMs keep half the
    registers in accumulators (not 4 x 3, not 5 x 2)."""
    m, k, n = shape
    mod = _runtime_matmul(m, k, n)
    avx2 = tvm.target.Target(AVX2)
    extents, _ = _update_extents(mod, avx2)
    assert extents[-3:] == [*tile, 8], extents
    avx512_extents, _ = _update_extents(mod, tvm.target.Target(AVX512))
    assert avx512_extents[-3:-1] != tile and avx512_extents[-1] == 16, avx512_extents
    rng = np.random.default_rng(37)
    x = rng.standard_normal((m, k)).astype("float32")
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype("float32")
    out, _ = run(mod, [x, w], "tvm_fusion", target=avx2)
    np.testing.assert_allclose(out[0], x @ w, rtol=1e-4, atol=1e-4)


def test_wide_tile_pads_rows():
    """Rows not in 4s are padded to 4 for the wide tile (at most 1/16 of them padding: 49, 77,
    169 rows: 52, 80, 172; 18 rows: no), where they kept the standard tile: one vector for 1000
    columns (125 x 8), 12 x 1 accumulators, 0.62x the time now at 169 x 512 @ 512 x 1000. A 1x1
    convolution's merged rows likewise. Only on 16 registers: AVX-512 and NEON keep theirs."""
    lanes, regs = _isa(ZEN3)
    assert wide_tile(49, 2048, 512, lanes, regs, 1) == (24, 4)
    assert wide_tile(77, 1000, 768, lanes, regs, 1) == (24, 4)
    assert wide_tile(169, 1000, 512, lanes, regs, 1) == (24, 4)
    assert wide_tile(18, 1000, 512, lanes, regs, 1) is None  # 2 rows of 20 padding
    assert wide_tile(169, 1000, 128, lanes, regs, 1) is None  # K < 256
    for spec in (AVX512, {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-v1"}):
        lanes, regs = _isa(spec)
        assert wide_tile(169, 1000, 512, lanes, regs, 1) is None


@pytest.mark.parametrize(
    "shape,wide",
    [
        ((169, 512, 1000), True),
        ((77, 300, 999), True),
        ((49, 256, 77), False),
        ((13, 256, 96), False),
    ],
)
def test_padded_rows_wide_tile_numbers(shape, wide):
    """A constant B: rows padded for the wide tile (169, 77, 49 rows; 13: too few for it; 77
    columns: too much padding for 3 vectors), the numbers equal numpy's (an AVX2 build)."""
    m, k, n = shape
    rng = np.random.default_rng(41)
    x = rng.standard_normal((m, k)).astype("float32")
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype("float32")
    xv = relax.Var("x", relax.TensorType((m, k), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [xv]):
        with bb.dataflow():
            out = bb.emit_output(R.matmul(xv, relax.const(w)))
        bb.emit_func_output(out)
    avx2 = tvm.target.Target(AVX2)
    out, compiled = run(bb.get(), [x], "tvm_fusion", target=avx2)
    np.testing.assert_allclose(out[0], x @ w, rtol=1e-4, atol=1e-4)
    (func,) = [f for f in compiled.lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    (packed,) = [p for p in func.params if len(p.shape) == 3]  # B's panels [cols / NR, k, NR]
    assert (int(packed.shape[-1]) == 24) == wide, packed.shape


def test_row_block_arithmetic():
    """A of over 4 MiB is read in blocks of rows (at most 4 MiB, a divisor of the row tiles
    at least a quarter of that) on 16 registers: 2048 x 2048 float32 in tiles of 4 rows, 512
    tiles of 32 KiB: blocks of 128 tiles; 1024 x 1024 (4 MiB): none; a prime count of tiles:
    none (no divisor near the size); 32 registers (AVX-512, NEON): none."""
    assert row_block(512, 4, 2048, 4, 16) == 128
    assert row_block(1024, 4, 1024, 4, 16) == 256  # 4096 x 1024: 1024 rows a block
    assert row_block(256, 4, 1024, 4, 16) is None  # A is 4 MiB: one block
    assert row_block(521, 4, 2048, 4, 16) is None  # 521 tiles: prime
    assert row_block(171, 6, 1031, 4, 16) == 57  # 1021 rows padded to 1026, tiles of 6
    assert row_block(512, 4, 2048, 4, 32) is None
    assert row_block(tirx.Var("t", "int64"), 4, 2048, 4, 16) is None


def _update_loops(func):
    sch = tvm.s_tir.Schedule(func)
    (update,) = [b for b in tir_util.block_names(func) if b.endswith("_update")]
    return [sch.get(loop) for loop in sch.get_loops(sch.get_sblock(update))]


@pytest.mark.parametrize(
    "shape,const", [((1021, 1031, 129), True), ((1029, 1040, 7), True), ((1021, 1031, 129), False)]
)
def test_row_blocks_numbers(shape, const):
    """A over 4 MiB (1021 x 1031, 1029 x 1040 float32), B a constant or a model input (then
    packed whole, up front, not per panel), a bias and a ReLU fused: the rows run in blocks
    (a serial loop outside the parallel panel loop, the epilogue under each row tile), the
    numbers equal numpy's (an AVX2 build). AVX-512 keeps the panel loop outermost."""
    m, k, n = shape
    rng = np.random.default_rng(43)
    x = rng.standard_normal((m, k)).astype("float32")
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype("float32")
    bias = rng.standard_normal(n).astype("float32")
    xv = relax.Var("x", relax.TensorType((m, k), "float32"))
    wv = relax.Var("w", relax.TensorType((k, n), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [xv] if const else [xv, wv]):
        with bb.dataflow():
            y = bb.emit(R.add(R.matmul(xv, relax.const(w) if const else wv), relax.const(bias)))
            out = bb.emit_output(R.nn.relu(y))
        bb.emit_func_output(out)
    mod = bb.get()
    avx2 = tvm.target.Target(AVX2)
    out, compiled = run(mod, [x] if const else [x, w], "tvm_fusion", target=avx2)
    np.testing.assert_allclose(out[0], np.maximum(x @ w + bias, 0), rtol=1e-4, atol=1e-4)
    (func,) = [f for f in compiled.lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    loops = _update_loops(func)
    assert loops[0].kind == tirx.ForKind.SERIAL and int(loops[0].extent) > 1, loops[0]
    assert loops[1].kind == tirx.ForKind.PARALLEL, [str(lp.kind) for lp in loops]
    avx512 = engine.compile_module(mod, tvm.target.Target(AVX512), "tvm_fusion")
    (func,) = [f for f in avx512.lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert _update_loops(func)[0].kind == tirx.ForKind.PARALLEL
