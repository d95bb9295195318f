"""CPU rule for FuseSplitGates' kernels: every gate of ``V`` units on one register tile.

Applies to PrimFuncs carrying the ``tvm_fusion.gate_fusion`` attribute (block ``V``, number of
gates; ``rows``: the tile that a gathered kernel's GEMM rows were built padded to). Such a
kernel has one reduction block per gate GEMM, ``Y_j[rows, gate, d // V, d % V]`` (blocked like
the weight it reads, ``Wb_j[d // V, k, gate, d % V]``), then the gate math, whose last block
writes every result ``(rows, D)`` (FuseSplitGates makes it one block).

The schedule is driven by that last block: its rows are tiled by ``MR`` and its units by ``V``;
the rest of the gate math and every GEMM are computed at that tile. In a tile each GEMM's
reduction runs outermost and ``MR x gates x V`` accumulators stay in registers (rows and gates
unrolled, ``V`` vectorised); then the gate math runs on the tile. The GEMM outputs are
tile-local (``local`` scope): no buffer of ``rows x gates x D`` is ever allocated. Tiles run in
parallel. Symbolic rows are padded to a multiple of ``MR`` in the GEMMs (``pad_einsum``, then
the inputs read in place with the row index clamped, see ``inline_padding``), so their tiles
carry no tail predicate; the results are written for the real rows only.

``unswitch`` (FuseGatheredGates' rows laid out one expert per tile): the kernel's expert index
``select(flag, per_row[r], tiles[r // MR])`` is split into two kernels, each scheduled with
its own tile (the tiled one with ``rows``, the sorted rows with at most ``PADDED_ROWS_MAX``),
and spliced under one ``if flag`` (:func:`flag_branches`, :func:`splice`).
"""

from __future__ import annotations

import logging

import tvm_ffi
from tvm import s_tir, sym, tirx
from tvm.ir.expr import TensorLoad
from tvm.target import Target

from ... import target as _target
from ...tir_util import iter_stmts
from .._common import (
    GATE_ATTR,
    CPURule,
    extent,
    gate_blocks,
    inline_padding,
    is_static,
    parallelize_outer,
    same_blocks,
    schedule_copy,
    vectorize_innermost,
)

# Rows of a padded tile with 32 vector registers (see tile_rows)
PADDED_ROWS_MAX = 4
logger = logging.getLogger(__name__)


def tile_rows(rows, gates: int, block: int, lanes: int, regs: int, gathered: bool = False) -> int:
    """Rows per register tile: ``rows x gates x block/lanes`` accumulators, in the registers
    that one row's weight vectors (loaded once per ``k``, reused by every row) and the row's
    broadcast input leave free: on AVX2 (16 registers) a 3-gate tile of 8 units gets 4 rows
    (12 accumulators, the 4 x 24 micro-kernel), where half the registers gave 2 rows (6
    accumulators; 5 loads per 6 FMAs, load-bound: gate_2890 3.5 -> 2.9 ms). Symbolic rows
    (None) get the tile of many rows, and so do static rows that no divisor at least half as
    tall divides (19, a prime: tiles of one row took 2x ONNX Runtime's time); the rule pads
    them to a multiple of it.

    A padded tile reads each of its rows through a pointer of its own (the row index clamped,
    see inline_padding), and 16 general registers do not hold 14 of them beside the loop's
    own: with 32 vector registers (AVX-512) such a tile gets at most ``PADDED_ROWS_MAX`` rows.
    SwiGLU's 2 gates over symbolic rows on Zen 4 (bench/frontend_forms.md): 14 rows per tile
    (3 row pointers reloaded from the stack every k, rows 2 KiB apart sharing L1 sets, up to 13
    rows padded) 3.53 ms at 256 rows, 4 rows 3.31; at 8 rows 0.35 -> 0.21 ms, at 512 rows
    7.04 -> 6.55, faster than 6 rows at each of them. A ``gathered`` tile (``W[ids[row]]``)
    reads two pointers a row, its input and its expert's weight: it gets at most
    ``PADDED_ROWS_MAX`` rows on any target. Transformers' grouped experts on AVX2 (1024 x 2816,
    8 experts, top 2, scripts/bench_moe_grouped.py): the gate-up and down GEMMs' tiles of 6
    and 14 rows against 4 and 4, vs torch eager in one run, 0.95 -> 0.73 at 1 token, 0.15 ->
    0.14 at 64, 0.78 -> 0.70 at 512."""
    per_row = gates * max(block // lanes, 1)
    mr = max(1, (regs - 1 - per_row) // per_row)
    if is_static(rows):
        if rows <= mr:
            return rows
        divisor = next(d for d in range(mr, 0, -1) if rows % d == 0)
        if 2 * divisor >= mr:
            return divisor
    return min(mr, PADDED_ROWS_MAX) if regs >= 32 or gathered else mr


def _pad_rows(sch: s_tir.Schedule, gemm, n_rows: int, mr: int) -> list | None:
    """Pad the last row axis of one gate GEMM ``Y[rows, g, do, di] += x[rows, k] *
    Wb[do, k, g, di]`` to a multiple of ``mr`` (``pad_einsum``: ``x`` copied into a padded
    buffer, ``Y`` computed over the padded rows, the cut back to the real rows inlined into
    its readers), so that the tiles carry no tail predicate: under one, TVM 0.27 keeps the
    accumulator at full size in memory (see cpu/matmul.py). Returns the padding copies, None
    when ``pad_einsum`` refuses (the caller starts again from the unpadded function)."""
    n_iters = len(sch.get(gemm).iter_vars)
    factors = [mr if i == n_rows - 1 else 1 for i in range(n_iters)]
    try:
        sch.pad_einsum(gemm, factors)
        pads = list(sch.get_producers(gemm))
        (cut,) = sch.get_consumers(gemm)
        sch.compute_inline(cut)
    except Exception as err:  # noqa: BLE001 - not the expected form: no padding
        logger.debug("gate fusion: rows not padded: %s", err)
        return None
    return pads


def _gemm_gates(sch: s_tir.Schedule, gemms: list, n_rows: int, gates: int) -> int:
    """The most gates one GEMM of the kernel computes: its output beyond the row axes is
    ``gates_j x width`` elements, and the gates of all GEMMs sum to ``gates``."""
    sizes = []
    for gemm in gemms:
        size = 1
        for iv in sch.get(gemm).iter_vars[n_rows:]:
            if iv.iter_type != iv.CommReduce:
                ext = iv.dom.extent
                size *= int(ext.value) if isinstance(ext, tirx.IntImm) else 0
        sizes.append(size)
    total = sum(sizes)
    if not all(sizes) or total % gates:
        return gates
    width = total // gates
    return max(size // width for size in sizes) if all(s % width == 0 for s in sizes) else gates


def _rows_padded(sch: s_tir.Schedule, gemms: list, n_rows: int, mr: int) -> bool:
    """Every GEMM's last row axis a provable multiple of ``mr``: FuseSplitGates built the
    kernel padded (a gathered weight, ``W[ids[row]]``, which ``pad_einsum`` refuses)."""
    analyzer = sym.Analyzer()
    for gemm in gemms:
        iters = sch.get(gemm).iter_vars
        if len(iters) < n_rows or not n_rows:
            return False
        ext = iters[n_rows - 1].dom.extent
        if not analyzer.can_prove_equal(tirx.floormod(ext, mr), 0):
            return False
    return True


def _flag_load(cond):
    """The load ``flag[i]`` of ``flag[i] != 0`` (maybe cast), else None."""
    load = getattr(cond, "a", None) if isinstance(cond, tirx.NE) else None
    return load.value if isinstance(load, tirx.Cast) else load


def _flag_test(cond) -> bool:
    """``flag[i] != 0`` of an integer buffer (FuseGatheredGates' ``per_row`` flag)."""
    load = _flag_load(cond)
    zero = getattr(cond, "b", None)
    return (
        isinstance(load, TensorLoad)
        and "int" in str(load.source.dtype)
        and isinstance(zero, tirx.IntImm)
        and int(zero.value) == 0
    )


def flag_branches(func: tirx.PrimFunc):
    """``(flag, func[select -> true value], func[select -> false value])`` for every
    ``select(flag[i] != 0, a, b)`` of ``func`` whose ``flag`` is a parameter buffer
    (FuseGatheredGates' kernels on rows laid out one expert per tile,
    ``transform/_expert_tiles.py``: ``W[select(sorted only, per_row[r], tiles[r // MR])]``);
    None when it has none."""
    params = set(func.params)
    found: list = []

    def collect(node):
        if isinstance(node, tirx.Select) and _flag_test(node.condition):
            if _flag_load(node.condition).source in params:
                found.append(node.condition)
        return node

    tvm_ffi.structural_map(func.body, [(tirx.Select, collect)])
    if not found:
        return None
    flag = found[0]

    def branch(value: bool):
        def pick(node):
            if isinstance(node, tirx.Select) and tvm_ffi.structural_equal(node.condition, flag):
                return node.true_value if value else node.false_value
            return node

        return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.Select, pick)]))

    return flag, branch(True), branch(False)


def splice(flag, then_func: tirx.PrimFunc, else_func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """One kernel ``if flag: then_func's body else: else_func's body`` of two scheduled
    kernels with the same parameters (the branches of :func:`flag_branches`, each scheduled
    with its own tile); None where a body is not one root block."""
    roots = [f.body for f in (then_func, else_func)]
    if not all(isinstance(r, s_tir.SBlockRealize) for r in roots):
        return None
    then_block, else_block = (r.block for r in roots)
    # both define the same loop and block variables: fresh ones in the else branch
    else_body = _fresh_vars(else_block.body)
    block = s_tir.SBlock(
        then_block.iter_vars,
        then_block.reads,
        then_block.writes,
        then_block.name_hint,
        tirx.IfThenElse(flag, then_block.body, else_body),
        then_block.init,
        [*then_block.alloc_buffers, *else_block.alloc_buffers],
        then_block.match_buffers,
        then_block.annotations,
    )
    return then_func.with_body(s_tir.SBlockRealize(roots[0].iter_values, roots[0].predicate, block))


def _fresh_vars(stmt):
    """``stmt`` with every loop and block iterator variable it defines replaced by a fresh
    one (the other branch of :func:`splice` defines the same)."""
    fresh = {}
    for node in iter_stmts(stmt):
        if isinstance(node, tirx.For):
            fresh[node.loop_var] = tirx.Var(node.loop_var.name, node.loop_var.ty)
        elif isinstance(node, s_tir.SBlock):
            for iv in node.iter_vars:
                fresh[iv.var] = tirx.Var(iv.var.name, iv.var.ty)
    return tvm_ffi.structural_map(stmt, [(tirx.Var, lambda v: fresh.get(v, v))])


class GateFusion(CPURule):
    def apply(self, func, target: Target, tunable: bool):
        if not self.applicable(func, target) or GATE_ATTR not in func.attrs:
            return None
        hints = func.attrs[GATE_ATTR]
        block, gates = int(hints["block"]), int(hints["gates"])
        # "rows": FuseSplitGates built the GEMMs with their rows padded to this tile
        built = int(hints["rows"]) if "rows" in hints else None
        branches = flag_branches(func) if "unswitch" in hints and built else None
        if branches is not None:  # one expert per tile, or the rows sorted only
            flag, by_rows, tiled = branches
            # the rows sorted only read a weight pointer each: the gathered tile (at most
            # PADDED_ROWS_MAX rows, see tile_rows), named by the kernel, else a divisor of
            # the layout's tile
            row_tile = int(hints["rows_sorted"]) if "rows_sorted" in hints else None
            if row_tile is None:
                row_tile = max(d for d in range(1, PADDED_ROWS_MAX + 1) if built % d == 0)
            done = [self._built(f, target, block, gates, t) for f, t in
                    ((by_rows, row_tile), (tiled, built))]  # fmt: skip
            if all(d is not None for d in done):
                spliced = splice(flag, *(d.mod["main"] for d in done))
                if spliced is not None:
                    return s_tir.Schedule(spliced)
        return self._built(func, target, block, gates, built)

    def _built(self, func, target: Target, block: int, gates: int, built):
        sch = self._schedule(func, target, block, gates, pad=True, built=built)
        if sch is None:  # padding refused: symbolic rows one at a time
            sch = self._schedule(func, target, block, gates, pad=False, built=built)
        if sch is None:  # a kernel built with padded rows whose tile failed: one row a tile
            sch = self._schedule(func, target, block, gates, pad=False, built=1)
        return sch

    def _schedule(self, func, target: Target, block: int, gates: int, pad: bool, built):
        try:
            return self._try_schedule(func, target, block, gates, pad, built)
        except Exception as err:  # noqa: BLE001 - a primitive refused: the next way, if any
            logger.debug("gate fusion: %s", str(err).splitlines()[-1] if str(err) else err)
            return None

    def _try_schedule(self, func, target: Target, block: int, gates: int, pad: bool, built):
        found = gate_blocks(func)
        if found is None:
            return None
        sch, reductions, finals, inner = found
        lanes = _target.vector_lanes(target, "float32")
        regs = _target.vector_registers(target)

        # FuseSplitGates writes every result from one loop nest (a multi-output compute): tile
        # it; everything the results read is then computed at the tile (compute_at wants every
        # consumer under the loop, which holds once all outputs share it).
        *row_loops, unit_loop = sch.get_loops(finals[0])  # no row loop for a single row
        pads: list = []
        rows = extent(sch, row_loops[-1]) if row_loops else 1
        # The GEMMs of a tile accumulate one after the other: the widest one's gates, not the
        # group's, share the registers (a GRU's two GEMMs of 3 gates: 4 rows per tile, not 1).
        mr = tile_rows(
            rows, _gemm_gates(sch, reductions, len(row_loops), gates), block, lanes, regs
        )
        if built is not None:
            mr = built
        if mr > 1 and (not is_static(rows) or rows % mr):
            if _rows_padded(sch, reductions, len(row_loops), mr):
                pass  # built padded (a gathered weight): the results' rows get a tail
            elif not pad:
                mr = 1
            else:
                for red in reductions:
                    padded = _pad_rows(sch, red, len(row_loops), mr)
                    if padded is None:
                        return None
                    pads += padded
                # Read the inputs in place, rows clamped (see inline_padding).
                inlined = inline_padding(sch, pads)
                if inlined is not None:
                    reductions, finals, inner = (
                        same_blocks(sch, inlined, group) for group in (reductions, finals, inner)
                    )
                    sch, pads = inlined, []
                    *row_loops, unit_loop = sch.get_loops(finals[0])
        jo, ji = sch.split(unit_loop, [None, block])
        if row_loops:
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

        k_loops = []
        for red in reductions:
            sch.set_scope(red, 0, "local")
            # rows, gate, unit(s), reduction under the tile (counted before the outer loops
            # are fused for the parallel loop)
            *tile, k_loop = sch.get_loops(red)[len(outer) :]
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
            k_loops.append(k_loop)

        cores = _target.num_cores(target)
        parallelize_outer(sch, outer, cores, min_extent_per_core=4)  # before decomposing
        for copy in pads:
            schedule_copy(sch, copy, lanes, cores)
        for red, k_loop in zip(reductions, k_loops, strict=True):
            init = sch.decompose_reduction(red, k_loop)
            vectorize_innermost(sch, init, lanes)
        return sch
