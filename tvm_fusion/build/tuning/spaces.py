"""What the search explores: MetaSchedule's tune contexts, our gate rule's space for CUDA gate
kernels, and our default schedules seeded as records.

On CUDA, a gate kernel that our rule schedules searches :func:`gate_space` (the rule with
``tunable=True``: the tile or the GEMV's split is a sampled decision), every other task
MetaSchedule's default space. Before a first search, :func:`seed_default_schedules` measures our
default schedule of every task (:func:`default_schedule`, the rules of
:mod:`tvm_fusion.schedule`) and records it, so the search starts from it. Every function here
takes a ``Target``.
"""

from __future__ import annotations

import logging

import tvm
from tvm.s_tir import meta_schedule as ms

from ...errors import first_line
from ...target import is_cpu
from ..database import mean_secs

logger = logging.getLogger(__name__)

PACKS_WEIGHTS = "it packs weights"
NOT_REPLAYED = "its trace does not replay on the workload"
NO_RULE = "no rule of ours applies"
TIMED_NOT_RECORDED = (PACKS_WEIGHTS, NOT_REPLAYED)  # defaults timed beside the finalists only


def default_schedule(workload: tvm.IRModule, target) -> tuple[tvm.s_tir.Schedule | None, str]:
    """Our default schedule of a task's workload (the rules of :mod:`tvm_fusion.schedule`),
    replayed on the workload so that its trace can be a tuning record; or (None, why not).
    A schedule that packs constant weights comes with :data:`PACKS_WEIGHTS`: it can be timed
    (on packed arguments) but not recorded. One whose trace does not replay on the workload
    comes as the rules made it, with :data:`NOT_REPLAYED`: timed, not recorded either. That is
    the GEMM rule's wherever it reads padded rows in place (``_common.inline_padding`` rebuilds
    the function, so the trace starts from a function the workload is not): every 1 x 1
    convolution of SqueezeNet in NHWC. Before, such a task had no default to time, and a record
    twice as slow replaced ours (the last convolution: 1.32 ms against 0.62)."""
    from tvm.s_tir.dlight.base.transform import _apply_rules

    from ...schedule import _has_preproc, default_rules

    try:
        spaces = _apply_rules(workload["main"], target, default_rules(target), tunable=False)
    except Exception as err:  # noqa: BLE001 - MetaSchedule's copy of the PrimFunc may differ
        return None, first_line(err)
    if not spaces:
        return None, NO_RULE
    why = ""
    try:
        replayed = tvm.s_tir.Schedule(workload)
        spaces[0].trace.apply_to_schedule(replayed, remove_postproc=False)
    except Exception as err:  # noqa: BLE001 - a trace that does not replay is not seeded
        logger.debug("default schedule: trace not replayed: %s", first_line(err))
        replayed, why = spaces[0], NOT_REPLAYED
    if _has_preproc(replayed.mod["main"]):
        # a packed-weight schedule: its records need the layout rewrite of the weights,
        # which MetaScheduleApplyDatabase does not replay the same way (runtime failure)
        return replayed, PACKS_WEIGHTS
    return replayed, why


def gate_space(target) -> ms.space_generator.ScheduleFn:
    """The design space of a CUDA gate kernel: our gate rule applied with ``tunable=True``, so
    that its tile (rows x units per thread, threads, reduction step) or its split-K GEMV's
    split is a ``sample_categorical`` decision over choices within the shared-memory,
    register and thread budgets, our default among them (``gate_fusion.tunable_tiles``).
    Every sample keeps the GEMMs and the gate math in one kernel; MetaSchedule's own rules
    (multi-level tiling) would tile the GEMM apart from the gates and overflow shared memory.
    VerifyGPUCode checks each sample against the target's limits once more."""
    from ...schedule.cuda import GateFusion

    rule = GateFusion()

    def schedule(sch):
        tuned = rule.apply(sch.mod["main"], target, True)
        return tuned if tuned is not None else sch

    return ms.space_generator.ScheduleFn(
        schedule, sch_rules=[], postprocs=[ms.postproc.VerifyGPUCode()], mutator_probs={}
    )


def _ours_tunes(func, target) -> bool:
    """A CUDA gate kernel that our gate rule schedules (so :func:`gate_space` applies)."""
    from ...schedule._common import GATE_ATTR
    from ...schedule.cuda import GateFusion

    if is_cpu(target) or GATE_ATTR not in (func.attrs or {}):
        return False
    try:
        return GateFusion().apply(func, target, False) is not None
    except Exception:  # noqa: BLE001 - a rule that raises declines (ApplyRules does the same)
        return False


def tune_contexts(tasks, target, work_dir, strategy, num_threads, seed=None):
    """MetaSchedule's tune contexts of ``tasks``: on CUDA, gate kernels that our rule
    schedules search :func:`gate_space`, each trial a new sample of it (``ReplayFunc``: the
    rule runs again per candidate, so the decision picks the tile); the other tasks
    MetaSchedule's default space with ``strategy``. Returns (contexts, task weights)."""
    from tvm.s_tir.meta_schedule.logging import get_loggers_from_work_dir
    from tvm.s_tir.meta_schedule.utils import fork_seed

    drop_unnamed_handlers()
    contexts, weights = [], []
    names = [t.task_name for t in tasks]
    for task, log, rand in zip(
        tasks,
        get_loggers_from_work_dir(str(work_dir), names),
        fork_seed(seed, n=len(tasks)),
        strict=True,
    ):
        ours = _ours_tunes(task.dispatched[0]["main"], target)
        contexts.append(
            ms.TuneContext(
                mod=task.dispatched[0],
                target=task.target,
                space_generator=gate_space(target) if ours else "post-order-apply",
                search_strategy=ms.search_strategy.ReplayFunc() if ours else strategy,
                task_name=task.task_name,
                logger=log,
                rand_state=rand,
                num_threads=num_threads,
            ).clone()
        )
        weights.append(task.weight)
    return contexts, weights


def sample_candidates(contexts, per_task: int) -> dict[str, list[tvm.s_tir.Schedule]]:
    """The first ``per_task`` measure candidates of each context, as the search generates
    them (design space, sampled decisions, postprocessors; nothing built or measured):
    ``{task name: [schedule]}``."""
    found = {}
    for ctx in contexts:
        ctx.pre_tuning(max_trials=per_task, num_trials_per_iter=per_task)
        try:
            found[ctx.task_name] = [c.sch for c in ctx.generate_measure_candidates() or []]
        finally:
            ctx.post_tuning()
    return found


def seed_default_schedules(tasks, target, database, builder, runner, say) -> int:
    """Measure our default schedule (the rules of :mod:`tvm_fusion.schedule`) of every task
    and commit it to ``database`` as a tuning record, so the search starts from it and the
    database's best is never worse than what the pipeline does untuned. Returns how many."""
    device = "cpu" if is_cpu(target) else target.kind.name
    seeded = 0
    for task in tasks:
        workload = task.dispatched[0]
        replayed, why = default_schedule(workload, target)
        if replayed is None or why:
            if why != NO_RULE:
                say(f"default schedule of {task.task_name} not seeded: {why}")
            continue
        (built,) = builder.build([ms.builder.BuilderInput(replayed.mod, target)])
        if built.error_msg:
            say(f"default schedule of {task.task_name} does not build: {built.error_msg[:200]}")
            continue
        args_info = ms.arg_info.ArgInfo.from_entry_func(replayed.mod, remove_preproc=True)
        (future,) = runner.run([ms.runner.RunnerInput(built.artifact_path, device, args_info)])
        result = future.result()
        if result.error_msg or not result.run_secs:
            say(f"default schedule of {task.task_name} did not run: {result.error_msg[-300:]}")
            continue
        database.commit_tuning_record(
            ms.database.TuningRecord(
                replayed.trace,
                database.commit_workload(workload),
                result.run_secs,
                target,
                args_info,
            )
        )
        say(
            f"seeded {task.task_name} with the default schedule: "
            f"{mean_secs(result.run_secs) * 1e3:.4f} ms"
        )
        seeded += 1
    return seeded


def drop_unnamed_handlers() -> None:
    """MetaSchedule rebuilds its logging config from the names of the handlers its logger
    holds; an unnamed one (pytest's capture handler, a user's ``addHandler``) makes a second
    tuning run in one process fail with "'NoneType' object has no attribute 'format'"."""
    ms_logger = logging.getLogger("tvm.s_tir.meta_schedule")
    for handler in list(ms_logger.handlers):
        if handler.get_name() is None:
            ms_logger.removeHandler(handler)
