"""One expert per register tile for a grouped expert GEMM (the gate rule's kernels of
FuseGroupedGates, ``row_blocks`` hint).

FuseSplitGates builds such a GEMM twice over the same padded rows: ``Y_tile`` reads every row
of a tile of ``MR`` rows at the expert of the tile's first row (``Wg[ids[first], ...]``: one
weight vector a ``k`` for the tile, shared by its ``MR`` rows), ``Y_row`` at each row's own
expert, and the result picks ``Y_tile`` where every row of the tile has the first one's expert
(the uniform tiles: all but the tiles that straddle an expert boundary when the rows are sorted
by expert, as transformers' are), ``Y_row`` elsewhere. Both are correct for any expert of any
row; computing both would double the work. :func:`guard_row_blocks`, run on the scheduled
kernel, wraps each one's reduction loop in the tile's test (``if uniform`` / ``if not
uniform``), so that a tile runs one of them; the accumulator of the other stays at its
initial zero, which the pick does not read. TVM 0.27 has no schedule primitive for a
data-dependent guard (and TE's ``where`` of a reduction is dropped by ``create_prim_func``),
so the loop nest around the two loops is rebuilt here.
"""

from __future__ import annotations

from tvm import s_tir, sym, tirx
from tvm.ir.expr import TensorLoad

from ...tir_util import expr_children, iter_stmts, vars_in

TILE, ROW = "_tile_update", "_row_update"


def guard_row_blocks(func: tirx.PrimFunc, mr: int) -> tirx.PrimFunc | None:
    """``func`` with every ``*_tile_update`` reduction loop run only on uniform tiles and its
    ``*_row_update`` twin only on the others; None when the kernel is not of the expected form
    (the caller then refuses the schedule: both GEMMs would run)."""
    realizes = {}
    parents: dict = {}
    for node in iter_stmts(func.body):
        for child in _children(node):
            parents[child] = node
        if isinstance(node, s_tir.SBlockRealize):
            realizes[node.block.name_hint] = node
    pairs = [(name, name[: -len(TILE)] + ROW) for name in realizes if name.endswith(TILE)]
    if not pairs or any(row not in realizes for _, row in pairs):
        return None
    replace = {}
    for tile_name, row_name in pairs:
        tile_loop = _reduction_loop(realizes[tile_name], parents)
        row_loop = _reduction_loop(realizes[row_name], parents)
        cond = _uniform(realizes[row_name], parents, mr)
        if tile_loop is None or row_loop is None or cond is None:
            return None
        replace[tile_loop] = tirx.IfThenElse(cond, tile_loop, None)
        replace[row_loop] = tirx.IfThenElse(tirx.Not(cond), row_loop, None)
    body = _rebuild(func.body, replace)
    if body is None:
        return None
    return func.with_body(body)


def _children(node) -> list:
    if isinstance(node, tirx.SeqStmt):
        return list(node.seq)
    if isinstance(node, s_tir.SBlockRealize):
        return [node.block]
    if isinstance(node, s_tir.SBlock):
        return [c for c in (node.init, node.body) if c is not None]
    if isinstance(node, tirx.IfThenElse):
        return [c for c in (node.then_case, node.else_case) if c is not None]
    body = getattr(node, "body", None)
    return [body] if isinstance(body, tirx.Stmt) else []


def _loops_above(realize, parents) -> list:
    """The For loops from the realize up to the enclosing block (innermost first)."""
    loops = []
    node = parents.get(realize)
    while node is not None and not isinstance(node, s_tir.SBlock):
        if isinstance(node, tirx.For):
            loops.append(node)
        node = parents.get(node)
    return loops


def _reduction_loop(realize, parents):
    """The loop that the block's one reduction iterator is bound to."""
    block = realize.block
    reduce = [
        v for iv, v in zip(block.iter_vars, realize.iter_values, strict=True)
        if iv.iter_type == iv.CommReduce
    ]  # fmt: skip
    if len(reduce) != 1 or not isinstance(reduce[0], tirx.Var):
        return None
    for loop in _loops_above(realize, parents):
        if loop.loop_var.same_as(reduce[0]):
            return loop
    return None


def _expert_index(block):
    """``(ids buffer, index expr)`` of the gathered weight read ``Wg[ids[f(row)], ...]``."""
    store = next((s for s in iter_stmts(block.body) if isinstance(s, tirx.BufferStore)), None)
    if store is None:
        return None
    stack = [store.value]
    while stack:
        e = stack.pop()
        if isinstance(e, TensorLoad) and e.indices:
            first = e.indices[0]
            if isinstance(first, TensorLoad) and len(first.indices) == 1:
                return first.source, first.indices[0]
        stack.extend(expr_children(e))
    return None


def _uniform(realize, parents, mr: int):
    """The test, outside the reduction loop, that every row of the tile has the expert of
    its first row."""
    found = _expert_index(realize.block)
    if found is None:
        return None
    ids, index = found
    iters = {iv.var: v for iv, v in zip(realize.block.iter_vars, realize.iter_values, strict=True)}
    rows = [v for v in vars_in(index) if v in iters]
    if len(rows) != 1:
        return None
    binding = iters[rows[0]]
    loop = _reduction_loop(realize, parents)
    inner = []
    for f in _loops_above(realize, parents):
        inner.append(f)
        if f.same_as(loop):
            break
    analyzer = sym.Analyzer()
    for f in inner:
        analyzer.bind(f.loop_var, f.min)
    first = analyzer.simplify(binding)
    moving = [f for f in inner if f.loop_var in vars_in(binding)]
    if len(moving) != 1 or not isinstance(moving[0].extent, tirx.IntImm):
        return None
    if int(moving[0].extent.value) != mr:
        return None
    check = sym.Analyzer()
    if not check.can_prove_equal(binding - first, moving[0].loop_var):
        return None

    def expert(offset: int):
        at = sym.Analyzer()
        at.bind(rows[0], first + offset)
        return tirx.BufferLoad(ids, [at.simplify(index)])

    base = expert(0)
    return tirx.all(*[expert(i) == base for i in range(1, mr)]) if mr > 1 else None


def _rebuild(stmt, replace: dict):
    """``stmt`` with the statements of ``replace`` replaced (the nodes on the way rebuilt);
    None for a node on the way of a kind not rebuilt here."""
    if stmt in replace:
        return replace[stmt]
    children = _children(stmt)
    if not any(_contains(c, replace) for c in children):
        return stmt
    if isinstance(stmt, tirx.SeqStmt):
        seq = [_rebuild(s, replace) for s in stmt.seq]
        return None if any(s is None for s in seq) else tirx.SeqStmt(seq)
    if isinstance(stmt, tirx.For):
        body = _rebuild(stmt.body, replace)
        if body is None:
            return None
        return tirx.For(
            stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body,
            stmt.thread_binding, stmt.annotations, stmt.step,
        )  # fmt: skip
    if isinstance(stmt, s_tir.SBlockRealize):
        block = _rebuild(stmt.block, replace)
        return (
            None if block is None else s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, block)
        )
    if isinstance(stmt, s_tir.SBlock):
        if stmt.init is not None and _contains(stmt.init, replace):
            return None
        body = _rebuild(stmt.body, replace)
        if body is None:
            return None
        return s_tir.SBlock(
            stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint, body, stmt.init,
            stmt.alloc_buffers, stmt.match_buffers, stmt.annotations,
        )  # fmt: skip
    return None


def _contains(stmt, replace: dict) -> bool:
    return any(node in replace for node in iter_stmts(stmt))
