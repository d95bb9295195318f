"""CUDA rule for skinny GEMMs: few rows, many columns, a long reduction (split-K).

Matched: a PrimFunc with one reduction block ``C[i, j] += A[i, k] * B[k, j]`` (a constant
weight, which the pipeline transposes at compile time, reads that way) summed in float32: float32
operands, or float16 / bfloat16 ones widened in the sum (what ``legalize`` makes of every
half-precision ``matmul``: a float32 ``C``, then a cast epilogue); static ``N`` and ``K``,
static or symbolic ``M`` (rows), optionally followed by elementwise blocks (an epilogue: the
cast, bias, residual) and preceded by elementwise blocks that inline into it. It fires
only where dlight's GPU ``Matmul`` would leave fewer thread blocks than an H100 has SMs:
dlight tiles ``32 x 64`` and runs the whole of ``K`` in one block, so the SwiGLU down
projection ``64 x 2048 x 5632`` gets 64 blocks of 352 serial reduction steps. For symbolic
rows it fires where dlight's column tiles alone do not fill the SMs and ``K`` is long enough
that the partial sums cost little at any row count (``K / S >= MIN_SPLIT_K_SYMBOLIC``: ``8 S``
bytes of traffic per result against ``2 K`` flops).

Emitted: two kernels in one PrimFunc.

1. Partial sums: ``K`` is cut into ``S`` slices (``rfactor``), thread blocks over (slice x row
   block ``BM`` x column block ``BN``), ``S`` chosen so that there are at least ``SMS``
   blocks; each thread a ``TM x TN`` register tile; per reduction step of ``BK`` the block
   stages ``A[BM, BK]`` and ``B``'s ``BK x BN`` slab in shared memory with 16-byte copies along
   each operand's contiguous axis (``cp.async`` on sm_80+, a 2-stage software pipeline, as in
   :mod:`.gate_fusion`); the partial tile is written to a global ``(S, M, N)`` workspace.
   Half-precision operands: steps of 64 (the same 128 bytes of a row as fp32's 32), copied 8
   halves at a time (``cp.async.cg``, 16 bytes); the register tile and the workspace stay
   float32. One row of half-precision operands (decode; ``normalize_prim_func`` has dropped
   the row iterator): no row tile, blocks of 64 threads x 2 columns (``ONE_ROW``), the
   ``BK x 128`` weight slab staged the same way (``1 x 2048 x 5632``: 176 blocks).
2. The sum of the ``S`` partials per result, and the epilogue, one thread per result (the
   cast to half precision happens once, here).

Rows and ``K`` that the tiles do not divide are padded (``pad_einsum``; the padding read in
place), so no extent is refused once the rule fires. Skipped (left to dlight, with a debug
reason): other dtypes and half-precision sums (float64; a float16 ``C``), one float32 row
(dlight's GEMV / reduction rules keep it, as before), batched GEMMs, ``B`` as ``[j, k]`` (a
weight parameter: its ``BN x BK`` slab, read along ``j`` by the threads of a warp, would take
16-way shared-memory bank conflicts in this layout), GEMMs dlight already spreads over the
SMs, ``K`` too short to split.
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ... import target as _target
from .._common import is_reduction, is_static
from .gate_fusion import PIPELINE, SMEM_BUDGET, SMS, STAGES, Tile, first_bk
from .gate_fusion import _cooperative_copy as cooperative_copy

logger = logging.getLogger(__name__)

DLIGHT_TILE = (32, 64)  # rows x columns of a thread block of dlight's gpu Matmul on CUDA
MIN_SPLIT_K = 256  # of K per slice at least (static rows)
MIN_SPLIT_K_SYMBOLIC = 1024  # ... for symbolic rows, which may be many (see choose_tile)
MAX_SPLIT = 16  # slices of K at most
KI_UNROLL = 16
WRITE_THREADS = 256  # threads per block of the second kernel (partials summed)
HALF = ("float16", "bfloat16")  # operand dtypes taken with a float32 accumulator
ONE_ROW = (64, 2)  # one row of half precision (decode): threads x columns per thread


def dlight_blocks(rows, cols: int) -> int | None:
    """Thread blocks of dlight's gpu Matmul for ``rows x cols`` (None for symbolic rows)."""
    if not is_static(rows):
        return None
    return -(-rows // DLIGHT_TILE[0]) * -(-cols // DLIGHT_TILE[1])


def smem_bytes(tile: Tile, elem: int = 4) -> int:
    """Shared memory of a tile's staged slabs, operands of ``elem`` bytes."""
    return STAGES * elem * tile.bk * (tile.bm + tile.bn)


def choose_tile(rows, cols: int, k: int, elem: int = 4) -> Tile | None:
    """Row block: the rows rounded up to 16, 32 or 64 (64 for symbolic or more rows), so that
    the weight is read from global memory once per 64 rows; columns: 64 per block (``TN = 4``);
    ``S``: the fewest slices of ``K`` giving ``SMS`` blocks, with at least ``MIN_SPLIT_K`` of
    ``K`` per slice. Reduction steps of 32 floats, or for 2-byte operands (``elem = 2``) the
    same 128 bytes of a row, 64 halves (a step dividing ``K`` preferred: ``first_bk``). One row
    of 2-byte operands (the GEMV of decode): ``ONE_ROW``, 64 threads of 2 columns each, no row
    padding. None when ``S`` would be 1 (nothing to split) or no tile fits."""
    if is_static(rows):
        bm = next((b for b in (16, 32, 64) if rows <= b), 64)
    else:
        bm = 64
    tn, tx = 4, 16
    tm = 4
    ty = bm // tm
    if is_static(rows) and rows == 1 and elem < 4:  # a GEMV: no row tile, wider column blocks
        tm, ty, (tx, tn) = 1, 1, ONE_ROW
    row_blocks = -(-rows // bm) if is_static(rows) else 1
    col_blocks = -(-cols // (tn * tx))
    tiles = row_blocks * col_blocks
    most = min(MAX_SPLIT, max(1, k // (MIN_SPLIT_K if is_static(rows) else MIN_SPLIT_K_SYMBOLIC)))
    split = min(most, -(-SMS // tiles))
    if split < 2:
        return None
    # of the splits up to twice as many, the fewest that divides K's steps (no padding)
    bk = 32 if elem >= 4 else first_bk(k, elem)
    steps = -(-k // bk)
    split = next((s for s in range(split, min(most, 2 * split) + 1) if steps % s == 0), split)
    tile = Tile(tm, ty, tx, bk, tn=tn, split=split)
    while smem_bytes(tile, elem) > SMEM_BUDGET and tile.bk > 8:
        tile = Tile(tm, ty, tx, tile.bk // 2, tn=tn, split=split)
    return tile if smem_bytes(tile, elem) <= SMEM_BUDGET else None


class SkinnyMatmul(ScheduleRule):
    def is_target_available(self, target: Target) -> bool:
        return _target.is_gpu(target)

    def apply(self, func, target: Target, tunable: bool):
        if (
            not isinstance(func, tirx.PrimFunc)
            or not self.is_target_available(target)
            or func.attrs.get("tirx.is_scheduled", False)
        ):
            return None
        sch = s_tir.Schedule(func)
        shape = _gemm_shape(sch)
        if isinstance(shape, str):
            logger.debug("skinny matmul (cuda): %s", shape)
            return None
        red, rows, cols, k, elem = shape
        under = dlight_blocks(rows, cols)
        if under is not None and under >= SMS:
            logger.debug("skinny matmul (cuda): dlight gives %d blocks already", under)
            return None
        tile = choose_tile(rows, cols, k, elem)
        if tile is None:
            logger.debug("skinny matmul (cuda): K = %d too short to split", k)
            return None
        try:
            return _schedule(sch, red, tile)
        except Exception as err:  # noqa: BLE001 - not the expected form: dlight's rules
            logger.debug("skinny matmul (cuda): schedule failed: %s", str(err)[:300])
            return None


def _gemm_shape(sch: s_tir.Schedule):
    """(reduction block, rows, columns, K, operand bytes) of a 2-D GEMM summed in float32
    (float32 operands, or float16 / bfloat16 ones widened), its elementwise producers inlined;
    or why not."""
    infos = normalize_prim_func(sch)
    if infos is None:
        return "not normalisable"
    reds = [i.block_rv for i in infos if is_reduction(sch, i.block_rv)]
    if len(reds) != 1:
        return f"{len(reds)} reduction blocks"
    (red,) = reds
    for info in infos:
        if info.block_rv.same_as(red) or is_reduction(sch, info.block_rv):
            continue
        if not info.is_injective():
            return "a block that is not elementwise"
    for producer in sch.get_producers(red):
        try:
            sch.compute_inline(producer)
        except Exception:  # noqa: BLE001 - a producer that does not inline
            return "a producer of the GEMM does not inline"
    stmt = sch.get(red)
    if len(stmt.reads) != 2 or len(stmt.writes) != 1:
        return "not a 2-D GEMM"
    if len(stmt.iter_vars) == 2:  # one row: normalize_prim_func dropped the unit row iterator
        i, (j, k) = tirx.IntImm("int64", 0), (iv.var for iv in stmt.iter_vars)
    elif len(stmt.iter_vars) == 3:
        i, j, k = (iv.var for iv in stmt.iter_vars)
    else:
        return "not a 2-D GEMM"
    kinds = [iv.iter_type for iv in stmt.iter_vars]
    if kinds != [tirx.IterVar.DataPar] * (len(kinds) - 1) + [tirx.IterVar.CommReduce]:
        return "not (rows, columns, reduction)"
    operands = {str(r.source.dtype) for r in stmt.reads}
    if str(stmt.writes[0].source.dtype) != "float32":
        return f"sums in {stmt.writes[0].source.dtype}, not float32"
    if operands != {"float32"} and not (len(operands) == 1 and operands <= set(HALF)):
        return f"operands {sorted(operands)}: not float32, float16 or bfloat16 alike"
    elem = 4 if operands == {"float32"} else 2
    if len(stmt.iter_vars) == 2 and elem == 4:
        return "one float32 row (dlight's GEMV / reduction rules take it)"
    a_idx = [r.min for r in stmt.reads[0].region]
    b_idx = [r.min for r in stmt.reads[1].region]
    c_idx = [r.min for r in stmt.writes[0].region]

    def same(got, want) -> bool:
        return len(got) == len(want) and all(
            (isinstance(w, tirx.IntImm) and isinstance(g, tirx.IntImm) and int(g) == int(w))
            or g.same_as(w)
            for g, w in zip(got, want, strict=True)
        )

    if not same(c_idx, [i, j]) or not same(a_idx, [i, k]):
        return "operands not A[i, k], C[i, j]"
    if not same(b_idx, [k, j]):
        return "B not [k, j] (B[j, k]: bank conflicts in this schedule's layout)"
    if not isinstance(stmt.body, tirx.BufferStore):
        return "not a store"
    dims = [iv.dom.extent for iv in stmt.iter_vars]
    if len(dims) == 2:
        dims = [tirx.IntImm("int64", 1), *dims]
    if not all(isinstance(d, tirx.IntImm) for d in dims[1:]):
        return "symbolic columns or reduction"
    rows = int(dims[0]) if isinstance(dims[0], tirx.IntImm) else dims[0]
    return red, rows, int(dims[1]), int(dims[2]), elem


def _schedule(sch: s_tir.Schedule, red, tile: Tile) -> s_tir.Schedule:
    stmt = sch.get(red)
    one_row = len(stmt.iter_vars) == 2  # (columns, K): no row loop
    rows = 1 if one_row else stmt.iter_vars[0].dom.extent
    k = int(stmt.iter_vars[-1].dom.extent)
    step = tile.split * tile.bk
    pad_rows = not one_row and (not isinstance(rows, tirx.IntImm) or int(rows) % tile.bm != 0)
    pads = []
    if pad_rows or k % step:
        # rows to the row block (no predicate on the register tile), K to the slices' steps
        factors = [1, step if k % step else 1]
        sch.pad_einsum(red, factors if one_row else [tile.bm if pad_rows else 1, *factors])
        pads = list(sch.get_producers(red))
    *_, kk = sch.get_loops(red)
    ks, kin = sch.split(kk, [tile.split, None])
    rf = sch.rfactor(ks, 0)  # rf: C_rf[s, i, j]; red: C[i, j] = sum_s C_rf[s, i, j]
    if one_row:
        j, s, kin = sch.get_loops(rf)
    else:
        i, j, s, kin = sch.get_loops(rf)
        by, ty, tm = sch.split(i, [None, tile.ty, tile.tm])
    bx, tx, tn = sch.split(j, [None, tile.tx, tile.tn])
    ko, ki = sch.split(kin, [None, tile.bk])
    if one_row:
        sch.reorder(s, bx, tx, ko, ki, tn)
        sch.bind(s, "blockIdx.y")
        thread = tx
    else:
        sch.reorder(s, by, bx, ty, tx, ko, ki, tm, tn)
        sch.bind(s, "blockIdx.z")
        sch.bind(by, "blockIdx.y")
        thread = sch.fuse(ty, tx)
    sch.bind(bx, "blockIdx.x")
    sch.bind(thread, "threadIdx.x")
    acc = sch.cache_write(rf, 0, "local")
    sch.reverse_compute_at(acc, thread, preserve_unit_loops=True)
    if not one_row:
        sch.unroll(tm)
    sch.unroll(tn)
    copies = []
    for index in range(2):
        buf = sch.get(rf).reads[index].source
        copy = sch.cache_read(rf, index, "shared")
        sch.compute_at(copy, ko, preserve_unit_loops=True)
        depth = 4 if one_row else 5  # the copy's loops start below ko
        cooperative_copy(sch, copy, depth, tile.threads, buf)
        copies.append(copy)
    if PIPELINE:
        sch.annotate(ko, "software_pipeline_stage", [0] * len(copies) + [1])
        sch.annotate(ko, "software_pipeline_order", list(range(len(copies) + 1)))
        sch.annotate(ko, "software_pipeline_async_stages", [0])
    sch.annotate(ki, "pragma_auto_unroll_max_step", KI_UNROLL)
    sch.annotate(ki, "pragma_unroll_explicit", 0)
    sch.decompose_reduction(rf, ko)
    for pad in pads:
        sch.compute_inline(pad)
    # the second kernel: the sum of the partials, the cut of padded rows, the epilogue; one
    # thread per result
    after = []
    block = red
    while sch.get_consumers(block):
        (block,) = sch.get_consumers(block)
        after.append(block)
    if after:
        final = after[-1]
        for other in after[:-1]:
            sch.compute_inline(other)
    else:  # no epilogue: the sum accumulates in a register, then one store
        final = sch.cache_write(red, 0, "local")
    loops = sch.get_loops(final)
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    bo, to = sch.split(fused, [None, WRITE_THREADS])
    sch.bind(bo, "blockIdx.x")
    sch.bind(to, "threadIdx.x")
    sch.compute_at(red, to, preserve_unit_loops=True)
    if after:
        sch.set_scope(red, 0, "local")
    return sch
