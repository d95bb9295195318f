"""One expert per register tile (issue #38): FuseGatheredGates' rows sorted by expert, each
expert's segment padded to a multiple of the CPU gate rule's tile height ``MR``, so that every
tile of ``MR`` rows reads one expert's weight: the weight vectors are loaded once per ``k`` for
all the tile's rows instead of once per row, and each expert's segment is a plain GEMM with
the gate epilogue (on AVX2 the 6-row tiles of 12 accumulators instead of 4 rows each reading
its own expert's pointer).

:func:`emit_layout` emits the layout, one kernel on the ids and their sort order, for the
kernels' ``R`` rows (:func:`kernel_rows`):

- ``src (R,)``: the row that each of the kernels' rows reads (the padding rows of a segment
  read its last row, the tiles past the real ones the last sorted row);
- ``tiles (T,)``: the expert of each tile (the tiles past the real ones: the last sorted
  row's expert, whose weight the tile before has just read);
- ``per_row (R + 1,)``: the expert of each row, then the flag: 1 where the rows are the
  sorted rows themselves (:func:`by_rows`: too few rows for the padding to pay), 0 where
  they are padded to one expert per tile;
- ``dst (S,)``: where row ``s`` lands among the kernels' rows (the results are put back in
  row order by ``take(result, dst)``).

``T = min(S, (S + E * (MR - 1)) // MR)`` tiles bound the real ones (each expert's segment adds
at most ``MR - 1`` padding rows, and every real tile holds a row): at 512 tokens top 2 (1024
rows, 8 experts, ``MR`` 6) 177 tiles for at least 171 real ones. A kernel reads ``x[src]``
(contiguous rows) and ``W[select(flag, per_row[r], tiles[r // MR])]``; the CPU gate rule
schedules each side of that select on its own and branches once on the flag
(``schedule/cpu/gate_fusion.py``, ``flag_branches`` / ``splice``).

Measured (H 1024, I 2816, 8 experts, top 2, torch.export, 2 threads on the shared 2-core
Zen 3, AVX2; this layout vs the rows sorted only, engines alternating, load 3.1-6.2, several
runs): 0.59-0.75x the time at 512 tokens, 0.78-0.89x at 64, 0.87x at 16; below the threshold
(the sorted rows, the same 4-row tile) 0.80-0.94x at 1 token, 0.92-1.08x at 2, 0.96x at 4.
In scripts/bench_moe.py's run of 8 engines (``--ab-sorted``) 0.735x at 512 tokens but 1.09x
at 64 and 1.29x at 1, where its two paths of identical kernels differed by 9%.
"""

from __future__ import annotations

from tvm import relax, te, tirx

from .. import target as _target
from .fuse_split_gates.match import _int, _shape

INDEX = "int32"


def tile_count(rows, experts: int, mr: int):
    """The kernel's tiles for ``rows`` (an int or a symbolic expression): ``T`` bounding the
    real expert tiles (see the module docstring), or ``ceil(rows / MR)`` where the rows are
    too few for one expert per tile (:func:`by_rows`)."""
    if isinstance(rows, int):
        if by_rows(rows, experts, mr):
            return -(-rows // mr)
        return min(rows, (rows + experts * (mr - 1)) // mr)
    tiled = tirx.min(rows, tirx.floordiv(rows + experts * (mr - 1), mr))
    return tirx.Select(by_rows(rows, experts, mr), tirx.floordiv(rows + mr - 1, mr), tiled)


def kernel_rows(rows, experts: int, mr: int):
    """The rows the kernels run on: ``rows`` where they stay sorted only (:func:`by_rows`),
    else ``T * MR`` (the tiles of :func:`tile_count`)."""
    if isinstance(rows, int):
        return rows if by_rows(rows, experts, mr) else tile_count(rows, experts, mr) * mr
    tiled = tirx.min(rows, tirx.floordiv(rows + experts * (mr - 1), mr)) * mr
    return tirx.Select(by_rows(rows, experts, mr), rows, tiled)


def by_rows(rows, experts: int, mr: int):
    """Whether ``rows`` rows are laid out as sorted, each row reading its own expert's weight
    (``rows < 2 * E * MR``; a bool, or a condition on symbolic rows): each expert's segment
    adds ``(MR - 1) / 2`` padding rows on average, ``E * (MR - 1) / 2`` in all, and those
    are computed. With 8 experts and ``MR`` 6 (AVX2), padded at every row count: one token
    (2 rows, two tiles of 6) took 1.6x the sorted rows' time, 4 tokens 1.9x, 16 tokens 1.3x,
    64 tokens (128 rows) 0.87x, 512 tokens 0.74x (engines alternating, load 5-6)."""
    return rows < 2 * experts * mr


def layout_compute(experts: int, mr: int, n_tiles, rows):
    """The TE function ``(ids, perm, unsort) -> (src, tiles, per_row, dst)`` (see the module
    docstring); ``perm = argsort(ids)``, ``unsort = argsort(perm)``; ``per_row`` holds the
    expert of each of the kernel's rows and, last, 1 where the rows are laid out as sorted
    (:func:`by_rows`), else 0."""

    def fn(ids, perm, unsort):
        s = ids.shape[0]
        one, zero = tirx.const(1, INDEX), tirx.const(0, INDEX)

        def expert(i):
            return ids[i].astype(INDEX)

        r = te.reduce_axis((0, s), "r")
        count = te.compute(
            (experts,), lambda e: te.sum(tirx.Select(expert(r) == e, one, zero), axis=r), "count"
        )
        r2 = te.reduce_axis((0, s), "r2")
        below = te.compute(  # the first sorted row of each expert
            (experts,), lambda e: te.sum(tirx.Select(expert(r2) < e, one, zero), axis=r2), "below"
        )
        padded = te.compute((experts,), lambda e: (count[e] + mr - 1) // mr * mr, "padded")
        f = te.reduce_axis((0, experts), "f")
        end = te.compute(  # the padded segment of expert e ends before end[e]
            (experts,), lambda e: te.sum(tirx.Select(f <= e, padded[f], zero), axis=f), "end"
        )
        f2 = te.reduce_axis((0, experts), "f2")
        owner = te.compute(  # the expert of each padded row, ``experts`` past the real rows
            (rows,),
            lambda p: te.sum(tirx.Select(end[f2] <= p.astype(INDEX), one, zero), axis=f2),
            "owner",
        )
        last = perm[s - 1]
        top = tirx.Cast(INDEX, s - 1)
        sorted_rows = by_rows(s, experts, mr)

        def source(p):
            e = tirx.min(owner[p], experts - 1)
            within = p.astype(INDEX) - (end[e] - padded[e])
            at = tirx.max(tirx.min(below[e] + tirx.min(within, count[e] - 1), top), zero)
            tiled = tirx.if_then_else(owner[p] < experts, perm[at], last)
            return tirx.if_then_else(sorted_rows, perm[tirx.min(p, s - 1)], tiled)

        src = te.compute((rows,), source, "src")
        tiles = te.compute((n_tiles,), lambda t: tirx.min(owner[t * mr], expert(last)), "tiles")

        def row_expert(p):
            flag = tirx.Cast(INDEX, sorted_rows)
            return tirx.if_then_else(p < rows, expert(src[tirx.min(p, rows - 1)]), flag)

        per_row = te.compute((rows + 1,), row_expert, "per_row")

        def target(i):
            e = expert(i)
            tiled = end[e] - padded[e] + unsort[i] - below[e]
            return tirx.if_then_else(sorted_rows, unsort[i], tiled)

        dst = te.compute((s,), target, "dst")
        return [src, tiles, per_row, dst]

    return fn


def emit_layout(bb: relax.BlockBuilder, ids, perm, unsort, experts: int, mr: int, rows):
    """``(src, (tiles, per_row), dst, T, R)`` for the ids ``(S,)`` of ``rows`` rows (see the
    module docstring and :func:`layout_compute`; ``R``: :func:`kernel_rows`), emitted as one
    kernel."""
    n_tiles = tile_count(rows, experts, mr)
    fn = layout_compute(experts, mr, n_tiles, kernel_rows(rows, experts, mr))
    out = bb.emit(bb.call_te(fn, ids, perm, unsort, primfunc_name_hint="expert_tiles"), "tiles")
    src, tiles, per_row, dst = (bb.emit(relax.TupleGetItem(out, i)) for i in range(4))
    return src, (tiles, per_row), dst, n_tiles, kernel_rows(rows, experts, mr)


def plan_layout(bb: relax.BlockBuilder, group, ids, perm, target):
    """``(src, (tiles, per_row), dst, T, R, MR)`` for a FuseGatheredGates group (one row axis,
    every GEMM gathered; ``group.unsort`` set), emitted; None where the CPU gate rule's tile
    is one row, or the target is not a CPU."""
    from ..schedule import gate_tile_rows

    if target is None or not _target.is_cpu(target):
        return None
    mr = gate_tile_rows(target, None, max(g.gates for g in group.gemms), group.block)
    if mr <= 1:
        return None
    experts = max(_int(_shape(g.weight)[0]) for g in group.gemms)
    rows = group.rows[0]
    rows = _int(rows) if _int(rows) is not None else rows
    unsort = group.unsort
    return (*emit_layout(bb, ids, perm, unsort, experts, mr, rows), mr)


def group_tile(group, target, mr: int) -> int:
    """The rule's tile for a group whose rows are laid out ``mr`` per expert: the largest
    divisor of ``mr`` that its registers hold (the down projection after the gate-up)."""
    from ..schedule import gate_tile_rows

    own = gate_tile_rows(target, None, max(g.gates for g in group.gemms), group.block)
    return max(d for d in range(1, mr + 1) if mr % d == 0 and d <= max(own, 1))
