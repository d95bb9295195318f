"""Tensor-core schedule for FuseSplitGates' float16 / bfloat16 gate kernels on CUDA (sm_80+).

Matched: a gate kernel (see :mod:`tvm_fusion.schedule.cuda.gate_fusion`) with one GEMM
``Y[rows, gate, d // V, d % V] += f32(x[rows, k]) * f32(Wb[d // V, k, gate, d % V])`` whose
operands ``x`` and ``Wb`` are both float16 or both bfloat16 (FuseSplitGates widens them to
float32 in the GEMM's body: the tensor cores take those casts as their input conversion), with
rows on one axis, static, ``>= MIN_ROWS`` and a multiple of 16, a static ``K`` and a vector
block ``V`` that 16 divides. The gate math is whatever FuseSplitGates wrote after the GEMM,
inlined into the block that writes the results.

Emitted: thread blocks over (``BM = 16 x WR`` rows x ``BN = 16 x WU`` units of one weight
block), ``WR x WU x gates`` warps, each warp a 16-row x 16-unit tile of one gate (one tile of
accumulators per warp keeps every register index static): two ``mma.sync.m16n8k16`` with
float32 accumulators per 16-step of ``k`` (TVM's ``mma_f16f16f32`` intrinsic, and the same
description in bfloat16), operands read from shared memory with ``ldmatrix``. Per reduction step
of ``BK`` the block copies ``x[BM, BK]`` and the weight slab ``Wb[BK, gates, BN]`` into shared
memory with 16-byte copies (8 halves; ``cp.async`` where the build sets ``tirx.use_async_copy``,
as ``engine.compile_module`` does on sm_80+), in a 2-stage software pipeline. After the
reduction the accumulators go to a float32 ``(gates, BM, BN)`` tile in shared memory, and all
threads of the block run the gate math from it and write each result once: no ``rows x gates x
D`` buffer exists outside the block.

The tile: of the ``WR x WU`` (at most ``MAX_WARPS`` warps) whose shared memory (both stages and
the result tile) fits ``SMEM_BUDGET``, the one with the most warps that still gives ``SMS``
thread blocks; when none does, the one with the most blocks (gate_2890, 64 x 3 x 1024: 3 warps
per block, 256 blocks).

Skipped (None, the CUDA-core schedules of ``gate_fusion`` then run): float32 kernels (their
schedule is unchanged), mixed operand dtypes, several GEMMs in one kernel (GRU), rows on
several axes, fewer than ``MIN_ROWS`` static rows (the split-K GEMV serves them), symbolic
rows or rows that 16 does not divide (the result block's row tiles would carry a predicate,
and the GEMM placed under them then gets a region that ``blockize`` refuses: not done yet), a
symbolic ``K`` or one that 16 does not divide (padding it gave a kernel that failed to lower:
not done yet), ``V`` not a multiple of 16, gate blocks that are not inlined into the result
block, architectures before sm_80, and any schedule step that fails (logged at debug level).
GeGLU's gelu (erf) stays a block of its own at SwiGLU's size: GeGLU takes the CUDA-core
schedule.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir import TensorIntrin
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.target import Target

from .._common import extent, is_reduction, is_static, try_inline_safe

logger = logging.getLogger(__name__)

MIN_ROWS = 16  # static rows from which tensor cores are used (the split-K GEMV below)
MMA = 16  # a warp's tile: 16 rows x 16 units x 16 k (two m16n8k16 mma.sync)
WARP = 32
ELEM = 2  # bytes per operand element
VEC = 16 // ELEM  # elements per 16-byte copy
SMS = 132  # thread blocks wanted: an H100 SXM's streaming multiprocessors
SMEM_BUDGET = 48 * 1024  # static shared memory per block
MAX_WARPS = 8
STAGES = 2  # software pipeline over the reduction steps


@dataclass(frozen=True)
class TensorCoreTile:
    """``wr x wu x gates`` warps, each 16 rows x 16 units of one gate; reduction steps of
    ``bk``."""

    wr: int
    wu: int
    bk: int
    gates: int

    @property
    def bm(self) -> int:
        return MMA * self.wr

    @property
    def bn(self) -> int:
        return MMA * self.wu

    @property
    def warps(self) -> int:
        return self.wr * self.wu * self.gates


def smem_bytes(tile: TensorCoreTile) -> int:
    """Both stages of the ``x`` and weight slabs (2-byte elements) and the float32 result tile."""
    staged = STAGES * ELEM * tile.bk * (tile.bm + tile.gates * tile.bn)
    return staged + 4 * tile.gates * tile.bm * tile.bn


def choose_tile(rows, units: int, block: int, gates: int, k: int) -> TensorCoreTile | None:
    """The tile with the most warps giving ``SMS`` blocks, else the one with the most blocks;
    its row block divides ``rows``. None when nothing fits (or ``rows`` is symbolic)."""
    if not is_static(rows):
        return None
    bks = [bk for bk in (64, 32, 16) if k % bk == 0]
    if not bks:
        return None  # a K that 16 does not divide: not done yet (see the module docstring)
    candidates = []
    for wr in (4, 2, 1):
        for wu in (4, 2, 1):
            if wr * wu * gates > MAX_WARPS or block % (MMA * wu):
                continue
            if rows % (MMA * wr):
                continue  # row blocks must divide the rows
            tile = next(
                (
                    t
                    for t in (TensorCoreTile(wr, wu, bk, gates) for bk in bks)
                    if smem_bytes(t) <= SMEM_BUDGET
                ),
                None,
            )
            if tile is not None:
                candidates.append(tile)
    if not candidates:
        return None

    def blocks(t: TensorCoreTile) -> int:
        return -(-rows // t.bm) * -(-units // t.bn)

    full = [t for t in candidates if blocks(t) >= SMS]
    if full:
        return max(full, key=lambda t: (t.warps, t.wr))
    return max(candidates, key=lambda t: (blocks(t), t.warps))


# --- intrinsics ----------------------------------------------------------------------------


def _tc():
    """TVM's CUDA tensor intrinsics, imported on first use: ``tvm.s_tir.tensor_intrin`` defines
    every target's intrinsics in TVMScript when imported, and its parser calls ``inspect.stack()``
    per function, which walks every loaded module: with torch and transformers loaded, an llvm
    build that imported it at its start was still importing it after 20 minutes
    (scripts/holdout.py on a loaded 2-core machine)."""
    from tvm.s_tir.tensor_intrin import cuda

    return cuda


_STORE = "tvm_fusion_mma_store_16x16_f32_shared"


def _intrinsics(dtype: str) -> dict[str, str]:
    """Names of the ldmatrix / mma / fill / store intrinsics for ``dtype`` operands.

    float16 takes TVM's own. bfloat16 takes the same descriptions and implementations with the
    element type changed (``ldmatrix`` moves 16-bit words whatever they hold; the mma
    instruction reads ``.bf16`` operands, sm_80+), registered once under our names."""
    _register_once(_STORE, _store_intrin)
    tc = _tc()
    names = {
        "load_a": tc.LDMATRIX_f16_A_INTRIN,
        "load_b": tc.LDMATRIX_f16_B_INTRIN,
        "compute": tc.MMA_f16f16f32_INTRIN,
        "init": tc.MMA_fill_16x16_f32_INTRIN,
        "store": _STORE,
    }
    if dtype == "float16":
        return names
    for key in ("load_a", "load_b", "compute"):
        name = f"tvm_fusion_{names[key]}_bf16"
        _register_once(name, lambda base=names[key]: retyped(base, dtype))
        names[key] = name
    return names


def _store_intrin():
    """TVM's description of storing a warp's float32 accumulators to a 16 x 16 tile, with the
    element loop unrolled (TVM's loop keeps a dynamic index: the accumulators went to local
    memory, 28 B of spills at SwiGLU's size). TVM's ``mma_store`` instruction form cannot be
    used: TVM places the float32 tile in the float16 staging buffers' shared memory, and its
    typed pointer into them fails to lower."""
    from tvm.script import tirx as T

    tc = _tc()
    desc, _ = tc.get_mma_store_intrin("float32", 8, "shared", False)

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        acc = T.match_buffer(a, [WARP, 8], "float32", scope="warp", offset_factor=1)
        tile = T.match_buffer(
            c, [MMA, MMA], "float32", scope="shared", offset_factor=1, strides=[s0, s1]
        )
        with T.sblock("root"):
            T.reads(acc[0:WARP, 0:8])
            T.writes(tile[0:MMA, 0:MMA])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for local in T.unroll(8):
                    row, col = T.meta_var(tc.ldmatrix_32x8_to_shared_16x16_layout(tx, local))
                    tile[row, col] = acc[tx, local]

    return desc, impl


def _register_once(name: str, make) -> None:
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *make())


def retyped(name: str, dtype: str) -> tuple:
    """TVM's float16 intrinsic ``name`` (description, implementation) with ``dtype`` elements:
    the printed functions with the element type and the mma operand type (``.f16`` /
    ``.bf16``) replaced, and ``ldmatrix`` told its element type (the printer drops it, and the
    CUDA code generator falls back to scalar loads without it). ``retyped(name, "float16")``
    gives back TVM's descriptions and mma (checked by the tests)."""
    import tvm

    intrin = TensorIntrin.get(name)
    out = []
    for func in (intrin.desc, intrin.impl):
        text = func.script().replace("float16", dtype)
        text = text.replace('"fp16"', f'"{_PTX_TYPE[dtype]}"')
        text = re.sub(
            r"(T\.ptx_legacy\.ldmatrix\(.*)\)\s*$", rf'\1, dtype="{dtype}")', text, flags=re.M
        )
        parsed = tvm.script.from_source(text)
        out.append(parsed if isinstance(parsed, tirx.PrimFunc) else parsed["main"])
    return tuple(out)


_PTX_TYPE = {"float16": "fp16", "bfloat16": "bf16"}


def _lane(i, j):
    return _tc().shared_16x16_to_ldmatrix_32x8_layout(i % MMA, j % MMA)


# --- matching ------------------------------------------------------------------------------


def _operand_dtype(stmt) -> str | None:
    """``float16`` / ``bfloat16`` when the GEMM block's update is ``Y + f32(a) * f32(b)``
    with ``a`` and ``b`` loads of that dtype and ``Y`` float32; else None."""
    body = stmt.body
    if not isinstance(body, tirx.BufferStore) or body.buffer.dtype != "float32":
        return None
    value = body.value
    if not isinstance(value, tirx.Add) or not isinstance(value.b, tirx.Mul):
        return None
    dtypes = set()
    for operand in (value.b.a, value.b.b):
        if not isinstance(operand, tirx.Cast) or not isinstance(operand.value, TensorLoad):
            return None
        dtypes.add(str(operand.value.source.dtype))
    if len(dtypes) != 1 or next(iter(dtypes)) not in ("float16", "bfloat16"):
        return None
    return next(iter(dtypes))


def _arch_ok(target: Target) -> bool:
    found = re.fullmatch(r"sm_(\d+)\w*", str(target.attrs.get("arch", "")))
    return found is not None and int(found.group(1)) >= 80


def schedule(func: tirx.PrimFunc, target: Target, tensorize: bool = True):
    """The tensor-core schedule of ``func`` (a gate kernel), or None when it does not apply.

    ``tensorize=False`` stops before the tensor intrinsics replace their blocks: the same
    loops, buffers and layouts, runnable on llvm once its threads are made serial (what the
    tests compare with the unscheduled function; tensorize itself checks that each replaced
    block is the intrinsic's description)."""
    if not _arch_ok(target):
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    reductions = [i.block_rv for i in infos if is_reduction(sch, i.block_rv)]
    if len(reductions) != 1:
        logger.debug("gate tensor core: %d GEMMs in the kernel, not 1", len(reductions))
        return None
    dtype = _operand_dtype(sch.get(reductions[0]))
    if dtype is None:
        return None  # float32 or mixed: the CUDA-core schedules
    try:
        return _schedule(sch, func, reductions[0], infos, dtype, tensorize)
    except Exception as err:  # noqa: BLE001 - not the expected form: the CUDA-core schedules
        logger.debug("gate tensor core: schedule failed: %s", str(err)[:300])
        return None


def _schedule(sch, func, red, infos, dtype: str, tensorize: bool):
    others = [i for i in infos if not i.block_rv.same_as(red)]
    remaining = [i.block_rv for i in try_inline_safe(sch, others)]
    params = set(func.params)
    if len(remaining) != 1 or not any(w.source in params for w in sch.get(remaining[0]).writes):
        logger.debug("gate tensor core: the gate math is not one block writing the results")
        return None
    (final,) = remaining
    stmt = sch.get(red)
    out_shape = stmt.writes[0].source.shape
    reads = [r.source for r in stmt.reads if not r.source.same_as(stmt.writes[0].source)]
    ivs = list(stmt.iter_vars)
    if len(out_shape) != 4 or len(ivs) != 5 or [len(b.shape) for b in reads] != [2, 4]:
        logger.debug("gate tensor core: the GEMM is not x[rows, K] x Wb[D/V, K, gates, V]")
        return None
    gates, blocks_d, block = (int(e) if isinstance(e, tirx.IntImm) else None for e in out_shape[1:])
    k = ivs[4].dom.extent
    if None in (gates, blocks_d, block) or not isinstance(k, tirx.IntImm) or block % MMA:
        logger.debug("gate tensor core: symbolic K or gates, or V not a multiple of 16")
        return None
    k = int(k)
    row_loops = sch.get_loops(final)[:-1]
    if len(row_loops) != 1:
        logger.debug("gate tensor core: rows on %d axes, not 1", len(row_loops))
        return None
    rows = extent(sch, row_loops[0])
    if not is_static(rows) or rows < MIN_ROWS:
        logger.debug("gate tensor core: symbolic rows or fewer than %d", MIN_ROWS)
        return None
    tile = choose_tile(rows, blocks_d * block, block, gates, k)
    if tile is None:
        logger.debug("gate tensor core: no tile fits the shared memory")
        return None
    names = _intrinsics(dtype)

    # the result block drives the grid; all threads of a block run its gate math
    rows_loop, units_loop = sch.get_loops(final)
    by, r_in = sch.split(rows_loop, [None, tile.bm])
    bx, u_in = sch.split(units_loop, [None, tile.bn])
    sch.reorder(by, bx, r_in, u_in)
    sch.bind(by, "blockIdx.y")
    sch.bind(bx, "blockIdx.x")

    # the GEMM under it: its result tile in shared memory, laid out (gate, d // V, row, unit)
    sch.compute_at(red, bx, preserve_unit_loops=True)
    _, ty, tx = sch.split(sch.fuse(r_in, u_in), [None, tile.warps, WARP])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.set_scope(red, 0, "shared")
    sch.transform_layout(red, ("write", 0), lambda r, g, do, n: (g, do, r, n))
    r, g, do, n, kk = sch.get_loops(red)[2:]
    ro, r16 = sch.split(r, [None, MMA])
    no, n16 = sch.split(n, [None, MMA])
    k0, k1, k16 = sch.split(kk, [None, tile.bk // MMA, MMA])
    sch.reorder(ro, g, no, do, k0, k1, r16, n16, k16)
    outer = sch.blockize(r16)
    warp = sch.fuse(ro, g, no)
    sch.bind(warp, "threadIdx.y")

    # x and the weight slab of one reduction step in shared memory, 16-byte copies
    copies = []
    for index in (0, 1):
        copy = sch.cache_read(outer, index, "shared")
        sch.compute_at(copy, k0, preserve_unit_loops=True)
        copies.append(copy)
    x_sh, w_sh = copies
    sch.transform_layout(w_sh, ("write", 0), lambda do, kk, g, n: (do, g, kk, n))
    for copy, aligned in ((x_sh, k % VEC == 0), (w_sh, True)):
        loops = sch.get_loops(copy)
        depth = next(i for i, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(k0))) + 1
        fused = sch.fuse(*loops[depth:])
        if aligned:
            _, cy, cx, vec = sch.split(fused, [None, tile.warps, WARP, VEC])
            sch.vectorize(vec)
        else:
            _, cy, cx = sch.split(fused, [None, tile.warps, WARP])
        sch.bind(cy, "threadIdx.y")
        sch.bind(cx, "threadIdx.x")

    # per 16-step of k: the warp's operands in registers (ldmatrix), accumulators in registers
    a_warp = sch.cache_read(outer, 0, "warp")
    b_warp = sch.cache_read(outer, 1, "warp")
    sch.compute_at(a_warp, k1, preserve_unit_loops=True)
    sch.compute_at(b_warp, k1, preserve_unit_loops=True)
    c_warp = sch.cache_write(outer, 0, "warp")
    sch.reverse_compute_at(c_warp, warp, preserve_unit_loops=True)
    init = sch.decompose_reduction(outer, k0)
    sch.transform_layout(a_warp, ("write", 0), lambda r, kk: (r // 16, kk // 16, *_lane(r, kk)))
    sch.transform_layout(
        b_warp, ("write", 0), lambda do, g, kk, n: (do, g, kk // 16, n // 16, *_lane(kk, n))
    )
    sch.transform_layout(
        c_warp, ("read", 0), lambda g, do, r, n: (g, do, r // 16, n // 16, *_lane(r, n))
    )
    for loop in (*sch.get_loops(b_warp)[-4:-2], *sch.get_loops(c_warp)[-4:-2]):
        sch.unroll(loop)
    sch.unroll(k1)
    sch.annotate(k0, "software_pipeline_stage", [0, 0, 1])
    sch.annotate(k0, "software_pipeline_order", [0, 1, 2])
    sch.annotate(k0, "software_pipeline_async_stages", [0])
    if not tensorize:
        return sch
    (init_inner,) = sch.get_child_blocks(init)
    (inner,) = sch.get_child_blocks(outer)
    sch.tensorize(sch.get_loops(a_warp)[-2], names["load_a"])
    sch.tensorize(sch.get_loops(b_warp)[-2], names["load_b"])
    sch.tensorize(sch.get_loops(inner)[-3], names["compute"])
    sch.tensorize(sch.get_loops(init_inner)[-2], names["init"])
    sch.tensorize(sch.get_loops(c_warp)[-2], names["store"])
    return sch
