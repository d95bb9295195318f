"""CPU rule for FuseSplitGates' kernels: every gate of ``V`` units on one register tile.

Applies to PrimFuncs carrying the ``tvm_fusion.gate_fusion`` attribute (block ``V``, number of
gates). Such a kernel has one reduction block per gate GEMM, ``Y_j[rows, gate, d]``, reading the
blocked weight ``Wb_j[d // V, k, gate, d % V]``, then the gate math, whose last block writes
every result ``(rows, D)`` (FuseSplitGates makes it one block).

The schedule is driven by that last block: its rows are tiled by ``MR`` and its units by ``V``;
the rest of the gate math and every GEMM are computed at that tile. In a tile each GEMM's
reduction runs outermost and ``MR x gates x V`` accumulators stay in registers (rows and gates
unrolled, ``V`` vectorised); then the gate math runs on the tile. The GEMM outputs are
tile-local (``local`` scope): no buffer of ``rows x gates x D`` is ever allocated. Tiles run in
parallel.
"""

from __future__ import annotations

import logging

from tvm import s_tir
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.target import Target

from ... import target as _target
from .._common import (
    CPURule,
    extent,
    is_reduction,
    is_static,
    parallelize_outer,
    try_inline_safe,
    vectorize_innermost,
)

GATE_ATTR = "tvm_fusion.gate_fusion"
logger = logging.getLogger(__name__)


def tile_rows(rows, gates: int, block: int, lanes: int, regs: int) -> int:
    """Rows per register tile: ``rows x gates x block/lanes`` accumulators in half the regs."""
    per_row = gates * max(block // lanes, 1)
    mr = max(1, (regs // 2) // per_row)
    if is_static(rows):
        while mr > 1 and rows % mr:
            mr -= 1
        return min(mr, rows)
    # Symbolic rows: one row per tile; a taller tile needs a tail predicate, under which TVM
    # 0.27 does not compact the accumulator to registers (see cpu/matmul.py `_tile`).
    return 1


class GateFusion(CPURule):
    def apply(self, func, target: Target, tunable: bool):
        if not self.applicable(func, target) or GATE_ATTR not in func.attrs:
            return None
        hints = func.attrs[GATE_ATTR]
        block, gates = int(hints["block"]), int(hints["gates"])
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
        lanes = _target.vector_lanes(target, "float32")
        regs = 32 if _target.vector_bits(target) >= 512 else 16

        # FuseSplitGates writes every result from one loop nest (a multi-output compute): tile
        # it; everything the results read is then computed at the tile (compute_at wants every
        # consumer under the loop, which holds once all outputs share it).
        *row_loops, unit_loop = sch.get_loops(finals[0])  # no row loop for a single row
        jo, ji = sch.split(unit_loop, [None, block])
        if row_loops:
            mr = tile_rows(extent(sch, row_loops[-1]), gates, block, lanes, regs)
            io, ii = sch.split(row_loops[-1], [None, mr])
            sch.reorder(*row_loops[:-1], jo, io, ii, ji)
            outer = [*row_loops[:-1], jo, io]
        else:
            io = jo
            outer = [jo]
        tile = sch.get(io)
        for final in finals:
            if not any(sch.get(loop).same_as(tile) for loop in sch.get_loops(final)):
                logger.debug("gate fusion: results are not written from one loop nest")
                return None
        vectorize_innermost(sch, finals[0], lanes)  # the results share their loops

        for other in reversed(inner):  # the rest of the gate math, then the GEMMs
            sch.compute_at(other, io, preserve_unit_loops=True)
            vectorize_innermost(sch, other, lanes)
        for red in reductions:
            sch.compute_at(red, io, preserve_unit_loops=True)

        parallelize_outer(sch, outer, _target.num_cores(target), min_extent_per_core=4)

        for red in reductions:
            sch.set_scope(red, 0, "local")
            *tile, k_loop = sch.get_loops(red)[len(outer) :]  # rows, gate, unit, reduction
            sch.reorder(k_loop, *tile)
            unit = tile[-1]
            if extent(sch, unit) > lanes and extent(sch, unit) % lanes == 0:
                uo, uv = sch.split(unit, [None, lanes])
                sch.vectorize(uv)
                sch.unroll(uo)
            else:
                sch.vectorize(unit)
            for loop in tile[:-1]:
                sch.unroll(loop)
            init = sch.decompose_reduction(red, k_loop)
            vectorize_innermost(sch, init, lanes)
        return sch
