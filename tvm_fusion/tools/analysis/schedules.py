"""How the kernels of a lowered module are scheduled: parallel, vector and thread loops, and
the schedule rule that scheduled each (``tvm_fusion.schedule_rule``; ``tvm-fusion explain``).
:func:`fallback_kernels` names those that only a rule of last resort, or none, scheduled.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import tirx

from ...tir_util import loops as tir_loops


@dataclasses.dataclass
class ScheduleInfo:
    """How one device PrimFunc of a lowered module is scheduled."""

    name: str
    scheduled: bool
    parallel: bool
    vectorized: bool
    thread_bound: bool
    loops: int
    rule: str | None = None  # the schedule rule that scheduled it (None: a tuning database)


def schedule_info(mod: tvm.IRModule) -> list[ScheduleInfo]:
    """For every kernel PrimFunc (not host shape functions): parallel / vector / thread loops."""
    infos = []
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs.get("tirx.is_host_func", False):
            continue
        kinds = [loop.kind for loop in tir_loops(func)]
        infos.append(
            ScheduleInfo(
                name=gv.name_hint,
                scheduled=bool(func.attrs.get("tirx.is_scheduled", False)),
                parallel=tirx.ForKind.PARALLEL in kinds,
                vectorized=tirx.ForKind.VECTORIZED in kinds,
                thread_bound=tirx.ForKind.THREAD_BINDING in kinds,
                loops=len(kinds),
                rule=_rule_of(func),
            )
        )
    return infos


def _rule_of(func: tirx.PrimFunc) -> str | None:
    from ...schedule import RULE_ATTR

    name = func.attrs.get(RULE_ATTR, None)
    return str(name) if name is not None else None


def fallback_kernels(mod: tvm.IRModule) -> list[str]:
    """Kernels of a lowered module that only a rule of last resort scheduled (``Fallback``), or
    that no rule scheduled at all (no rule name and not marked scheduled: e.g. a non-global
    ``adaptive_avg_pool2d``, which TVM's block analysis cannot read, so every rule declines)."""
    from ...schedule import FALLBACK_RULES

    return [
        info.name
        for info in schedule_info(mod)
        if info.rule in FALLBACK_RULES or (info.rule is None and not info.scheduled)
    ]
