"""PrefetchPanels: a GEMM with a large prepacked weight fetches its next panel of B ahead.

The Matmul rule's loops over a constant, prepacked B (``B[panel, k, NR]``) are ``panel
(parallel), row tile, k``: every row tile of a panel reads the panel's K x NR block, the first
from memory or L3 (a weight of several MiB is not in L2, and on a shared VM L3 holds little of
it), the rest from L2. The hardware prefetchers do not run that far ahead: on Zen 3 (AVX2, one
thread), a 4 x 3-vector micro-kernel over 64 rows and K = 768 reached 94% of the FMA peak on one
panel and 68-70% over 128 panels (9 MiB of B); with the next panel fetched into L2 while the
current one is computed, 81 GF/s instead of 68 (x 0.84 the time), and unchanged at 32 panels
(2.3 MiB, in L3).

Where: the rule marks the reduction (``mark``) when B is prepacked at compile time, its panels
are a single axis, B holds at least :data:`PREFETCH_MIN_BYTES`, and ``k`` splits into groups of
``G`` steps (:func:`prefetch_group`) so that one prefetch per group and row tile covers the next
panel's cache lines, each row tile its own share. The pass then writes, at the head of each
group, ``prefetch(&B[min(panel + 1, panels - 1), line of this row tile and group])`` (LLVM's
``llvm.prefetch`` to L2: a hint that never faults; the indices stay inside B anyway).
"""

from __future__ import annotations

import logging

import tvm
import tvm_ffi
from tvm import s_tir, sym, tirx

from ...tir_util import iter_stmts, loads_in, rebuilt_for
from .._common import extent, is_static

logger = logging.getLogger(__name__)

PLAN_ATTR = "tvm_fusion.prefetch_panel"  # on the k-group loop: [panels, K, NR, lines per tile]
ROWS_ATTR = "tvm_fusion.prefetch_rows"  # on the row-tile loop above it
PREFETCH_MIN_BYTES = 4 << 20  # B smaller than this (L2 and a quiet L3 hold it): no prefetches
LINE_BYTES = 64
GROUPS = (64, 32, 16, 8, 4)  # k steps per prefetch: the largest that covers the panel


def prefetch_group(k_ext, row_tiles, nr: int, itemsize: int, b_bytes) -> tuple | None:
    """(G, lines per row tile): ``k`` in groups of ``G`` steps, one prefetch per group, so that
    each of the panel's ``row_tiles`` tiles fetches its share of the next panel's lines; None
    where B is small, an extent symbolic, or no group of at least 4 steps divides K and covers
    the share (few row tiles: a GEMV-like GEMM streams B once anyway)."""
    if not all(is_static(x) for x in (k_ext, row_tiles, b_bytes)) or b_bytes < PREFETCH_MIN_BYTES:
        return None
    k_ext, row_tiles = int(k_ext), int(row_tiles)
    lines = -(-k_ext * nr * itemsize // LINE_BYTES)
    per_tile = -(-lines // max(row_tiles, 1))
    for group in GROUPS:
        if k_ext % group == 0 and k_ext // group >= per_tile:
            return group, per_tile
    return None


def mark(sch, k_loop, io, panels: int, k_ext: int, nr: int, itemsize: int) -> object:
    """Split ``k_loop`` (directly under the row-tile loop ``io``) into groups for the pass and
    mark both; returns the loop to use as the reduction's outer loop (``k_loop`` unchanged where
    :func:`prefetch_group` declines)."""
    plan = prefetch_group(k_ext, extent(sch, io), nr, itemsize, panels * k_ext * nr * itemsize)
    if plan is None:
        return k_loop
    group, per_tile = plan
    ko, _ = sch.split(k_loop, [None, group])
    sch.annotate(ko, PLAN_ATTR, [panels, k_ext, nr, per_tile])
    sch.annotate(io, ROWS_ATTR, 1)
    return ko


def _without(loop: tirx.For, key: str, body=None) -> tirx.For:
    annotations = {k: v for k, v in loop.annotations.items() if k != key}
    return rebuilt_for(loop, body=body, annotations=annotations)


def _substitute(expr, mapping: dict):
    return tvm_ffi.structural_map(expr, [(tirx.Var, lambda v: mapping.get(v, v))])


def _b_load(body, shape: tuple):
    """(the load of the packed B, its block's realize) under ``body``, or None."""
    for stmt in iter_stmts(body):
        if not isinstance(stmt, s_tir.SBlockRealize) or stmt.block.init is not None:
            continue
        store = stmt.block.body
        if not isinstance(store, tirx.BufferStore):
            continue
        for load in loads_in(store.value):
            dims = load.source.shape
            if len(dims) == 3 and all(
                isinstance(d, tirx.IntImm) and int(d) == s for d, s in zip(dims, shape, strict=True)
            ):
                return load, stmt
    return None


def _prefetch(rows: tirx.For, ko: tirx.For):
    """The prefetch statement for the k-group loop ``ko`` under the row-tile loop ``rows``, or
    None where the update block or its B is not found."""
    panels, k_ext, nr, per_tile = (int(x) for x in ko.annotations[PLAN_ATTR])
    found = _b_load(ko.body, (panels, k_ext, nr))
    if found is None:
        return None
    load, realize = found
    bindings = dict(
        zip([iv.var for iv in realize.block.iter_vars], realize.iter_values, strict=True)
    )
    inner = {
        s.loop_var: tirx.const(0, s.loop_var.ty.dtype)
        for s in iter_stmts(ko.body)
        if isinstance(s, tirx.For)
    }
    analyzer = sym.Analyzer()
    panel = analyzer.simplify(_substitute(_substitute(load.indices[0], bindings), inner))
    dtype = ko.loop_var.ty.dtype
    item = max(load.source.dtype.bits // 8, 1)
    lines = -(-k_ext * nr * item // LINE_BYTES)

    def c(value):
        return tirx.const(value, dtype)

    def cast(expr):
        return expr if expr.ty.dtype == dtype else tirx.Cast(dtype, expr)

    line = tirx.min(cast(rows.loop_var) * c(per_tile) + ko.loop_var, c(lines - 1))
    offset = line * c(LINE_BYTES // item)
    nxt = tirx.min(cast(panel) + c(1), c(panels - 1))
    where = tirx.BufferLoad(load.source, [nxt, offset // c(nr), offset % c(nr)])
    # llvm.prefetch(address, read, locality 2: L2 and beyond, data cache)
    return tirx.Evaluate(tirx.call_intrin("void", "tirx.prefetch", tirx.address_of(where), 0, 2, 1))


def insert_prefetches(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with the prefetches of every marked reduction and the marks removed."""

    def on_for(loop):
        if ROWS_ATTR not in loop.annotations:
            return loop
        marked = [s for s in iter_stmts(loop.body) if isinstance(s, tirx.For)]
        marked = [s for s in marked if PLAN_ATTR in s.annotations]
        body = loop.body
        for ko in marked:
            stmt = _prefetch(loop, ko)
            new = _without(ko, PLAN_ATTR, None if stmt is None else tirx.SeqStmt([stmt, ko.body]))
            body = tvm_ffi.structural_map(
                body, [(tirx.For, lambda f, o=ko, n=new: n if f.same_as(o) else f)]
            )
        return _without(loop, ROWS_ATTR, body)

    def strip(loop):  # a mark with no row-tile loop above it (a later schedule step moved it)
        return _without(loop, PLAN_ATTR) if PLAN_ATTR in loop.annotations else loop

    body = tvm_ffi.structural_map(func.body, [(tirx.For, on_for)])
    return func.with_body(tvm_ffi.structural_map(body, [(tirx.For, strip)]))


def _marked(func: tirx.PrimFunc) -> bool:
    return any(
        isinstance(s, tirx.For) and (ROWS_ATTR in s.annotations or PLAN_ATTR in s.annotations)
        for s in iter_stmts(func.body)
    )


@tvm.transform.module_pass(opt_level=0, name="PrefetchPanels")
class PrefetchPanels:
    """:func:`insert_prefetches` on every PrimFunc the Matmul rule marked (CPU builds)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        changed = {}
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and _marked(func):
                changed[gv] = insert_prefetches(func)
        if not changed:
            return mod
        functions = {gv: changed.get(gv, func) for gv, func in mod.functions_items()}
        return tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)
