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
