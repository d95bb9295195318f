"""MetaSchedule tuning runs over the fused groups, and applying their database.

``tune(mod, target, work_dir, trials)`` lowers ``mod`` to its fused, unscheduled PrimFuncs
(Phases 0-3 of the ``tvm_fusion`` pipeline, or stock's grouping for ``pipeline="stock"``, so
that both can be tuned with the same budget), extracts one task per distinct PrimFunc and tunes
them with MetaSchedule's evolutionary search and XGBoost cost model. Records go to the JSON
database in ``work_dir`` (``database_workload.json``, ``database_tuning_record.json``):

- resumable: a second run with the same ``work_dir`` counts the trials already spent there
  (MetaSchedule's task logs, failed trials included) and only spends what is left of
  ``trials``; the search starts from the best records found so far. Use one work dir per model;
- before the search, our default schedule of each task (the rules of
  :mod:`tvm_fusion.schedule`) is measured and recorded: the search starts from it, and the
  database's best is never worse than the untuned pipeline;
- candidates are built by :func:`build_candidate` (the stock build function spends 32 s here
  importing every tensor intrinsic, in each builder process of each batch); builds time out
  after ``build_timeout`` seconds and such candidates are skipped;
- applied by ``build_pipeline(tuning_db=work_dir)`` (CLI: ``--tuning-db DIR``) before the
  default schedules, which then leave the tuned PrimFuncs alone;
- measured locally, or on the machines of an RPC tracker (``rpc="HOST:PORT"`` and ``rpc_key``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import tvm
from tvm import relax
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .errors import UsageError, first_line
from .target import num_cores, parse_target

logger = logging.getLogger(__name__)


def apply_database_pass(work_dir: str) -> tvm.transform.Pass:
    """Apply the tuned schedules recorded in ``work_dir``'s JSON database."""

    @tvm.transform.module_pass(opt_level=0, name="ApplyTuningDatabase")
    def _apply(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        database = ms.database.JSONDatabase(work_dir=work_dir)
        with database:
            return relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)

    return _apply


def fused_module(mod: tvm.IRModule, target, pipeline: str = "tvm_fusion", **flags) -> tvm.IRModule:
    """``mod`` lowered to one unscheduled PrimFunc per fused group, as ``pipeline`` groups it."""
    from .pipeline import fused_passes, stock_fused_passes
    from .schedule import prepare_passes

    tgt = parse_target(target)
    if pipeline == "tvm_fusion":
        passes = fused_passes(tgt, **flags)
    elif pipeline == "stock":
        if flags:
            raise UsageError(f"the stock pipeline takes no flags, got {sorted(flags)}")
        passes = stock_fused_passes(tgt)
    else:
        raise UsageError(f"unknown pipeline {pipeline!r}; known: stock, tvm_fusion")
    with tgt:
        return tvm.transform.Sequential([*passes, *prepare_passes()])(mod)


def parse_tracker(spec: str) -> tuple[str, int]:
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"RPC tracker must be HOST:PORT, got {spec!r}")
    return host, int(port)


@dataclasses.dataclass
class TuneReport:
    work_dir: str
    tasks: list[str]
    trials_before: int
    trials_after: int
    seconds: float
    best_ms: dict[str, float]  # task name -> best measured latency
    wrong: list[str] = dataclasses.field(default_factory=list)  # best record disagrees

    def to_text(self) -> str:
        lines = [
            f"tuned {len(self.tasks)} task(s) in {self.seconds:.0f} s; "
            f"{self.trials_before} -> {self.trials_after} trials in {self.work_dir}"
        ]
        for name in self.tasks:
            best = self.best_ms.get(name)
            line = f"  {name}: best {best:.4f} ms" if best is not None else f"  {name}: -"
            if name in self.wrong:
                line += "  WRONG: its numbers differ from the unscheduled function"
            lines.append(line)
        return "\n".join(lines)


def _records(database: ms.database.JSONDatabase, mod: tvm.IRModule, limit: int) -> list:
    """The best ``limit`` measured records of ``mod`` (failed builds/runs are not recorded)."""
    if not database.has_workload(mod):
        return []
    return list(database.get_top_k(database.commit_workload(mod), limit))


def record_is_correct(record, target, rtol: float = 1e-3, atol: float = 1e-4) -> bool | None:
    """Run ``record``'s schedule and its unscheduled workload on the same random inputs and
    compare every buffer afterwards. None where that cannot be checked here (a non-CPU target,
    symbolic shapes). MetaSchedule measures speed only; a candidate that computes something
    else is still recorded, and the fastest one wins (see ``KeepLayoutFreeWeights``)."""
    import numpy as np

    from .target import is_cpu

    if not is_cpu(target):
        return None
    workload = record.workload.mod
    infos = ms.arg_info.ArgInfo.from_prim_func(workload["main"])
    shapes = []
    for info in infos:
        if not all(isinstance(d, int | tvm.tirx.IntImm) for d in info.shape):
            return None
        shapes.append(([int(d) for d in info.shape], str(info.dtype)))
    sch = tvm.s_tir.Schedule(workload)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    rng = np.random.default_rng(0)
    dev = tvm.cpu()
    data = [
        rng.standard_normal(shape).astype(dtype)
        if dtype.startswith(("float", "bfloat"))
        else np.zeros(shape, dtype)  # indices: 0 is in range for every gather
        for shape, dtype in shapes
    ]
    results = []
    for mod in (workload, sch.mod):
        func = tvm.compile(mod, target=target)
        args = [tvm.runtime.tensor(d, dev) for d in data]
        func(*args)
        results.append([a.numpy() for a in args])
    return all(
        np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        for a, b in zip(*results, strict=True)
    )


def trials_spent(work_dir: str | Path) -> int:
    """Trials spent so far, failed ones included: MetaSchedule's per-task logs count them."""
    total = 0
    for log in (Path(work_dir) / "logs").glob("*task_*.log"):
        total += sum(
            1 for line in log.read_text(errors="replace").splitlines() if "] Trial #" in line
        )
    return total


def _best_ms(records) -> float | None:
    times = [
        sum(float(t) for t in r.run_secs) / len(r.run_secs) * 1e3 for r in records if r.run_secs
    ]
    return min(times) if times else None


@derived_object
class _Progress(ms.measure_callback.PyMeasureCallback):
    """Prints, after each measured batch: task, trials so far, best latency so far."""

    def __init__(self, names: list[str], report: Callable[[str], None]):
        self.names = names
        self.report = report
        self.trials = [0] * len(names)
        self.best = [float("inf")] * len(names)

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        for result in runner_results:
            self.trials[task_id] += 1
            if result.run_secs:
                secs = sum(float(t) for t in result.run_secs) / len(result.run_secs)
                self.best[task_id] = min(self.best[task_id], secs * 1e3)
        best = self.best[task_id]
        done = sum(1 for t in self.trials if t)
        self.report(
            f"task {task_id + 1}/{len(self.names)} {self.names[task_id]}: "
            f"{self.trials[task_id]} trials, best "
            + (f"{best:.4f} ms" if best < float("inf") else "-")
            + f" ({done}/{len(self.names)} tasks started)"
        )


def build_candidate(mod: tvm.IRModule, target, _params=None):
    """MetaSchedule's ``default_build`` minus ``import tvm.s_tir.tensor_intrin`` on CPUs.

    The stock build function imports every tensor intrinsic (CUDA, ROCm, ...) first: 32 s on
    this 2-core machine, paid again by each builder process of each batch, so with the default
    30 s build timeout the first candidates of every batch time out. llvm schedules here use
    no tensor intrinsics; GPU targets still import them.
    """
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    from .target import is_cpu

    if not is_cpu(target):
        import tvm.s_tir.tensor_intrin  # noqa: F401 - registers tensor intrinsics

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def seed_default_schedules(tasks, target, database, builder, runner, say) -> int:
    """Measure our default schedule (the rules of :mod:`tvm_fusion.schedule`) of every task
    and commit it to ``database`` as a tuning record, so the search starts from it and the
    database's best is never worse than what the pipeline does untuned. Returns how many."""
    from tvm.s_tir.dlight.base.transform import _apply_rules

    from .schedule import default_rules
    from .target import is_cpu

    rules = default_rules(target)
    device = "cpu" if is_cpu(target) else target.kind.name
    seeded = 0
    for task in tasks:
        workload = task.dispatched[0]
        func = workload["main"]
        try:
            spaces = _apply_rules(func, target, rules, tunable=False)
        except Exception as err:  # noqa: BLE001 - MetaSchedule's copy of the PrimFunc may differ
            say(f"default schedule of {task.task_name} not seeded: {first_line(err)}")
            continue
        if not spaces:
            continue
        sch = spaces[0]
        try:
            replayed = tvm.s_tir.Schedule(workload)
            sch.trace.apply_to_schedule(replayed, remove_postproc=False)
        except Exception as err:  # noqa: BLE001 - a trace that does not replay is not seeded
            say(f"default schedule of {task.task_name} not seeded: {first_line(err)}")
            continue
        from .schedule import _has_preproc

        if _has_preproc(replayed.mod["main"]):
            # a packed-weight schedule: its records need the layout rewrite of the weights,
            # which MetaScheduleApplyDatabase does not replay the same way (runtime failure)
            say(f"default schedule of {task.task_name} not seeded: it packs weights")
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
        secs = sum(float(t) for t in result.run_secs) / len(result.run_secs)
        say(f"seeded {task.task_name} with the default schedule: {secs * 1e3:.4f} ms")
        seeded += 1
    return seeded


def _drop_unnamed_handlers() -> None:
    """MetaSchedule rebuilds its logging config from the names of the handlers its logger
    holds; an unnamed one (pytest's capture handler, a user's ``addHandler``) makes a second
    tuning run in one process fail with "'NoneType' object has no attribute 'format'"."""
    ms_logger = logging.getLogger("tvm.s_tir.meta_schedule")
    for handler in list(ms_logger.handlers):
        if handler.get_name() is None:
            ms_logger.removeHandler(handler)


def tune(
    mod: tvm.IRModule,
    target,
    work_dir: str | Path,
    trials: int,
    pipeline: str = "tvm_fusion",
    rpc: str | None = None,
    rpc_key: str | None = None,
    trials_per_iter: int = 16,
    build_timeout: float = 30.0,
    progress: Callable[[str], None] | None = None,
    seed: int | None = None,
    **flags,
) -> TuneReport:
    """Tune the fused groups of ``mod`` for ``target`` with at most ``trials`` measurements in
    all (counting those already in ``work_dir``). See the module docstring."""
    if trials < 1:
        raise UsageError(f"trials must be positive, got {trials}")
    tracker = parse_tracker(rpc) if rpc else None
    if tracker and not rpc_key:
        raise UsageError("--rpc-tracker needs --rpc-key")
    tgt = parse_target(target)
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    fused = fused_module(mod, tgt, pipeline, **flags)
    tasks = ms.relax_integration.extract_tasks(fused, tgt)
    if not tasks:
        raise UsageError("nothing to tune: the module has no kernels")
    names = [t.task_name for t in tasks]
    database = ms.database.JSONDatabase(work_dir=str(work_dir))
    before = trials_spent(work_dir)
    start = time.perf_counter()
    remaining = trials - before
    say = progress or (lambda line: logger.info("%s", line))
    if remaining > 0:
        say(f"tuning {len(tasks)} task(s), {remaining} trial(s) ({before} already recorded)")
        # The stock population (512 candidates, 50 unmeasured to start) costs minutes of
        # search per iteration on a small machine; a small budget gets a smaller population.
        _drop_unnamed_handlers()
        population = max(32, min(512, 4 * trials))
        strategy = ms.search_strategy.EvolutionarySearch(
            population_size=population, init_min_unmeasured=min(50, population // 2)
        )
        contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
            tasks, str(work_dir), strategy=strategy, num_threads=num_cores(tgt), seed=seed
        )
        runner = ms.runner.LocalRunner()
        if tracker:
            host, port = tracker
            runner = ms.runner.RPCRunner(
                ms.runner.RPCConfig(
                    tracker_host=host,
                    tracker_port=port,
                    tracker_key=rpc_key,
                    session_timeout_sec=120,
                )
            )
        builder = ms.builder.LocalBuilder(timeout_sec=build_timeout, f_build=build_candidate)
        if before == 0 and pipeline == "tvm_fusion":  # stock's groups get no rules of ours
            seed_default_schedules(tasks, tgt, database, builder, runner, say)
        callbacks = [*ms.measure_callback.MeasureCallback.create("default"), _Progress(names, say)]
        ms.tune.tune_tasks(
            tasks=contexts,
            task_weights=weights,
            work_dir=str(work_dir),
            max_trials_global=remaining,
            num_trials_per_iter=min(trials_per_iter, remaining),
            builder=builder,
            runner=runner,
            database=database,
            cost_model="xgb",
            measure_callbacks=callbacks,
        )
    else:
        say(f"nothing left to tune: {before} record(s) for a budget of {trials}")
    after = trials_spent(work_dir)
    best, wrong = {}, []
    for t in tasks:
        top = _records(database, t.dispatched[0], 1)
        best[t.task_name] = _best_ms(top)
        if top and record_is_correct(top[0], tgt) is False:
            wrong.append(t.task_name)
            say(f"{t.task_name}: the best record computes different numbers; not usable")
    return TuneReport(
        str(work_dir),
        names,
        before,
        after,
        time.perf_counter() - start,
        {k: v for k, v in best.items() if v is not None},
        wrong,
    )
