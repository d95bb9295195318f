"""Growing gate groups: from the pieces of the matched GEMMs (``match.py``), the elementwise
ops of ``ops._ELEMENTWISE`` that consume them, GEMMs whose pieces meet joined into one group,
a GEMM that reads another group's results (the next step of an unrolled RNN) starting its own.

:func:`_grow` returns the :class:`_Group` s that pass :func:`_check_group`: pieces used only
inside the group, every op of the pieces' shape, other inputs broadcast to it and independent
of the group's own results, at least one result leaving the group.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax, tirx
from tvm.ir import is_prim_expr

from .._common import get_logger, skip, vars_in
from .match import _Block, _Gemm, _int, _op, _shape
from .ops import _DTYPES, _ELEMENTWISE

logger = get_logger(__name__)


@dataclasses.dataclass
class _Group:
    gemms: list[_Gemm]
    ops: list[relax.Var]  # epilogue bindings, block order
    outputs: list[relax.Var]
    externals: list[relax.Expr]
    rows: list
    width: int
    block: int | None = None  # V, chosen for the target


def _grow(blk: _Block, gemms: list[_Gemm]) -> list[_Group]:
    """Epilogue regions from the pieces; GEMMs whose pieces meet are merged."""
    owner: dict = {}  # region var -> group id
    parent = list(range(len(gemms)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for gi, g in enumerate(gemms):
        for p in [*g.pieces, *g.aliases]:
            owner[p] = gi
    ops: dict[int, list] = {}
    start = min(blk.index[p] for g in gemms for p in g.pieces)
    inputs = [_ancestors(blk, [g.x, g.weight, *_ids(g), *g.addends]) for g in gemms]

    def gis(root):
        return [gi for gi in range(len(gemms)) if find(gi) == root]

    def _after(gi, root) -> bool:
        """GEMM ``gi`` reads a result of group ``root``."""
        return any(v in owner and find(owner[v]) == root for v in inputs[gi])

    for binding in blk.bindings[start:]:
        if not isinstance(binding, relax.VarBinding) or binding.var in owner:
            continue
        value = binding.value
        name = _op(value)
        if name not in _ELEMENTWISE or len(value.args) != _ELEMENTWISE[name][0]:
            continue
        region_args = [a for a in value.args if isinstance(a, relax.Var) and a in owner]
        if not region_args:
            continue
        groups = {find(owner[a]) for a in region_args}
        later = [r for r in groups if any(_after(gi, q) for gi in gis(r) for q in groups - {r})]
        if later:
            # one group's GEMM reads another's results (the next step of an unrolled RNN):
            # they stay two groups; the op belongs to the later one, the other's result is
            # its input
            # (the one some GEMM of which reads each other's results: a GRU step's input GEMM
            # reads x_t alone, its hidden GEMM h_t)
            last = [
                r for r in later if all(any(_after(gi, q) for gi in gis(r)) for q in groups - {r})
            ]
            if len(last) != 1:
                continue
            groups = {last[0]}
        root = groups.pop()
        for other in groups:
            parent[other] = root
        owner[binding.var] = root
        ops.setdefault(root, []).append(binding)
    result = []
    members: dict[int, list[int]] = {}
    for gi in range(len(gemms)):
        members.setdefault(find(gi), []).append(gi)
    for root, gis in members.items():
        region_ops = [b for r, bs in ops.items() if find(r) == root for b in bs]
        region_ops.sort(key=lambda b: blk.index[b.var])
        group = _check_group(blk, [gemms[i] for i in gis], region_ops)
        if group is not None:
            result.append(group)
    return result


def _check_group(blk: _Block, gemms: list[_Gemm], ops: list) -> _Group | None:
    what = f"gates of {', '.join(g.pieces[0].name for g in gemms)}"
    if not ops:
        return skip(logger, what, "no elementwise op consumes the pieces") or None
    widths = {g.width for g in gemms}
    rows = [_shape(g.pieces[0])[:-1] for g in gemms]
    if len(widths) != 1 or len({tuple(str(d) for d in r) for r in rows}) != 1:
        return skip(logger, what, "GEMMs with different row or piece shapes") or None
    if len({str(g.x.ty.dtype) for g in gemms}) != 1:
        return skip(logger, what, "GEMMs of different dtypes") or None
    width, rows = widths.pop(), rows[0]
    out_shape = [*rows, tirx.IntImm("int64", width)]
    region = {b.var for b in ops} | {p for g in gemms for p in [*g.pieces, *g.aliases]}
    # pieces (and their duplicates) must only feed the region
    for g in gemms:
        for p in [*g.pieces, *g.aliases]:
            if p in blk.outputs or any(u not in region for u in blk.users.get(p, [])):
                return skip(logger, what, f"piece {p.name} is also used outside the group") or None
    for g in gemms:
        if any(_depends_on(blk, a, region) for a in g.addends):
            return skip(logger, what, "an addend depends on the group's own results") or None
    externals: list = []
    for b in ops:
        if [str(d) for d in (_shape(b.var) or [])] != [str(d) for d in out_shape]:
            return skip(logger, what, f"{b.var.name} is not of the pieces' shape") or None
        for arg in b.value.args:
            if isinstance(arg, relax.Var) and arg in region or is_prim_expr(arg):
                continue
            if not _broadcastable(arg, out_shape):
                return skip(logger, what, f"{arg} does not broadcast to the pieces") or None
            if _depends_on(blk, arg, region):
                return skip(logger, what, "an input depends on the group's own results") or None
            if not any(arg.same_as(e) for e in externals):
                externals.append(arg)
    outputs = [
        b.var
        for b in ops
        if b.var in blk.outputs or any(u not in region for u in blk.users.get(b.var, []))
    ]
    if not outputs:
        return skip(logger, what, "no result leaves the group") or None
    return _Group(gemms, [b.var for b in ops], outputs, externals, rows, width)


def _ids(gemm: _Gemm) -> list:
    """The expert ids a gathered GEMM reads (none for a plain one)."""
    return [] if gemm.ids is None else [gemm.ids]


def _broadcastable(arg, out_shape) -> bool:
    sinfo = getattr(arg, "ty", None)
    if isinstance(sinfo, tvm.ir.PrimType):
        return True
    shape = _shape(arg)
    if shape is None or len(shape) > len(out_shape) or str(sinfo.dtype) not in (*_DTYPES, "bool"):
        return False
    for a, b in zip(reversed(shape), reversed(out_shape), strict=False):
        if _int(a) == 1:
            continue
        if str(a) != str(b):
            return False
    return True


def _ancestors(blk: _Block, exprs: list) -> set:
    """Every variable of the block that ``exprs`` read, directly or through bindings."""
    stack = [v for e in exprs for v in vars_in(e)]
    seen: set = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in blk.value:
            stack.extend(vars_in(blk.value[v]))
    return seen


def _depends_on(blk: _Block, expr, region: set) -> bool:
    stack = [v for v in vars_in(expr)]
    seen = set()
    while stack:
        v = stack.pop()
        if v in region:
            return True
        if v in seen or v not in blk.value:
            continue
        seen.add(v)
        stack.extend(vars_in(blk.value[v]))
    return False
