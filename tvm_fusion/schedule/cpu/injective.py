"""CPU rule for injective groups: elementwise, broadcast, reshape/transpose index maps, slices.

Every block but the outputs is inlined; each output block's innermost loop is vectorised (by
the target's lanes, or the largest power-of-two divisor of a static extent) and its leading
loops are fused and run in parallel over the target's cores.
"""

from __future__ import annotations

from tvm import s_tir
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.target import Target

from ... import target as _target
from .._common import (
    CPURule,
    block_dtype,
    extent,
    is_reduction,
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
