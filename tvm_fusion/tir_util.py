"""Walking TIR statements (TVM 0.27 has no Python ``stmt_functor.post_order_visit``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from tvm import s_tir, tirx


def iter_stmts(stmt) -> Iterator[object]:
    """Every statement under ``stmt`` (pre-order), including SBlocks and their bodies."""
    stack = [stmt]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        yield node
        children: list = []
        if isinstance(node, tirx.SeqStmt):
            children = list(node.seq)
        elif isinstance(node, s_tir.SBlockRealize):
            children = [node.block]
        elif isinstance(node, s_tir.SBlock):
            children = [node.init, node.body]
        elif isinstance(node, tirx.IfThenElse):
            children = [node.then_case, node.else_case]
        elif isinstance(node, tirx.For | tirx.While | tirx.AttrStmt):
            children = [node.body]
        else:
            body = getattr(node, "body", None)
            if isinstance(body, tirx.Stmt):
                children = [body]
        stack.extend(reversed(children))


def expr_children(expr) -> list:
    """Direct sub-expressions of a TIR expression."""
    out = []
    for name in ("a", "b", "value", "condition", "true_value", "false_value", "base"):
        child = getattr(expr, name, None)
        if isinstance(child, tirx.Expr):
            out.append(child)
    for name in ("args", "indices"):
        children = getattr(expr, name, None)
        if children is not None and not isinstance(children, tirx.Expr):
            out.extend(c for c in children if isinstance(c, tirx.Expr))
    return out


def vars_in(expr) -> set:
    """The variables an expression reads."""
    found = set()
    stack = [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, tirx.Var):
            found.add(e)
        else:
            stack.extend(expr_children(e))
    return found


def expr_size(expr, limit: int = 1 << 20) -> int:
    """Number of nodes in an expression tree (shared nodes counted each time), capped."""
    count = 0
    stack = [expr]
    while stack and count < limit:
        node = stack.pop()
        count += 1
        stack.extend(expr_children(node))
    return count


def count_selects(expr, limit: int = 1 << 20) -> int:
    """How many ``Select`` nodes an expression tree holds (shared nodes counted each time)."""
    count = seen = 0
    stack = [expr]
    while stack and seen < limit:
        node = stack.pop()
        seen += 1
        count += isinstance(node, tirx.Select)
        stack.extend(expr_children(node))
    return count


def count_loads(expr, buffer, limit: int = 1 << 20) -> int:
    """How many times ``expr`` loads from ``buffer``."""
    from tvm.ir.expr import TensorLoad

    count = seen = 0
    stack = [expr]
    while stack and seen < limit:
        node = stack.pop()
        seen += 1
        if isinstance(node, TensorLoad) and node.source.same_as(buffer):
            count += 1
        stack.extend(expr_children(node))
    return count


def blocks(func: tirx.PrimFunc) -> list[s_tir.SBlock]:
    """SBlocks of ``func`` other than the root, in program order."""
    return [
        s for s in iter_stmts(func.body) if isinstance(s, s_tir.SBlock) and s.name_hint != "root"
    ]


def block_names(func: tirx.PrimFunc) -> list[str]:
    return [b.name_hint for b in blocks(func)]


def loops(func: tirx.PrimFunc) -> list[tirx.For]:
    return [s for s in iter_stmts(func.body) if isinstance(s, tirx.For)]


def allocated_buffers(func: tirx.PrimFunc) -> list[tirx.Buffer]:
    """Buffers allocated inside ``func``: SBlock ``alloc_buffers`` and ``AllocBuffer`` stmts."""
    found: list[tirx.Buffer] = []
    for stmt in iter_stmts(func.body):
        if isinstance(stmt, s_tir.SBlock):
            found.extend(stmt.alloc_buffers)
        elif isinstance(stmt, tirx.AllocBuffer):
            found.append(stmt.buffer)
    return found


def visit(func: tirx.PrimFunc, fn: Callable[[object], None]) -> None:
    for stmt in iter_stmts(func.body):
        fn(stmt)


def compacted_allocations(func: tirx.PrimFunc) -> list[tirx.Buffer]:
    """Buffers ``func`` allocates once TVM has shrunk each to the region actually used.

    Runs the TIR lowering steps that decide allocation sizes (LowerCrossThreadReduction,
    LowerInitBlock, PlanAndUpdateBufferAllocationLocation, ConvertBlocksToOpaque,
    LiftThreadBinding, CompactBufferAllocation), so a buffer computed at a tile loop shows its
    tile size, not its declared size (a GPU thread's partial sums before a cross-thread
    reduction: its own).
    """
    import tvm
    from tvm.s_tir import transform as st

    mod = tvm.IRModule({"main": func})
    mod = tvm.transform.Sequential(
        [
            st.LowerCrossThreadReduction(),
            st.LowerInitBlock(),
            st.PlanAndUpdateBufferAllocationLocation(),
            st.ConvertBlocksToOpaque(),
            st.LiftThreadBinding(),
            st.CompactBufferAllocation(),
        ]
    )(mod)
    return allocated_buffers(mod["main"])


def num_elements(buffer: tirx.Buffer) -> int | None:
    total = 1
    for d in buffer.shape:
        if not isinstance(d, tirx.IntImm):
            return None
        total *= int(d.value)
    return total


def loads_in(expr) -> list:
    """Every load in an expression tree."""
    from tvm.ir.expr import TensorLoad

    found = []
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, TensorLoad):
            found.append(node)
        stack.extend(expr_children(node))
    return found


def loads_of(expr, buffer) -> list:
    """The loads of ``buffer`` in an expression tree."""
    return [load for load in loads_in(expr) if load.source.same_as(buffer)]


def rebuilt_for(loop: tirx.For, *, kind=None, body=None, annotations=None) -> tirx.For:
    """``loop`` with its kind, body or annotations replaced (the rest kept, its step too)."""
    return tirx.For(
        loop.loop_var,
        loop.min,
        loop.extent,
        loop.kind if kind is None else kind,
        loop.body if body is None else body,
        loop.thread_binding,
        loop.annotations if annotations is None else annotations,
        loop.step,
    )


def replace_buffer(func: tirx.PrimFunc, old, new) -> tirx.PrimFunc:
    """``func`` with every access of the allocated buffer ``old`` made to ``new`` instead
    (a buffer of the same shape and dtype defined elsewhere, e.g. a parameter), and ``old``'s
    allocation dropped. The caller proves that sharing the storage keeps the results."""
    import tvm_ffi
    from tvm.ir.expr import Var

    def on_var(var):
        return new if var.same_as(old) else var

    def on_block(block):
        if not any(b.same_as(new) for b in block.alloc_buffers):
            return block
        return s_tir.SBlock(
            block.iter_vars,
            block.reads,
            block.writes,
            block.name_hint,
            block.body,
            block.init,
            [b for b in block.alloc_buffers if not b.same_as(new)],
            block.match_buffers,
            block.annotations,
        )

    return tvm_ffi.structural_map(func, [(Var, on_var), (s_tir.SBlock, on_block)])
