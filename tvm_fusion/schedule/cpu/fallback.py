"""CPU fallback: whatever no other rule took gets at least parallel outer loops and a vector
inner loop where that is legal.

Injective blocks are inlined; each remaining block's leading spatial loops run in parallel and,
when its innermost loop is spatial, that loop is vectorised. Blocks with no spatial loop (a sum
to a scalar) stay serial.
"""

from __future__ import annotations

from tvm import s_tir
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
            return None
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
