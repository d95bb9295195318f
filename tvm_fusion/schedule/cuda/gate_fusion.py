"""CUDA rule for FuseSplitGates' kernels, and the vector block ``V`` of their weights.

The kernel (see :mod:`tvm_fusion.schedule.cpu.gate_fusion` for its shape) has one reduction
block per gate GEMM, ``Y_j[rows, gate, d // V, d % V] += x_j[rows, k] * Wb_j[d // V, k, gate,
d % V]``, then the gate math, whose last block writes every result ``(rows, D)``. Both
schedules below are driven by that last block, and in both the GEMM outputs are ``local``: no
buffer of ``rows x gates x D`` exists, in global memory or anywhere else; the gate math runs on
a thread's registers and the results are written once.

**Tiled** (static rows >= ``MIN_TILED_ROWS``, or symbolic rows): thread blocks over (row block
``BM`` x unit block ``BN``; ``BN`` divides ``V``, so a block's weight slab is one contiguous run
of ``gates x BN`` floats per ``k``); each thread owns a ``TM x gates x TU`` register tile (``TU
= 4`` consecutive units of every gate of its GEMM). The reduction runs in steps of ``BK``: per
step the block stages ``x[BM, BK]`` and ``Wb[BK, gates, BN]`` in shared memory, the threads
copying them cooperatively with 16-byte copies (``cp.async`` on sm_80+ where the build sets
``tirx.use_async_copy``, as ``engine.compile_module`` does; else ``float4`` loads; ``x`` with
scalar copies when its row length ``K`` is not a multiple of 4, where 16 bytes would be
misaligned) in a 2-stage software pipeline (the next step's copy overlaps this step's math),
then every thread runs ``BK`` steps of ``TM x gates x TU`` FMAs from shared memory (the weights
as ``float4`` shared loads). The tile is the first of the preference order giving ``SMS``
thread blocks (132 SMs, an H100's: an assumption, the target does not say) where the problem
has that many tiles of at least one warp; a smaller problem gets the tile with the most blocks
(no in-block split-K yet). With ``tunable=True`` the tile is a
``sample_categorical`` decision among :func:`tunable_tiles` (the default first), and the split-K
GEMV's split of ``K`` among ``GEMV_SPLITS``: MetaSchedule's space for these kernels
(``tuning.gate_space``). Rows and ``K`` that the tiles do not divide are padded (``pad_einsum``;
the padding read in place, zeros past the end), units are guarded; no extent is refused. At most
``ACC_BUDGET`` accumulators per thread and ``SMEM_BUDGET`` bytes of static shared memory per
block (both stages).

Half precision (float16 / bfloat16 operands, accumulated in float32; kernels that
:mod:`.gate_tensor_core` does not take): sized by element size. A 16-byte copy is 8 halves
(4 bytes, then one element, where the slab's contiguous runs are not whole 16-byte vectors),
the unit block ``BN`` is whole vectors of the weight (or the whole block ``V``), shared memory
is counted in bytes and ``BK`` starts at 64 (a step dividing ``K`` preferred); the split-K
GEMV reads a ``k``'s ``gates x 4`` halves as 16-byte loads where they are whole vectors.

**Split-K GEMV** (:mod:`.gate_gemv`; static rows < ``MIN_TILED_ROWS``: batch-1 decode, LSTM/GRU
cells): the weight block is ``V = TU = 4`` (:func:`gate_block`), so one thread's weights of one
``k`` (all gates of 4 units) are contiguous and 32 lanes at consecutive ``k`` read one
contiguous run. A thread block per 4 units (``D / 4`` blocks: 256 for ``D = 1024``) and per
``RT`` rows; its ``KS`` threads split ``K`` (rfactor), each accumulating ``RT x gates x 4``
partial sums with ``float4`` weight loads; a cross-thread reduction (warp shuffles, then shared
memory across warps) per sum; then the gate math on the block's units, in the same kernel (both
GRU GEMMs too). ``K`` that ``KS`` does not divide is padded with zeros, read in place.

Gathered expert weights (FuseGatheredGates: ``Wb[ids[row], d // V, k, gate, d % V]``, ``V =
4``): each row reads its own expert's weight, so no tile of rows shares a slab; any row count,
symbolic too, takes the split-K GEMV (one row a block when symbolic), the weight read in place
(a local copy's region would span every expert) and ``K`` split by a divisor of it (pad_einsum
refuses the indirect read); the few-rows schedule where that fails.

Rows on several axes (a ``(batch, seq, K)`` input) are not tiled yet: static ones take the
split-K GEMV (correct, not the best schedule from 16 rows up), symbolic ones the few-rows one.

**Few rows** (what the two schedules above do not take: a kernel not of their form): units
tiled by ``V`` and rows by ``TM``; a thread owns one (row, unit) and keeps its ``gates``
accumulators in registers, running the whole reduction over ``K`` with scalar loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ... import target as _target
from .._common import GATE_ATTR, extent, gate_blocks, is_static
from . import gate_tensor_core
from .gate_gemv import ACC_BUDGET, TU, gathered, gemv_or_none, sample, vector
from .gate_gemv import elem_bytes as _elem_bytes

logger = logging.getLogger(__name__)

THREADS = 256  # few-rows path, per thread block: TM rows x V units
MIN_TILED_ROWS = 16  # static rows from which the tiled schedule runs
SMS = 132  # thread blocks wanted: an H100 SXM's streaming multiprocessors
# Tried and dropped: the first tile giving SMS x 512 threads in flight (1 x 2 x 4 register
# tiles, 352 blocks x 256 threads for SwiGLU's 64 x 2048 -> 2 x 5632, float32) ran 0.238 ms on an
# H200 against 0.210 ms for this rule's 176 x 128 (bench/gpu.md, 2026-11-26): more threads, each
# with less reuse of its shared-memory loads.
SMEM_BUDGET = 48 * 1024  # static shared memory per block
COPY_BYTES = (16, 4)  # a cooperative copy's widths: 128-bit where aligned, else one word
PIPELINE = True  # 2-stage software pipeline over the reduction steps
STAGES = 2 if PIPELINE else 1
KI_UNROLL = 16  # reduction steps unrolled per shared-memory slab
TUNABLE_TILES = 8  # tiles MetaSchedule chooses among (tunable_tiles)
# Float32 reduction step. Measured on an H100 (bench/gpu.md, 2026-11-27 16:10 UTC), SwiGLU's
# 64 x 2048 -> 2 x 5632 float32 gate, tile 4 x 16 x 8 (176 blocks x 128 threads): steps of 32
# 0.211 ms, of 16 0.134 ms (torch 0.090); 4 x 8 x 8 at 32: 0.161; 8 x 8 x 8: 0.187 at 32, 0.194
# at 16 (tiles of more than ACC_BUDGET accumulators, never the default). Same registers, no
# spills either way (ptxas: 79 / 72); half the shared memory (32 -> 16 KB per block).
FLOAT32_BK = 16
# Float32 tiles: the register tile of the first tile giving SMS blocks, in blocks of fewer
# threads where that gives FLOAT32_WAVES x SMS blocks (never smaller register tiles: see above).
# H100, bench/gpu.md (2026-11-27 19:00 UTC), ms, the SMS rule's tile -> this one: SwiGLU 64 x 2048
# -> 2 x 5632, 4 x 16 x 8 -> 4 x 8 x 8: 0.132 -> 0.112; 64 x 4096 -> 2 x 8192, same tiles: 0.259
# -> 0.241; 128 x 2048 -> 2 x 5632, 4 x 32 x 8 -> 4 x 16 x 8: 0.236 -> 0.181 (torch 0.090, 0.209,
# 0.147). Float16 (CUDA cores) not measured: unchanged.
FLOAT32_WAVES = 2


@dataclass(frozen=True)
class Tile:
    """One thread block: ``ty x tx`` threads, each ``tm`` rows x ``tn`` columns (the gate rule:
    ``TU`` units of every gate); reduction steps of ``bk``, in ``split`` slices of ``K`` (the
    skinny-GEMM rule's split-K; 1 for the gate rule)."""

    tm: int
    ty: int
    tx: int
    bk: int
    tn: int = TU
    split: int = 1

    @property
    def bm(self) -> int:
        return self.tm * self.ty

    @property
    def bn(self) -> int:
        return self.tx * self.tn

    @property
    def threads(self) -> int:
        return self.tx * self.ty


def gate_block(target: Target, width: int, gates: int, rows: int | None) -> int | None:
    """Units per weight block. Few static rows (the split-K GEMV): 4, so that one thread's
    ``gates x 4`` weights of one ``k`` are one contiguous run and a warp's 32 consecutive ``k``
    one contiguous slab. Otherwise 32 (the widest the tiles read as one run) when it divides
    ``width``, else the largest of 16, 8, 4 that does. A ``width`` that the block does not
    divide is padded by FuseSplitGates with zero columns; one narrower than 4 gets None (not
    fused)."""
    del target, gates
    if width < TU:
        return None  # narrower than one float4: nothing to block
    if rows is not None and rows < MIN_TILED_ROWS:
        return TU
    for v in (32, 16, 8, 4):
        if width % v == 0:
            return v
    return 32 if width >= 32 else TU


def first_bk(k_max: int, elem: int = 4) -> int:
    """The reduction step to start from: 16 for 4-byte elements (``FLOAT32_BK``); for 2-byte
    ones as many bytes of each row (64, or 32, 16 for a shorter ``K``), a step that divides
    ``K`` preferred (down to 8: one 16-byte copy per row), since a padded ``K`` takes scalar
    copies."""
    if elem >= 4:
        return FLOAT32_BK
    fits = [bk for bk in (64, 32, 16) if bk <= k_max] or [16]
    return next((bk for bk in (*fits, 8) if bk <= k_max and k_max % bk == 0), fits[0])


def tile_candidates(
    rows, block: int, gemm_gates: list[int], k_max: int, elem: int = 4
) -> list[Tile]:
    """Every tile within the budgets (``ACC_BUDGET`` accumulators per thread, 32 to 256
    threads, ``SMEM_BUDGET`` of shared memory with the largest reduction step that fits), in
    order of preference: the largest register tile, then the widest unit block, then the most
    threads. A static ``rows`` takes no tile twice as tall or taller (mostly padding). ``elem``:
    bytes per operand element (2 for float16 / bfloat16): the unit block is whole 16-byte
    vectors of the weight (or the whole weight block ``V``, one contiguous run per ``k``)."""
    total_gates = sum(gemm_gates)
    tms = [tm for tm in (8, 4, 2, 1) if total_gates * tm * TU <= ACC_BUDGET] or [1]
    txs = [
        tx
        for tx in (8, 4, 2, 1)
        if tx * TU <= block and (tx * TU % vector(elem) == 0 or tx * TU == block)
    ] or [block // TU]
    candidates = []
    for tm in tms:
        for tx in txs:
            for ty in (32, 16, 8, 4, 2, 1):
                if not 32 <= tx * ty <= 256:
                    continue
                if is_static(rows) and tm * ty >= 2 * rows and tm * ty > 8:
                    continue
                tile = _fit_smem(Tile(tm, ty, tx, first_bk(k_max, elem)), gemm_gates, elem)
                if tile is not None:
                    candidates.append(tile)
    return candidates


def choose_tile(
    rows, units: int, block: int, gemm_gates: list[int], k_max: int, elem: int = 4
) -> Tile:
    """The first of :func:`tile_candidates` that still gives ``SMS`` blocks (float32: its register
    tile in the most threads per block that give ``FLOAT32_WAVES x SMS`` blocks, where some
    do); of tiles that all give fewer, the one with the most blocks.

    ``rows`` may be symbolic (then the largest tile of 8 thread rows); ``units`` is the padded
    width (a multiple of ``block``); ``gemm_gates`` the gates of each GEMM (their accumulators
    are all live at the gate math); ``k_max`` the longest reduction; ``elem`` the bytes per
    operand element."""
    candidates = tile_candidates(rows, block, gemm_gates, k_max, elem)
    if not candidates:  # nothing fits the budgets: the smallest tile
        tx = min(tx for tx in (8, 4, 2, 1) if tx * TU <= block)
        return Tile(1, 32 // tx, tx, 8)
    if not is_static(rows):
        return next((t for t in candidates if t.ty == 8), candidates[0])
    first = next((t for t in candidates if blocks(t, rows, units) >= SMS), None)
    if first is None:
        return max(candidates, key=lambda t: (blocks(t, rows, units), t.tm, t.bn))
    if elem < 4:
        return first
    # float32: the same register tile, in blocks of fewer threads
    same = [t for t in candidates if (t.tm, t.tx, t.bk) == (first.tm, first.tx, first.bk)]
    return next((t for t in same if blocks(t, rows, units) >= FLOAT32_WAVES * SMS), first)


def tunable_tiles(
    rows, units: int, block: int, gemm_gates: list[int], k_max: int, elem: int = 4
) -> list[Tile]:
    """The tiles MetaSchedule chooses among (``apply(..., tunable=True)``): :func:`choose_tile`'s
    first, then up to ``TUNABLE_TILES - 1`` others of :func:`tile_candidates` and their variants
    with half the reduction step, in that order of preference; for static rows only those
    that give as many blocks as the default or ``SMS``. All are within the budgets."""
    default = choose_tile(rows, units, block, gemm_gates, k_max, elem)
    wanted = min(SMS, blocks(default, rows, units)) if is_static(rows) else 0
    options = [default]
    for tile in tile_candidates(rows, block, gemm_gates, k_max, elem):
        for variant in (tile, Tile(tile.tm, tile.ty, tile.tx, tile.bk // 2)):
            if len(options) == TUNABLE_TILES:
                return options
            if variant in options or variant.bk < 8:
                continue
            if is_static(rows) and blocks(variant, rows, units) < wanted:
                continue
            options.append(variant)
    return options


def _fit_smem(tile: Tile, gemm_gates: list[int], elem: int = 4) -> Tile | None:
    """``tile`` with its reduction step halved until its shared memory fits, or None."""
    while _smem_bytes(tile, gemm_gates, elem) > SMEM_BUDGET:
        if tile.bk <= 8:
            return None
        tile = Tile(tile.tm, tile.ty, tile.tx, tile.bk // 2)
    return tile


def blocks(tile: Tile, rows: int, units: int) -> int:
    return -(-rows // tile.bm) * -(-units // tile.bn)


def _smem_bytes(tile: Tile, gemm_gates: list[int], elem: int = 4) -> int:
    """Shared memory: every GEMM's ``x`` and weight slab (``elem`` bytes an element) for
    ``STAGES`` reduction steps."""
    return STAGES * sum(elem * tile.bk * (tile.bm + gates * tile.bn) for gates in gemm_gates)


class GateFusion(ScheduleRule):
    def is_target_available(self, target: Target) -> bool:
        return _target.is_gpu(target)

    def apply(self, func, target: Target, tunable: bool):
        if (
            not isinstance(func, tirx.PrimFunc)
            or not self.is_target_available(target)
            or func.attrs.get("tirx.is_scheduled", False)
            or GATE_ATTR not in func.attrs
        ):
            return None
        tensor_core = gate_tensor_core.schedule(func, target)  # float16 / bfloat16 GEMMs
        if tensor_core is not None:
            return tensor_core
        block = int(func.attrs[GATE_ATTR]["block"])
        found = gate_blocks(func)
        if found is None:
            return None
        sch, reductions, finals, inner = found
        params = set(func.params)
        if not finals:
            return None
        *row_loops, _ = sch.get_loops(finals[0])
        if gathered(sch, reductions):
            # each row reads its own expert's weight: no slab shared by a tile of rows; the
            # split-K GEMV per row (FuseGatheredGates gives such kernels 4-unit blocks), any
            # row count, symbolic too
            if block % TU == 0:
                gemv = gemv_or_none(func, params, tunable)
                if gemv is not None:
                    return gemv
            return _few_rows(sch, block, reductions, finals, inner)
        if row_loops:
            rows = 1
            for loop in row_loops:
                ext = extent(sch, loop)
                rows = ext if not is_static(rows) or not is_static(ext) else rows * ext
            if not is_static(rows) or rows >= MIN_TILED_ROWS:
                tiled = self._tiled(func, block, reductions, finals, inner, sch, rows, tunable)
                if tiled is not None:
                    return tiled
                # not the expected form: the few-rows schedule, from the unscheduled function
                sch, reductions, finals, inner = gate_blocks(func)
        if (not row_loops or is_static(rows)) and block % TU == 0:
            gemv = gemv_or_none(func, params, tunable)
            if gemv is not None:
                return gemv
        return _few_rows(sch, block, reductions, finals, inner)

    def _tiled(self, func, block, reductions, finals, inner, sch, rows, tunable=False):
        gemm_gates, k_max, units, elem = _gemm_shapes(sch, reductions, block)
        if gemm_gates is None:
            logger.debug("gate fusion (cuda): GEMMs not of the blocked form, few-rows schedule")
            return None
        if tunable:
            tile = sample(sch, tunable_tiles(rows, units, block, gemm_gates, k_max, elem))
        else:
            tile = choose_tile(rows, units, block, gemm_gates, k_max, elem)
        try:
            return _schedule_tiled(sch, tile, reductions, finals, inner)
        except Exception as err:  # noqa: BLE001 - not the expected form: the few-rows schedule
            logger.debug("gate fusion (cuda): tiled schedule failed: %s", str(err)[:300])
            return None


def _gemm_shapes(sch: s_tir.Schedule, reductions: list, block: int):
    """Gates of each GEMM ``Y[rows..., gates, D/V, V]`` (read from its output buffer: unit
    axes may have been dropped from its loops), the longest ``K``, the padded width ``D`` and
    the widest operand element in bytes (4, or 2 for float16 / bfloat16 operands); (None, 0, 0,
    0) when a GEMM is not of that form."""
    gates, k_max, units, elem = [], 0, 0, 0
    for red in reductions:
        stmt = sch.get(red)
        reduce = [iv for iv in stmt.iter_vars if iv.iter_type == iv.CommReduce]
        shape = stmt.writes[0].source.shape if len(stmt.writes) == 1 else []
        if len(reduce) != 1 or len(shape) < 4:
            return None, 0, 0, 0
        g, do, di = shape[-3:]
        k = reduce[0].dom.extent
        if not all(isinstance(e, tirx.IntImm) for e in (g, do, di, k)) or int(di) != block:
            return None, 0, 0, 0
        gates.append(int(g))
        k_max = max(k_max, int(k))
        units = max(units, int(do) * int(di))
        own = stmt.writes[0].source
        operands = [r.source for r in stmt.reads if not r.source.same_as(own)]
        elem = max([elem] + [_elem_bytes(b) for b in operands])
    return gates, k_max, units, elem


def _pad(sch: s_tir.Schedule, red, tile: Tile) -> list:
    """Pad one GEMM's rows to a multiple of ``BM`` and its reduction to a multiple of ``BK``
    (``pad_einsum``; the cut back to the real rows inlined into the gate math): the thread tiles
    then carry no predicate, so that their accumulators keep a constant size in registers
    (symbolic rows under a predicate gave a stack allocation of symbolic size). Returns the
    padding blocks, later inlined into the shared-memory copies (no padded copy in global
    memory remains)."""
    stmt = sch.get(red)
    if len(stmt.writes) != 1 or len(stmt.writes[0].source.shape) != 4:
        raise s_tir.schedule.ScheduleError("not one row axis")
    factors = [
        tile.bk if iv.iter_type == iv.CommReduce else (tile.bm if i == 0 else 1)
        for i, iv in enumerate(stmt.iter_vars)
    ]
    extents = [iv.dom.extent for iv in stmt.iter_vars]
    if all(
        isinstance(e, tirx.IntImm) and int(e) % f == 0
        for e, f in zip(extents, factors, strict=True)
    ):
        return []  # the tiles divide every extent
    before = {sch.get(b).name_hint for b in sch.get_consumers(red)}
    sch.pad_einsum(red, factors)
    pads = list(sch.get_producers(red))
    for cut in sch.get_consumers(red):
        if sch.get(cut).name_hint not in before:
            sch.compute_inline(cut)
    return pads


def _schedule_tiled(sch: s_tir.Schedule, tile: Tile, reductions, finals, inner):
    pads = [p for red in reductions for p in _pad(sch, red, tile)]
    *row_loops, unit_loop = sch.get_loops(finals[0])
    rows = sch.fuse(*row_loops) if len(row_loops) > 1 else row_loops[0]
    bx, tx, tu = sch.split(unit_loop, [None, tile.tx, TU])
    by, ty, tm = sch.split(rows, [None, tile.ty, tile.tm])
    sch.reorder(by, bx, ty, tx, tm, tu)
    sch.bind(by, "blockIdx.y")
    sch.bind(bx, "blockIdx.x")
    thread = sch.fuse(ty, tx)
    sch.bind(thread, "threadIdx.x")
    tloop = sch.get(thread)
    for final in finals:
        if not any(sch.get(loop).same_as(tloop) for loop in sch.get_loops(final)):
            raise s_tir.schedule.ScheduleError("results are not written from one loop nest")
    depth = len(sch.get_loops(finals[0])) - 2  # blockIdx.y, blockIdx.x, threadIdx.x
    for tile_loop in (tm, tu):
        sch.unroll(tile_loop)

    for other in reversed(inner):
        sch.compute_at(other, thread, preserve_unit_loops=True)
        sch.set_scope(other, 0, "local")
    for red in reductions:
        sch.compute_at(red, thread, preserve_unit_loops=True)
        sch.set_scope(red, 0, "local")
        *acc, k_loop = sch.get_loops(red)[depth:]  # rows, gate, unit block, units, reduction
        ko, ki = sch.split(k_loop, [None, tile.bk])
        sch.reorder(ko, ki, *acc)
        for loop in acc:
            sch.unroll(loop)
        buffers = [region.source for region in sch.get(red).reads]
        own = [w.source for w in sch.get(red).writes]
        copies = []
        for index, buf in enumerate(buffers):
            if any(buf.same_as(o) for o in own):
                continue
            copy = sch.cache_read(red, index, "shared")
            sch.compute_at(copy, ko, preserve_unit_loops=True)
            _cooperative_copy(sch, copy, depth + 1, tile.threads, buf)
            copies.append(copy)
        if PIPELINE:
            sch.annotate(ko, "software_pipeline_stage", [0] * len(copies) + [1])
            sch.annotate(ko, "software_pipeline_order", list(range(len(copies) + 1)))
            sch.annotate(ko, "software_pipeline_async_stages", [0])
        sch.annotate(ki, "pragma_auto_unroll_max_step", KI_UNROLL)
        sch.annotate(ki, "pragma_unroll_explicit", 0)
        try:
            sch.decompose_reduction(red, ko)
        except s_tir.schedule.ScheduleError as err:
            # rows of a 3-D input fused into one symbolic loop: the init stays in the block
            logger.debug("gate fusion (cuda): init not decomposed: %s", str(err)[:200])
    for pad in pads:
        sch.compute_inline(pad)
    return sch


def _cooperative_copy(sch: s_tir.Schedule, copy, depth: int, threads: int, buf) -> None:
    """All threads of the block copy one reduction step's slab: the copy's loops fused, split
    over the threads, 16 bytes a copy (4 floats, 8 halves) where every contiguous run of the
    slab is whole 16-byte vectors and starts 16-byte aligned, else 4 bytes (2 halves) where
    that holds, else one element. (A padded ``buf`` is read in place under a predicate on the
    padded axis, which makes TVM's vectorizer copy such a slab element by element.)"""
    loops = sch.get_loops(copy)[depth:]
    width = _copy_width(sch, loops, buf)
    fused = sch.fuse(*loops)
    if width > 1:
        _, tx, vec = sch.split(fused, [None, threads, width])
        sch.vectorize(vec)
    else:
        _, tx = sch.split(fused, [None, threads])
    sch.bind(tx, "threadIdx.x")


def _copy_width(sch: s_tir.Schedule, loops, buf) -> int:
    """Elements per copy of a slab whose loops (one per axis of ``buf``) are ``loops``. A
    contiguous run of the slab: the innermost loop, times the loops outside it while those
    inside span their whole axis (a weight block's ``gates x V`` units of one ``k``). Each run
    starts at a multiple of its length (the slabs are tiles), and the axes it spans together
    are a multiple of the width apart."""
    extents = [extent(sch, loop) for loop in loops]
    if len(extents) != len(buf.shape):
        extents = extents[-1:]  # the innermost loop alone
    run, span = 1, 1
    for ext, dim in zip(reversed(extents), reversed(list(buf.shape)), strict=False):
        if not isinstance(ext, int) or not isinstance(dim, tirx.IntImm):
            break  # a symbolic axis: runs within the axes inside it
        run, span = run * ext, span * int(dim)
        if ext != int(dim):
            break
    elem = _elem_bytes(buf)
    if run == 1:
        return 1
    for nbytes in COPY_BYTES:
        width = max(1, nbytes // elem)
        if run % width == 0 and span % width == 0:
            return width
    return 1


def _few_rows(sch: s_tir.Schedule, block: int, reductions, finals, inner):
    """One (row, unit) per thread, ``gates`` accumulators in registers, the whole ``K``."""
    *row_loops, unit_loop = sch.get_loops(finals[0])
    jo, ji = sch.split(unit_loop, [None, block])
    if row_loops:
        rows = sch.fuse(*row_loops) if len(row_loops) > 1 else row_loops[0]
        tm = tile_rows(extent(sch, rows), block)
        io, ii = sch.split(rows, [None, tm])
        sch.reorder(jo, io, ii, ji)
        sch.bind(jo, "blockIdx.x")
        sch.bind(io, "blockIdx.y")
        thread = sch.fuse(ii, ji)
    else:
        sch.bind(jo, "blockIdx.x")
        thread = ji
    sch.bind(thread, "threadIdx.x")
    tloop = sch.get(thread)
    for final in finals:
        if not any(sch.get(loop).same_as(tloop) for loop in sch.get_loops(final)):
            logger.debug("gate fusion (cuda): results are not written from one loop nest")
            return None
    depth = len(sch.get_loops(finals[0]))  # block x, [block y,] thread

    for other in reversed(inner):
        sch.compute_at(other, thread, preserve_unit_loops=True)
        sch.set_scope(other, 0, "local")
    for red in reductions:
        sch.compute_at(red, thread, preserve_unit_loops=True)
        sch.set_scope(red, 0, "local")
        *tile, k_loop = sch.get_loops(red)[depth:]  # rows, gate, unit (unit extents), reduction
        sch.reorder(k_loop, *tile)
        for loop in tile:
            sch.unroll(loop)
        ko, ki = sch.split(k_loop, [None, 4]) if _divisible(sch, k_loop, 4) else (k_loop, None)
        if ki is not None:
            sch.unroll(ki)
        try:
            sch.decompose_reduction(red, ko)
        except s_tir.schedule.ScheduleError as err:
            # rows of a 3-D input (batch, seq, K) fused into one symbolic loop: the init
            # stays in the reduction block (correct, one compare per step)
            logger.debug("gate fusion (cuda): init not decomposed: %s", str(err)[:200])
    return sch


def tile_rows(rows, block: int) -> int:
    """Few-rows path: rows per thread block, ``THREADS / V``, fewer when ``rows`` is smaller."""
    tm = max(1, THREADS // block)
    if is_static(rows):
        tm = min(tm, rows)
    return tm


def _divisible(sch: s_tir.Schedule, loop, factor: int) -> bool:
    n = extent(sch, loop)
    return isinstance(n, int) and n % factor == 0 and n > factor
