"""Reductions whose loops may run zero times keep their initial value.

A TIR reduction block writes its ``T.init()`` value when its reduction loops are at their
first iteration: lowered, the init is an ``if`` inside the loops. When a reduction loop has
extent 0 (a symbolic extent that is 0 at run time: ``ReduceProd`` over an empty axis, a
matmul with ``K = 0``) the body never runs and the output keeps whatever its memory held:
apache-tvm 0.27's legalized ``prod`` over a ``(2, 3, 0)`` input returned 3e-45 instead of 1
(sums looked right only because fresh memory is zero). :func:`init_outside_empty_loops`
applies ``decompose_reduction`` above the outermost reduction loop of each such block (the
init gets loops of its own, run whatever the reduction's extent), where some reduction
loop's extent is not provably >= 1; static positive extents (almost every kernel) are left
as they are. :class:`~tvm_fusion.schedule.ApplyRules` runs it on every kernel a rule
scheduled.
"""

from __future__ import annotations

import logging

from tvm import s_tir, sym, tirx

from ..tir_util import iter_stmts, vars_in

logger = logging.getLogger(__name__)


def _maybe_empty(extent, analyzer) -> bool:
    return not analyzer.can_prove(extent >= 1)


def init_outside_empty_loops(sch: s_tir.Schedule) -> int:
    """Decompose the reductions of ``sch`` whose reduction loops may run zero times (see the
    module docstring); the number decomposed. A block the primitive refuses stays (logged)."""
    func = sch.mod["main"]
    analyzer = sym.Analyzer()
    todo = []
    for realize in iter_stmts(func.body):
        if not isinstance(realize, s_tir.SBlockRealize) or realize.block.init is None:
            continue
        block = realize.block
        reducing = []
        for iv, value in zip(block.iter_vars, realize.iter_values, strict=True):
            if iv.iter_type == tirx.IterVar.CommReduce:
                reducing += list(vars_in(value))
        if reducing:
            todo.append((block.name_hint, reducing))
    count = 0
    for name, reducing in todo:
        try:
            block_rv = sch.get_sblock(name)
            loops = [(rv, sch.get(rv)) for rv in sch.get_loops(block_rv)]
            reduction = [
                (rv, loop) for rv, loop in loops if any(loop.loop_var.same_as(v) for v in reducing)
            ]
            if not reduction or not any(_maybe_empty(lp.extent, analyzer) for _, lp in reduction):
                continue
            sch.decompose_reduction(block_rv, reduction[0][0])
            count += 1
        except Exception as err:  # noqa: BLE001 - the kernel stays as the rule made it
            logger.debug("init_outside_empty_loops: %s left: %s", name, err)
    return count
