"""Schedule rules: dlight-style, one rule per file, per target family (``cpu/``, ``cuda/``).

``default_rules(target)`` is the ordered list the pipeline applies: our rules first, then
dlight's defaults. A rule's ``apply(func, target, tunable)`` returns None when it does not apply.
"""

from __future__ import annotations

import tvm
from tvm.s_tir import dlight as dl
from tvm.target import Target

from .. import target as _target


def default_rules(target: Target) -> list[dl.ScheduleRule]:
    if _target.is_gpu(target):
        return [
            dl.gpu.Matmul(),
            dl.gpu.GEMV(),
            dl.gpu.Reduction(),
            dl.gpu.GeneralReduction(),
            dl.gpu.Fallback(),
        ]
    return [dl.cpu.GEMV(), dl.cpu.Reduction()]


def default_schedule_pass(target: Target) -> tvm.transform.Pass:
    """Apply :func:`default_rules` to every PrimFunc that is not yet scheduled."""
    return dl.ApplyDefaultSchedule(*default_rules(target))
