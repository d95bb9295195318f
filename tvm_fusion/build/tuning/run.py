"""A tuning run: ``mod`` lowered to its fused groups, one MetaSchedule task per distinct
PrimFunc, the search, the finalists measured again, a :class:`TuneReport`.

:func:`tune` is the entry (a target is parsed there and handed down as a ``Target``);
:func:`fused_module` gives the PrimFuncs that tasks are extracted from, as our pipeline or
stock's groups them; :func:`dry_run` stops before measuring, for a target with no device here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ...errors import UsageError, first_line
from ...target import is_cpu, num_cores, parse_target
from ..database import mean_secs, open_database, top_records, trials_spent
from ..pipeline import fused_passes, stock_fused_passes
from .finalists import record_is_correct, verify_finalists
from .measure import PooledBuilder, build_candidate, check_tracker, parse_tracker
from .spaces import drop_unnamed_handlers, sample_candidates, seed_default_schedules, tune_contexts

logger = logging.getLogger(__name__)


def fused_module(mod: tvm.IRModule, target, pipeline: str = "tvm_fusion", **flags) -> tvm.IRModule:
    """``mod`` lowered to one unscheduled PrimFunc per fused group, as ``pipeline`` groups it.
    ``target``: what :func:`~tvm_fusion.target.parse_target` takes (None: the host)."""
    return _fused(mod, parse_target(target), pipeline, flags)


def _fused(mod: tvm.IRModule, tgt: Target, pipeline: str, flags: dict) -> tvm.IRModule:
    from ...schedule import prepare_passes

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


@dataclasses.dataclass
class TuneReport:
    work_dir: str
    tasks: list[str]
    trials_before: int
    trials_after: int
    seconds: float
    best_ms: dict[str, float]  # task name -> best measured latency
    wrong: list[str] = dataclasses.field(default_factory=list)  # best record disagrees
    # task name -> (best ms as MetaSchedule measured it, best ms of the finalists re-measured)
    verified: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)

    def to_text(self) -> str:
        lines = [
            f"tuned {len(self.tasks)} task(s) in {self.seconds:.0f} s; "
            f"{self.trials_before} -> {self.trials_after} trials in {self.work_dir}"
        ]
        for name in self.tasks:
            best = self.best_ms.get(name)
            line = f"  {name}: best {best:.4f} ms" if best is not None else f"  {name}: -"
            if best is None and name in self.verified:
                line = f"  {name}: our default schedule, {self.verified[name][1]:.4f} ms"
            if name in self.verified:
                line += f" (finalists re-measured; single measurement {self.verified[name][0]:.4f})"
            if name in self.wrong:
                line += "  WRONG: its numbers differ from the unscheduled function"
            lines.append(line)
        return "\n".join(lines)


def _best_ms(records) -> float | None:
    times = [mean_secs(r.run_secs) * 1e3 for r in records if r.run_secs]
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
                self.best[task_id] = min(self.best[task_id], mean_secs(result.run_secs) * 1e3)
        best = self.best[task_id]
        done = sum(1 for t in self.trials if t)
        self.report(
            f"task {task_id + 1}/{len(self.names)} {self.names[task_id]}: "
            f"{self.trials[task_id]} trials, best "
            + (f"{best:.4f} ms" if best < float("inf") else "-")
            + f" ({done}/{len(self.names)} tasks started)"
        )


def _search_strategy(trials: int):
    """The stock population (512 candidates, 50 unmeasured to start) costs minutes of search
    per iteration on a small machine; a small budget gets a smaller population (the dry run
    the same as the run it stands for)."""
    population = max(32, min(512, 4 * trials))
    return ms.search_strategy.EvolutionarySearch(
        population_size=population, init_min_unmeasured=min(50, population // 2)
    )


def dry_run(
    mod, target: Target, per_task, build_timeout, seed, say, pipeline="tvm_fusion", **flags
):
    """Tuning up to the builder, for a target with no device here: the first ``per_task``
    candidates of every task generated as :func:`tune` would, and built. Returns a summary
    ("N of M candidates of T task(s) built")."""
    import shutil
    import tempfile

    fused = _fused(mod, target, pipeline, flags)
    tasks = ms.relax_integration.extract_tasks(fused, target)
    if not tasks:
        raise UsageError("nothing to tune: the module has no kernels")
    drop_unnamed_handlers()
    with tempfile.TemporaryDirectory() as work:
        strategy = _search_strategy(per_task)
        contexts, _ = tune_contexts(tasks, target, work, strategy, num_cores(target), seed)
        candidates = sample_candidates(contexts, per_task)
    inputs = [
        ms.builder.BuilderInput(sch.mod, target) for schs in candidates.values() for sch in schs
    ]
    builder = PooledBuilder(timeout_sec=build_timeout, f_build=build_candidate)
    try:
        results = builder.build(inputs) if inputs else []
    finally:
        builder.close()
    for result in results:
        if result.artifact_path:
            shutil.rmtree(Path(result.artifact_path).parent, ignore_errors=True)
    failed = [r.error_msg for r in results if r.error_msg]
    for task, schs in candidates.items():
        say(f"{task}: {len(schs)} candidate(s) generated")
    for error in failed[:3]:
        say(f"build failed: {first_line(error)}")
    return (
        f"{len(results) - len(failed)} of {len(results)} candidates of {len(tasks)} task(s) "
        "generated and built, none measured"
    )


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
    verify: int = 8,
    builder: ms.builder.Builder | None = None,
    runner: ms.runner.Runner | None = None,
    **flags,
) -> TuneReport:
    """Tune the fused groups of ``mod`` for ``target`` with at most ``trials`` measurements in
    all (counting those already in ``work_dir``), then measure the ``verify`` best records of
    each task again (:func:`verify_finalists`; 0: keep MetaSchedule's single measurements).
    See :mod:`tvm_fusion.build.tuning`.

    ``builder`` / ``runner``: MetaSchedule's, kept by the caller across runs (their processes
    start once: ~5 s each) and left open; by default the run makes its own (a
    :class:`~.measure.PooledBuilder`; a ``LocalRunner``, or an ``RPCRunner`` with ``rpc``) and
    ends their processes when it ends."""
    if trials < 1:
        raise UsageError(f"trials must be positive, got {trials}")
    if trials_per_iter < 1:
        raise UsageError(f"trials per iteration must be positive, got {trials_per_iter}")
    if verify < 0:
        raise UsageError(f"verify must be 0 or more, got {verify}")
    tracker = parse_tracker(rpc) if rpc else None
    if tracker and not rpc_key:
        raise UsageError("--rpc-tracker needs --rpc-key")
    if tracker and runner is not None:
        raise UsageError("give either an RPC tracker or a runner, not both")
    tgt = parse_target(target)
    say = progress or (lambda line: logger.info("%s", line))
    if not tracker and not is_cpu(tgt) and not tvm.device(tgt.kind.name, 0).exist:
        # MetaSchedule's local runner would wait on every build and record nothing: generate
        # and build the first batch of candidates, then stop before measuring
        built = dry_run(
            mod, tgt, min(trials, trials_per_iter), build_timeout, seed, say, pipeline, **flags
        )
        raise UsageError(
            f"no {tgt.kind.name} device on this machine to measure on ({built}); tune over "
            "RPC (--rpc-tracker HOST:PORT --rpc-key KEY) from a machine with one"
        )
    work_dir = Path(work_dir)
    if work_dir.exists() and not work_dir.is_dir():
        raise UsageError(f"tuning work dir {work_dir} is not a directory")
    if tracker:
        check_tracker(*tracker)
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create tuning work dir {work_dir}: {err.strerror}") from None
    database = open_database(work_dir)
    fused = _fused(mod, tgt, pipeline, flags)
    tasks = ms.relax_integration.extract_tasks(fused, tgt)
    if not tasks:
        raise UsageError("nothing to tune: the module has no kernels")
    names = [t.task_name for t in tasks]
    before = trials_spent(work_dir)
    start = time.perf_counter()
    remaining = trials - before
    own_runner, own_builder = runner is None, builder is None
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
    elif own_runner:
        runner = ms.runner.LocalRunner()
    if own_builder:
        builder = PooledBuilder(timeout_sec=build_timeout, f_build=build_candidate)
    try:
        if remaining > 0:
            say(f"tuning {len(tasks)} task(s), {remaining} trial(s) ({before} already recorded)")
            drop_unnamed_handlers()
            strategy = _search_strategy(trials)
            contexts, weights = tune_contexts(
                tasks, tgt, work_dir, strategy, num_threads=num_cores(tgt), seed=seed
            )
            if before == 0 and pipeline == "tvm_fusion":  # stock's groups get no rules of ours
                seed_default_schedules(tasks, tgt, database, builder, runner, say)
            callbacks = [
                *ms.measure_callback.MeasureCallback.create("default"),
                _Progress(names, say),
            ]
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
        verified = verify_finalists(
            tasks, tgt, database, builder, runner, say, top=verify, ours=pipeline == "tvm_fusion"
        )
    finally:  # the build processes and the runner's worker end with the run (ours only)
        if own_builder:
            builder.close()
        if own_runner:
            runner.pool.shutdown()  # LocalRunner's and RPCRunner's
    if verified:
        database = ms.database.JSONDatabase(work_dir=str(work_dir))
    after = trials_spent(work_dir)
    best, wrong = {}, []
    for t in tasks:
        top = top_records(database, t.dispatched[0], 1)
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
        verified,
    )
