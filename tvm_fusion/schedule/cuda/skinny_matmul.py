"""CUDA rule for skinny GEMMs: few rows, many columns, a long reduction (split-K).

Matched: a PrimFunc with one reduction block ``C[i, j] += A[i, k] * B[k, j]`` (a constant
weight, which the pipeline transposes at compile time, reads that way), float32, static ``N``
and ``K``, static or symbolic ``M`` (rows), optionally followed by elementwise blocks (an
epilogue: bias, residual) and preceded by elementwise blocks that inline into it. It fires
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
2. The sum of the ``S`` partials per result, and the epilogue, one thread per result.

Rows and ``K`` that the tiles do not divide are padded (``pad_einsum``; the padding read in
place), so no extent is refused once the rule fires. Skipped (left to dlight, with a debug
reason): other dtypes (half precision goes to dlight's tensor-core path or ours), batched
GEMMs, ``B`` as ``[j, k]`` (a weight parameter: its ``BN x BK`` slab, read along ``j`` by the
threads of a warp, would take 16-way shared-memory bank conflicts in this layout), GEMMs
dlight already spreads over the SMs, ``K`` too short to split.
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ... import target as _target
from .._common import is_reduction, is_static
from .gate_fusion import PIPELINE, SMEM_BUDGET, SMS, STAGES, Tile
from .gate_fusion import _cooperative_copy as cooperative_copy

logger = logging.getLogger(__name__)

DLIGHT_TILE = (32, 64)  # rows x columns of a thread block of dlight's gpu Matmul on CUDA
MIN_SPLIT_K = 256  # of K per slice at least (static rows)
MIN_SPLIT_K_SYMBOLIC = 1024  # ... for symbolic rows, which may be many (see choose_tile)
MAX_SPLIT = 16  # slices of K at most
KI_UNROLL = 16
WRITE_THREADS = 256  # threads per block of the second kernel (partials summed)


def dlight_blocks(rows, cols: int) -> int | None:
    """Thread blocks of dlight's gpu Matmul for ``rows x cols`` (None for symbolic rows)."""
    if not is_static(rows):
        return None
    return -(-rows // DLIGHT_TILE[0]) * -(-cols // DLIGHT_TILE[1])


def smem_bytes(tile: Tile) -> int:
    return STAGES * 4 * tile.bk * (tile.bm + tile.bn)


def choose_tile(rows, cols: int, k: int) -> Tile | None:
    """Row block: the rows rounded up to 16, 32 or 64 (64 for symbolic or more rows), so that
    the weight is read from global memory once per 64 rows; columns: 64 per block (``TN = 4``);
    ``S``: the fewest slices of ``K`` giving ``SMS`` blocks, with at least ``MIN_SPLIT_K`` of
    ``K`` per slice. None when ``S`` would be 1 (nothing to split) or no tile fits."""
    if is_static(rows):
        bm = next((b for b in (16, 32, 64) if rows <= b), 64)
    else:
        bm = 64
    tn, tx = 4, 16
    tm = 4
    ty = bm // tm
    row_blocks = -(-rows // bm) if is_static(rows) else 1
    col_blocks = -(-cols // (tn * tx))
    tiles = row_blocks * col_blocks
    most = min(MAX_SPLIT, max(1, k // (MIN_SPLIT_K if is_static(rows) else MIN_SPLIT_K_SYMBOLIC)))
    split = min(most, -(-SMS // tiles))
    if split < 2:
        return None
    # of the splits up to twice as many, the fewest that divides K's steps (no padding)
    steps = -(-k // 32)
    split = next((s for s in range(split, min(most, 2 * split) + 1) if steps % s == 0), split)
    tile = Tile(tm, ty, tx, 32, tn=tn, split=split)
    while smem_bytes(tile) > SMEM_BUDGET and tile.bk > 8:
        tile = Tile(tm, ty, tx, tile.bk // 2, tn=tn, split=split)
    return tile if smem_bytes(tile) <= SMEM_BUDGET else None


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
        red, rows, cols, k = shape
        under = dlight_blocks(rows, cols)
        if under is not None and under >= SMS:
            logger.debug("skinny matmul (cuda): dlight gives %d blocks already", under)
            return None
        tile = choose_tile(rows, cols, k)
        if tile is None:
            logger.debug("skinny matmul (cuda): K = %d too short to split", k)
            return None
        try:
            return _schedule(sch, red, tile)
        except Exception as err:  # noqa: BLE001 - not the expected form: dlight's rules
            logger.debug("skinny matmul (cuda): schedule failed: %s", str(err)[:300])
            return None


def _gemm_shape(sch: s_tir.Schedule):
    """(reduction block, rows, columns, K) of a 2-D float32 GEMM, its elementwise producers
    inlined; or why not."""
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
    if len(stmt.iter_vars) != 3 or len(stmt.reads) != 2 or len(stmt.writes) != 1:
        return "not a 2-D GEMM"
    i, j, k = (iv.var for iv in stmt.iter_vars)
    kinds = [iv.iter_type for iv in stmt.iter_vars]
    if kinds != [tirx.IterVar.DataPar, tirx.IterVar.DataPar, tirx.IterVar.CommReduce]:
        return "not (rows, columns, reduction)"
    if any(str(r.source.dtype) != "float32" for r in [*stmt.reads, *stmt.writes]):
        return "not float32"
    a_idx = [r.min for r in stmt.reads[0].region]
    b_idx = [r.min for r in stmt.reads[1].region]
    c_idx = [r.min for r in stmt.writes[0].region]
    same = lambda got, want: (
        len(got) == len(want)
        and all(  # noqa: E731
            g.same_as(w) for g, w in zip(got, want, strict=True)
        )
    )
    if not same(c_idx, [i, j]) or not same(a_idx, [i, k]):
        return "operands not A[i, k], C[i, j]"
    if not same(b_idx, [k, j]):
        return "B not [k, j] (B[j, k]: bank conflicts in this schedule's layout)"
    if not isinstance(stmt.body, tirx.BufferStore):
        return "not a store"
    dims = [iv.dom.extent for iv in stmt.iter_vars]
    if not all(isinstance(d, tirx.IntImm) for d in dims[1:]):
        return "symbolic columns or reduction"
    rows = int(dims[0]) if isinstance(dims[0], tirx.IntImm) else dims[0]
    return red, rows, int(dims[1]), int(dims[2])


def _schedule(sch: s_tir.Schedule, red, tile: Tile) -> s_tir.Schedule:
    stmt = sch.get(red)
    rows, k = stmt.iter_vars[0].dom.extent, int(stmt.iter_vars[2].dom.extent)
    step = tile.split * tile.bk
    pad_rows = not isinstance(rows, tirx.IntImm) or int(rows) % tile.bm != 0
    pads = []
    if pad_rows or k % step:
        # rows to the row block (no predicate on the register tile), K to the slices' steps
        sch.pad_einsum(red, [tile.bm if pad_rows else 1, 1, step if k % step else 1])
        pads = list(sch.get_producers(red))
    i, j, kk = sch.get_loops(red)
    ks, kin = sch.split(kk, [tile.split, None])
    rf = sch.rfactor(ks, 0)  # rf: C_rf[s, i, j]; red: C[i, j] = sum_s C_rf[s, i, j]
    i, j, s, kin = sch.get_loops(rf)
    by, ty, tm = sch.split(i, [None, tile.ty, tile.tm])
    bx, tx, tn = sch.split(j, [None, tile.tx, tile.tn])
    ko, ki = sch.split(kin, [None, tile.bk])
    sch.reorder(s, by, bx, ty, tx, ko, ki, tm, tn)
    sch.bind(s, "blockIdx.z")
    sch.bind(by, "blockIdx.y")
    sch.bind(bx, "blockIdx.x")
    thread = sch.fuse(ty, tx)
    sch.bind(thread, "threadIdx.x")
    acc = sch.cache_write(rf, 0, "local")
    sch.reverse_compute_at(acc, thread, preserve_unit_loops=True)
    sch.unroll(tm)
    sch.unroll(tn)
    copies = []
    for index in range(2):
        buf = sch.get(rf).reads[index].source
        copy = sch.cache_read(rf, index, "shared")
        sch.compute_at(copy, ko, preserve_unit_loops=True)
        cooperative_copy(sch, copy, 5, tile.threads, buf)  # below ko
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
