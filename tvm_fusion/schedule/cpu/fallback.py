"""CPU fallback: whatever no other rule took gets at least parallel outer loops and a vector
inner loop where that is legal.

Injective blocks are inlined; each remaining block's leading spatial loops run in parallel and,
when its innermost loop is spatial, that loop is vectorised. Blocks with no spatial loop (a sum
to a scalar) stay serial.

Kernels that TVM's block analysis cannot read (``normalize_prim_func`` returns None: a
non-global ``adaptive_avg_pool2d``, whose window bounds depend on the output position, is a
reduction block nested in a spatial one): the outer loops of each top-level block whose block
iterators are all spatial run in parallel; nothing else changes (the inner reduction stays as
legalised).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.target import Target

from ... import target as _target
from .._common import (
    CPURule,
    block_dtype,
    is_reduction,
    is_vectorized,
    loop_nest_work,
    parallelize_outer,
    try_inline_safe,
    vectorize_innermost,
)


class Fallback(CPURule):
    def apply(self, func, target: Target, tunable: bool):
        if not self.applicable(func, target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos:
            return _outer_parallel(sch, target)
        infos = try_inline_safe(sch, list(infos))  # keeps program order, never inlines reductions
        cores = _target.num_cores(target)
        for info in infos:
            block = info.block_rv
            kinds = info.dom_kind()
            work = loop_nest_work(sch, block)
            leading = len(kinds) - len(kinds.lstrip("S"))
            if kinds and leading == len(kinds) and not is_reduction(sch, block):
                lanes = _target.vector_lanes(target, block_dtype(sch, block))
                vectorize_innermost(sch, block, lanes)
            loops = sch.get_loops(block)
            spatial = loops[:leading]
            if spatial and is_vectorized(sch, spatial[-1]):
                spatial = spatial[:-1]
            if spatial:
                try:
                    parallelize_outer(sch, spatial, cores, work=work)
                except Exception:  # noqa: BLE001 - e.g. a loop shared with another block
                    pass
        return sch


def _outer_parallel(sch: s_tir.Schedule, target: Target):
    """Parallel outer loops of the top-level all-spatial blocks; None when there are none."""
    cores = _target.num_cores(target)
    done = False
    try:
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except Exception:  # noqa: BLE001 - no root block: leave the kernel alone
        return None
    for block in blocks:
        if any(int(iv.iter_type) != 0 for iv in sch.get(block).iter_vars):  # 0: data parallel
            continue
        loops = sch.get_loops(block)
        # a nested reduction's loops (extents that depend on the outer ones) are not counted
        nested = not isinstance(sch.get(block).body, tirx.BufferStore)
        work = None if nested else loop_nest_work(sch, block)
        try:
            done |= parallelize_outer(sch, loops, cores, work=work) is not None
        except Exception:  # noqa: BLE001 - e.g. a loop shared with another block
            continue
    return sch if done else None
