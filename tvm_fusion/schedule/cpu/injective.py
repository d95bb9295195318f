"""CPU rule for injective groups: elementwise, broadcast, reshape/transpose index maps, slices.

Every block but the outputs is inlined; each output block's innermost loop is vectorised (by
the target's lanes, or the largest power-of-two divisor of a static extent) and its leading
loops are fused and run in parallel over the target's cores.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.target import Target

from ... import target as _target
from ...tir_util import loads_in, vars_in
from .._common import (
    CPURule,
    block_dtype,
    block_realize,
    extent,
    is_reduction,
    is_static,
    is_trivial_reduction,
    is_vectorized,
    loop_nest_work,
    parallelize_outer,
    takes_vector_tail,
    try_inline_safe,
    vectorize_innermost,
    vectorize_with_tail,
)


class Injective(CPURule):
    def apply(self, func, target: Target, tunable: bool):
        if not self.applicable(func, target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or any(
            (not info.is_injective() or is_reduction(sch, info.block_rv))
            and not is_trivial_reduction(sch, info.block_rv)
            for info in infos
        ):
            return None
        remaining = try_inline_safe(sch, list(infos))
        cores = _target.num_cores(target)
        for info in remaining:
            schedule_spatial(sch, info.block_rv, target, cores)
        return sch


def schedule_spatial(sch: s_tir.Schedule, block, target: Target, cores: int) -> None:
    """Vectorise the innermost loop, parallelise the leading ones. A static innermost loop
    that no power of two of at least 2 divides and that holds a whole vector (55 or 27 wide
    images, SqueezeNet's) is left out of the parallel loops and vectorised last, in whole
    vectors plus a shorter vector tail
    (``vectorize_with_tail``); kept whole, it stayed a scalar loop (LLVM does not vectorise a
    body that branches on ``if_then_else``, a concatenation's): SqueezeNet's slice + bias +
    ReLU + concatenation of 128 x 55 x 55 took 0.2 ms a call against ONNX Runtime's 0.08."""
    lanes = _target.vector_lanes(target, block_dtype(sch, block))
    work = loop_nest_work(sch, block)
    block_transpose(sch, block, lanes)
    vectorize_innermost(sch, block, lanes)
    loops = sch.get_loops(block)
    tail = False
    if loops and is_vectorized(sch, loops[-1]):
        loops = loops[:-1]
    elif len(loops) > 1 and takes_vector_tail(extent(sch, loops[-1]), lanes, min_vectors=1):
        tail, loops = True, loops[:-1]
    parallelize_outer(sch, loops, cores, work=work)
    if tail:
        vectorize_with_tail(sch, block, lanes, min_vectors=1)


def _loads(stmt) -> list:
    """The loads of a block whose body is one store."""
    value = getattr(stmt.body, "value", None)
    return loads_in(value) if isinstance(value, tirx.Expr) else []


def transposed_read(sch: s_tir.Schedule, block) -> int | None:
    """The loop (index into ``sch.get_loops(block)``) that drives the innermost index of a
    transposed read, or None: a load of ``block`` whose last index is one loop's variable
    other than the innermost loop's, while the innermost loop's variable moves one of its
    other indices (``y[c, h, w] = x[h, w, c]``: each step of ``w`` reads another cache line).
    Only where every loop binds one block variable (the normalised injective blocks)."""
    loops = sch.get_loops(block)
    stmt = sch.get(block)
    realize = block_realize(sch, block)
    if realize is None:
        return None
    loop_vars = [sch.get(lp).loop_var for lp in loops]
    iter_of = {}
    for iv, value in zip(stmt.iter_vars, realize.iter_values, strict=True):
        for i, lv in enumerate(loop_vars):
            if value.same_as(lv):
                iter_of[iv.var] = i
    last = len(loops) - 1
    inner = [v for v, i in iter_of.items() if i == last]
    if len(loops) < 2 or not inner:
        return None
    for load in _loads(stmt):
        indices = list(load.indices)
        if len(indices) < 2 or not isinstance(indices[-1], tirx.Var):
            continue
        k = iter_of.get(indices[-1])
        if k is None or k == last:
            continue
        if any(inner[0] in vars_in(i) for i in indices[:-1]):
            return k
    return None


def block_transpose(sch: s_tir.Schedule, block, lanes: int) -> bool:
    """Tile a transposing copy so that its reads hit L1: the loop that drives the read's
    innermost index (see :func:`transposed_read`) is split by ``lanes`` (or left whole when it
    is no longer) and its inner part moved just outside the innermost loop, so that one pass
    of the innermost loop reads ``lanes`` neighbouring elements of every cache line it
    touches, and the next passes read the rest of those lines from L1. Before, each step of
    the innermost loop read a new line and came back to it only after the whole row."""
    k = transposed_read(sch, block)
    if k is None:
        return False
    loops = sch.get_loops(block)
    ext = extent(sch, loops[k])
    if not is_static(ext) or ext < 2:
        return False
    if ext > lanes:
        if ext % lanes:
            return False
        outer, inner = sch.split(loops[k], [None, lanes])
    else:
        outer, inner = None, loops[k]
    loops = sch.get_loops(block)
    middle = list(loops[k + (2 if outer is not None else 1) : -1])
    if not middle:
        return False
    sch.reorder(*middle, inner, loops[-1])
    return True
