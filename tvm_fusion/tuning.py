"""MetaSchedule: applying a tuning database (tuning runs come with the tune command)."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms


def apply_database_pass(work_dir: str) -> tvm.transform.Pass:
    """Apply the tuned schedules recorded in ``work_dir``'s JSON database."""

    @tvm.transform.module_pass(opt_level=0, name="ApplyTuningDatabase")
    def _apply(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        database = ms.database.JSONDatabase(work_dir=work_dir)
        with database:
            return relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)

    return _apply
