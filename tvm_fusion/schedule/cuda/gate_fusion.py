"""CUDA rule for FuseSplitGates' kernels, and the vector block ``V`` of their weights.

The kernel (see :mod:`tvm_fusion.schedule.cpu.gate_fusion` for its shape) is scheduled from its
last block, which writes every result ``(rows, D)``: units are tiled by ``V`` (the weight
block, 32 = one warp when it divides ``D``) and rows by ``TM``. A thread block computes a
``TM x V`` tile of units for every gate; a thread owns one (row, unit) and keeps its ``gates``
accumulators in registers, running the reduction over ``K`` and then the gate math on them.
The GEMM outputs are ``local``: no buffer of ``rows x gates x D`` exists, in global memory or
anywhere else.

Memory traffic: for one ``k``, the 32 lanes of a warp read 32 consecutive floats of the blocked
weight ``Wb[d // V, k, gate, d % V]`` (coalesced) and one broadcast element of ``x``. Rows of a
thread block re-read the same weight panel from L1/L2. There is no shared-memory staging or
split-K yet: a batch-1 cell runs ``D / V`` warps, a fraction of an H100 (see issue #4's notes).
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ... import target as _target
from .._common import extent, is_reduction, is_static, try_inline_safe

GATE_ATTR = "tvm_fusion.gate_fusion"
logger = logging.getLogger(__name__)

THREADS = 256  # per thread block: TM rows x V units


def gate_block(target: Target, width: int, gates: int, rows: int | None) -> int | None:
    """Units per thread-block tile column: 32 (a warp's worth) when it divides ``width``."""
    del target, gates, rows
    for v in (32, 16, 8, 4):
        if width % v == 0:
            return v
    return None


def tile_rows(rows, block: int) -> int:
    """Rows per thread block: ``THREADS / V``, fewer when ``rows`` is smaller (static)."""
    tm = max(1, THREADS // block)
    if is_static(rows):
        tm = min(tm, rows)
    return tm


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
        block = int(func.attrs[GATE_ATTR]["block"])
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        reductions = [i.block_rv for i in infos if is_reduction(sch, i.block_rv)]
        others = [i for i in infos if not is_reduction(sch, i.block_rv)]
        if not reductions or not others:
            return None
        remaining = [i.block_rv for i in try_inline_safe(sch, others)]
        params = set(func.params)
        finals = [b for b in remaining if any(w.source in params for w in sch.get(b).writes)]
        inner = [b for b in remaining if b not in finals]
        if not finals:
            return None

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


def _divisible(sch: s_tir.Schedule, loop, factor: int) -> bool:
    n = extent(sch, loop)
    return isinstance(n, int) and n % factor == 0 and n > factor
