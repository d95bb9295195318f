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
- after the search, the fastest records and our default are measured again (3 rounds, fresh
  arguments; :func:`verify_finalists`) and the database keeps those medians: MetaSchedule's
  single measurements keep lucky records (``verify=0`` skips this);
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

from ...errors import UsageError, first_line
from ...target import async_copy, is_cpu, num_cores, parse_target

logger = logging.getLogger(__name__)


def _is_workload(entry) -> bool:
    """A line of ``database_workload.json``: ``[structural hash, base64 of the IRModule]``."""
    return isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)


def _is_record(entry) -> bool:
    """A line of ``database_tuning_record.json``:
    ``[workload index, [trace, run seconds, target, argument info]]``."""
    return (
        isinstance(entry, list)
        and len(entry) == 2
        and isinstance(entry[0], int)
        and isinstance(entry[1], list)
        and len(entry[1]) == 4
    )


def open_database(work_dir: str | Path) -> ms.database.JSONDatabase:
    """The JSON database in ``work_dir`` (its missing files are created empty). Files that are
    not one (garbage, another program's JSON, a line cut short) raise a UsageError naming the
    file and line; MetaSchedule's own errors are C++ checks with a stack trace."""
    import json

    work_dir = Path(work_dir)
    if not work_dir.is_dir():
        raise UsageError(f"tuning database directory not found: {work_dir}")
    workloads = 0
    for name, valid in (
        ("database_workload.json", _is_workload),
        ("database_tuning_record.json", _is_record),
    ):
        path = work_dir / name
        if not path.is_file():
            continue
        with open(path, encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    raise UsageError(
                        f"tuning database {path}, line {number}: not JSON (a corrupt file, or "
                        "a line cut short by an interrupted run)"
                    ) from None
                if not valid(entry) or (valid is _is_record and not 0 <= entry[0] < workloads):
                    raise UsageError(
                        f"tuning database {path}, line {number}: not a MetaSchedule "
                        f"{'workload' if valid is _is_workload else 'tuning record'}"
                    )
                workloads += valid is _is_workload
    try:
        return ms.database.JSONDatabase(work_dir=str(work_dir))
    except Exception as err:  # noqa: BLE001 - TVM raises RuntimeError, InternalError, ...
        raise UsageError(
            f"cannot read the tuning database in {work_dir} (a damaged file?): {first_line(err)}"
        ) from None


def apply_database_pass(work_dir: str) -> tvm.transform.Pass:
    """Apply the tuned schedules recorded in ``work_dir``'s JSON database."""

    @tvm.transform.module_pass(opt_level=0, name="ApplyTuningDatabase")
    def _apply(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        database = open_database(work_dir)
        with database:
            return relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)

    return _apply


def fused_module(mod: tvm.IRModule, target, pipeline: str = "tvm_fusion", **flags) -> tvm.IRModule:
    """``mod`` lowered to one unscheduled PrimFunc per fused group, as ``pipeline`` groups it."""
    from ..pipeline import fused_passes, stock_fused_passes
    from ...schedule import prepare_passes

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


def check_tracker(host: str, port: int, timeout_s: float = 5.0) -> None:
    """Raise a UsageError unless an RPC tracker answers at ``host:port`` within ``timeout_s``
    (its handshake: the tracker echoes its magic number). MetaSchedule's RPC runner retries a
    refused connection every 5 s for a minute, in each of its workers, and waits without end
    on a port where something else listens."""
    import socket
    import struct

    from tvm.rpc import base

    where = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
            reply = sock.recv(4)
    except TimeoutError:
        raise UsageError(f"RPC tracker {where} did not answer within {timeout_s:g} s") from None
    except OSError as err:
        raise UsageError(f"cannot reach RPC tracker {where}: {err.strerror or err}") from None
    if len(reply) != 4 or struct.unpack("<i", reply)[0] != base.RPC_TRACKER_MAGIC:
        raise UsageError(f"{where} is not a TVM RPC tracker (it did not answer its handshake)")


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


def _records(database: ms.database.JSONDatabase, mod: tvm.IRModule, limit: int) -> list:
    """The best ``limit`` measured records of ``mod`` (failed builds/runs are not recorded)."""
    if not database.has_workload(mod):
        return []
    return list(database.get_top_k(database.commit_workload(mod), limit))


def _random_array(rng, shape: list[int], dtype: str):
    """Random data for a kernel argument: normal floats, zero integers (indices: 0 is in range
    for every gather)."""
    import numpy as np

    if dtype.startswith(("float", "bfloat")):
        return rng.standard_normal(shape).astype(dtype)
    return np.zeros(shape, dtype)


def record_is_correct(record, target, rtol: float = 1e-3, atol: float = 1e-4) -> bool | None:
    """Run ``record``'s schedule and its unscheduled workload on the same random inputs and
    compare every buffer afterwards. None where that cannot be checked here (a non-CPU target,
    symbolic shapes). MetaSchedule measures speed only; a candidate that computes something
    else is still recorded, and the fastest one wins (see ``KeepLayoutFreeWeights``)."""
    import numpy as np

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
    data = [_random_array(rng, shape, dtype) for shape, dtype in shapes]
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


def _mean_secs(secs) -> float:
    return sum(float(t) for t in secs) / len(secs)


def _median(values: list[float]) -> float:
    """The middle of ``values`` (the upper one of an even count); inf when there are none."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("inf")


def _best_ms(records) -> float | None:
    times = [_mean_secs(r.run_secs) * 1e3 for r in records if r.run_secs]
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
                self.best[task_id] = min(self.best[task_id], _mean_secs(result.run_secs) * 1e3)
        best = self.best[task_id]
        done = sum(1 for t in self.trials if t)
        self.report(
            f"task {task_id + 1}/{len(self.names)} {self.names[task_id]}: "
            f"{self.trials[task_id]} trials, best "
            + (f"{best:.4f} ms" if best < float("inf") else "-")
            + f" ({done}/{len(self.names)} tasks started)"
        )


def build_candidate(mod: tvm.IRModule, target, _params=None):
    """MetaSchedule's ``default_build`` minus ``import tvm.s_tir.tensor_intrin``.

    The stock build function imports every tensor intrinsic (CUDA, ROCm, ...) first: 32 s on
    this 2-core machine, paid again by each builder process of each batch, so with the default
    30 s build timeout the first candidates of every batch time out. A candidate arrives
    scheduled, its tensorized blocks already replaced by the intrinsics' bodies, so the build
    needs none of them registered (on GPUs either).

    On GPUs: every PrimFunc gets a global symbol (TVM 0.27's CUDA codegen fails on a kernel of
    one without: "Type tirx.BufferType does not have a corresponding C Type"), and the build
    runs as the pipeline's does (``engine.compile_module``: ``cp.async`` on sm_80+).
    """
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    if is_cpu(target):
        return tvm_build(mod, target=target)
    mod = tvm.IRModule(
        {
            gv: f.with_attr("global_symbol", gv.name_hint)
            if isinstance(f, tvm.tirx.PrimFunc) and "global_symbol" not in (f.attrs or {})
            else f
            for gv, f in mod.functions_items()
        }
    )
    config = {"tirx.use_async_copy": True} if async_copy(target) else {}
    with tvm.transform.PassContext(opt_level=3, config=config), target:
        return tvm_build(mod, target=target)


PACKS_WEIGHTS = "it packs weights"
NO_RULE = "no rule of ours applies"


def _default_schedule(workload: tvm.IRModule, target) -> tuple[tvm.s_tir.Schedule | None, str]:
    """Our default schedule of a task's workload (the rules of :mod:`tvm_fusion.schedule`),
    replayed on the workload so that its trace can be a tuning record; or (None, why not).
    A schedule that packs constant weights comes with :data:`PACKS_WEIGHTS`: it can be timed
    (on packed arguments) but not recorded."""
    from tvm.s_tir.dlight.base.transform import _apply_rules

    from ...schedule import _has_preproc, default_rules

    try:
        spaces = _apply_rules(workload["main"], target, default_rules(target), tunable=False)
    except Exception as err:  # noqa: BLE001 - MetaSchedule's copy of the PrimFunc may differ
        return None, first_line(err)
    if not spaces:
        return None, NO_RULE
    try:
        replayed = tvm.s_tir.Schedule(workload)
        spaces[0].trace.apply_to_schedule(replayed, remove_postproc=False)
    except Exception as err:  # noqa: BLE001 - a trace that does not replay is not seeded
        return None, first_line(err)
    if _has_preproc(replayed.mod["main"]):
        # a packed-weight schedule: its records need the layout rewrite of the weights,
        # which MetaScheduleApplyDatabase does not replay the same way (runtime failure)
        return replayed, PACKS_WEIGHTS
    return replayed, ""


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
    from ...schedule.cuda import GateFusion
    from ...schedule.cuda.gate_fusion import GATE_ATTR

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

    _drop_unnamed_handlers()
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
        replayed, why = _default_schedule(workload, target)
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
            f"{_mean_secs(result.run_secs) * 1e3:.4f} ms"
        )
        seeded += 1
    return seeded


def verify_finalists(
    tasks,
    target,
    database,
    builder,
    runner,
    say,
    top: int = 8,
    rounds: int = 3,
    ours: bool = True,
) -> dict[str, tuple[float, float]]:
    """Measure the ``top`` fastest records of every task again, ``rounds`` times each in
    alternating order, and keep the median as their run time in ``database``; repeat with the
    next ``top`` while the fastest record is one not measured again (at most 4 passes). Records
    that were not measured again but still claim to beat the best one that was are left out.
    The JSON files are rewritten; the records as MetaSchedule measured them stay in
    ``database_tuning_record.unverified.json``.

    MetaSchedule measures each candidate once, in one allocation of its arguments, and keeps
    the fastest: on a shared machine, the candidate measured in a fast phase or with its weight
    in a lucky place in memory (a weight laid out as 3 gate planes 4 MB apart: 2.4 ms in the
    search, 3.2-4.5 ms in three later processes here). Returns ``{task name: (best ms as
    MetaSchedule measured it, best ms measured again)}`` for the tasks re-measured. ``ours``:
    our default schedules take part (False for stock's groups, tuned for comparisons)."""
    import shutil

    if top < 1 or rounds < 1:
        return {}
    device = "cpu" if is_cpu(target) else target.kind.name
    summary = {}
    new_secs: dict[tuple, float] = {}
    dropped: set[tuple] = set()
    for task in tasks:
        records, key_of, seen = [], {}, set()
        for r in _records(database, task.dispatched[0], 1 << 30):
            key = _record_key(r)  # one schedule recorded twice (a resumed run) is timed once
            if r.run_secs and key not in seen:
                records.append(r)
                key_of[id(r)] = key
                seen.add(key)
        if not records:
            continue
        claimed = {id(r): _mean_secs(r.run_secs) for r in records}
        verified: dict[int, float] = {}

        def current(r, claimed=claimed, verified=verified) -> float:
            return verified.get(id(r), claimed[id(r)])

        # our default schedule (seeded before the search) is always a finalist: the search
        # often measured it slower than it is, and it is what the untuned pipeline runs
        default, why = _default_schedule(task.dispatched[0], target) if ours else (None, "")
        default_json = str(default.trace.as_json()) if default is not None else None
        seed = [r for r in records if str(r.trace.as_json()) == default_json][:1]
        first = list(seed)
        here = is_cpu(target) and isinstance(runner, ms.runner.LocalRunner)
        # A default that packs its weights cannot be a record (see _default_schedule); it is
        # timed beside the first finalists, and where it wins the task keeps no records, so
        # that the pipeline schedules it (the search may never reach a packed layout).
        packed = default if why == PACKS_WEIGHTS and here else None
        packed_secs = float("inf")
        for _ in range(4):
            ranked = sorted(records, key=current)
            if id(ranked[0]) in verified:
                break
            finalists = [r for r in ranked if id(r) not in verified][:top]
            chosen = {id(r) for r in finalists}
            finalists += [r for r in first if id(r) not in verified and id(r) not in chosen]
            first = []
            mods = []
            for r in finalists:
                sch = tvm.s_tir.Schedule(r.workload.mod)
                r.trace.apply_to_schedule(sch, remove_postproc=False)
                mods.append(sch.mod)
            if packed is not None:
                mods.append(packed.mod)
            built = builder.build([ms.builder.BuilderInput(m, target) for m in mods])
            runnable = [
                (r, b)
                for r, b in zip(finalists, built[: len(finalists)], strict=True)
                if not b.error_msg
            ]
            samples: dict[int, list[float]] = {id(r): [] for r in finalists}
            if here:
                cands = [(b.artifact_path, r.args_info) for r, b in runnable]
                if packed is not None and not built[-1].error_msg:
                    info = ms.arg_info.ArgInfo.from_entry_func(packed.mod, remove_preproc=True)
                    cands.append((built[-1].artifact_path, info))
                times = _time_here(cands, rounds)
                for (r, _b), secs in zip(runnable, times[: len(runnable)], strict=True):
                    samples[id(r)] = secs
                if len(times) > len(runnable):
                    packed_secs = _median(times[-1])
                packed = None
            else:
                for _round in range(rounds):
                    inputs = [
                        ms.runner.RunnerInput(b.artifact_path, device, r.args_info)
                        for r, b in runnable
                    ]
                    for (r, _b), future in zip(runnable, runner.run(inputs), strict=True):
                        result = future.result()
                        if result.run_secs and not result.error_msg:
                            samples[id(r)].append(_mean_secs(result.run_secs))
            for b in built:
                if b.artifact_path:
                    shutil.rmtree(Path(b.artifact_path).parent, ignore_errors=True)
            for r in finalists:
                # a record that no longer builds or runs drops to the end (inf)
                verified[id(r)] = _median(samples[id(r)])
        best = min(verified.values())
        unconfirmed = [r for r in records if id(r) not in verified and claimed[id(r)] < best]
        say(
            f"{task.task_name}: {len(verified)} fastest record(s) measured again {rounds}x: "
            f"best {best * 1e3:.4f} ms (in the search: {min(claimed.values()) * 1e3:.4f} ms)"
            + (f"; ours untuned {verified[id(seed[0])] * 1e3:.4f} ms" if seed else "")
            + (f"; {len(unconfirmed)} unconfirmed faster one(s) left out" if unconfirmed else "")
        )
        summary[task.task_name] = (min(claimed.values()) * 1e3, min(best, packed_secs) * 1e3)
        new_secs.update({key_of[id(r)]: verified[id(r)] for r in records if id(r) in verified})
        dropped.update(key_of[id(r)] for r in unconfirmed)
        if packed_secs < best:
            say(
                f"{task.task_name}: our default schedule (packed weights) {packed_secs * 1e3:.4f}"
                " ms beats every record: they are left out, the pipeline schedules the task"
            )
            dropped.update(key_of.values())
    if new_secs or dropped:
        _rewrite_database(database, new_secs, dropped, say)
    return summary


def _time_here(candidates: list[tuple[str, list]], rounds: int) -> list[list[float]]:
    """Seconds per call of each built candidate ``(artifact path, args info)``, once per round
    in alternating order, in this process, each time on arguments freshly allocated while the
    earlier ones are still held: MetaSchedule's runner process frees its arguments after each
    run and gets the same memory back for the next, so a layout whose speed depends on where
    its weight lands (cache-set conflicts between planes of a blocked weight) is measured in
    one place only. Candidates are all records that already ran in the search."""
    import numpy as np

    device = tvm.cpu()
    rng = np.random.default_rng(0)
    modules = [tvm.runtime.load_module(path) for path, _ in candidates]
    held, times = [], [[] for _ in candidates]
    for _round in range(rounds):
        for i, (mod, (_path, infos)) in enumerate(zip(modules, candidates, strict=True)):
            args = [
                tvm.runtime.tensor(
                    _random_array(rng, [int(d) for d in info.shape], str(info.dtype)), device
                )
                for info in infos
            ]
            held.append(args)
            evaluator = mod.time_evaluator(mod.entry_name, device, number=3, min_repeat_ms=100)
            times[i].append(float(np.median(evaluator(*args).results)))
    return times


def _record_key(record) -> tuple:
    from tvm_ffi import structural_hash

    return (structural_hash(record.workload.mod), str(record.trace.as_json()))


def _rewrite_database(
    database: ms.database.JSONDatabase, new_secs: dict, dropped: set, say
) -> None:
    """Write the records of ``database`` back to its JSON files, with the run time of those in
    ``new_secs`` (by :func:`_record_key`) replaced and those in ``dropped`` left out, keeping
    the file before as ``database_tuning_record.unverified.json``. Open the database again to
    read them."""
    import shutil
    import tempfile

    records_path = Path(database.path_tuning_record)
    workload_path = Path(database.path_workload)
    records = list(database.get_all_tuning_records())
    with tempfile.TemporaryDirectory() as tmp:
        fresh = ms.database.JSONDatabase(work_dir=tmp)
        for r in records:
            key = _record_key(r)
            if key in dropped:
                continue
            secs = new_secs.get(key)
            fresh.commit_tuning_record(
                ms.database.TuningRecord(
                    r.trace,
                    fresh.commit_workload(r.workload.mod),
                    r.run_secs if secs is None else [tvm.tirx.FloatImm("float64", secs)],
                    r.target,
                    r.args_info,
                )
            )
        backup = records_path.with_name("database_tuning_record.unverified.json")
        if not backup.exists():
            shutil.copyfile(records_path, backup)
        shutil.copyfile(fresh.path_tuning_record, records_path)
        shutil.copyfile(fresh.path_workload, workload_path)
    say(f"rewrote {records_path} with the re-measured times")


def _drop_unnamed_handlers() -> None:
    """MetaSchedule rebuilds its logging config from the names of the handlers its logger
    holds; an unnamed one (pytest's capture handler, a user's ``addHandler``) makes a second
    tuning run in one process fail with "'NoneType' object has no attribute 'format'"."""
    ms_logger = logging.getLogger("tvm.s_tir.meta_schedule")
    for handler in list(ms_logger.handlers):
        if handler.get_name() is None:
            ms_logger.removeHandler(handler)


def dry_run(mod, target, per_task, build_timeout, seed, say, pipeline="tvm_fusion", **flags):
    """Tuning up to the builder, for a target with no device here: the first ``per_task``
    candidates of every task generated as :func:`tune` would, and built. Returns a summary
    ("N of M candidates of T task(s) built")."""
    import shutil
    import tempfile

    fused = fused_module(mod, target, pipeline, **flags)
    tasks = ms.relax_integration.extract_tasks(fused, target)
    if not tasks:
        raise UsageError("nothing to tune: the module has no kernels")
    _drop_unnamed_handlers()
    with tempfile.TemporaryDirectory() as work:
        strategy = ms.search_strategy.EvolutionarySearch(population_size=32)
        contexts, _ = tune_contexts(tasks, target, work, strategy, num_cores(target), seed)
        candidates = sample_candidates(contexts, per_task)
    inputs = [
        ms.builder.BuilderInput(sch.mod, target) for schs in candidates.values() for sch in schs
    ]
    builder = ms.builder.LocalBuilder(timeout_sec=build_timeout, f_build=build_candidate)
    results = builder.build(inputs) if inputs else []
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
    **flags,
) -> TuneReport:
    """Tune the fused groups of ``mod`` for ``target`` with at most ``trials`` measurements in
    all (counting those already in ``work_dir``), then measure the ``verify`` best records of
    each task again (:func:`verify_finalists`; 0: keep MetaSchedule's single measurements).
    See the module docstring."""
    if trials < 1:
        raise UsageError(f"trials must be positive, got {trials}")
    if trials_per_iter < 1:
        raise UsageError(f"trials per iteration must be positive, got {trials_per_iter}")
    if verify < 0:
        raise UsageError(f"verify must be 0 or more, got {verify}")
    tracker = parse_tracker(rpc) if rpc else None
    if tracker and not rpc_key:
        raise UsageError("--rpc-tracker needs --rpc-key")
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
    fused = fused_module(mod, tgt, pipeline, **flags)
    tasks = ms.relax_integration.extract_tasks(fused, tgt)
    if not tasks:
        raise UsageError("nothing to tune: the module has no kernels")
    names = [t.task_name for t in tasks]
    before = trials_spent(work_dir)
    start = time.perf_counter()
    remaining = trials - before
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
    if remaining > 0:
        say(f"tuning {len(tasks)} task(s), {remaining} trial(s) ({before} already recorded)")
        # The stock population (512 candidates, 50 unmeasured to start) costs minutes of
        # search per iteration on a small machine; a small budget gets a smaller population.
        _drop_unnamed_handlers()
        population = max(32, min(512, 4 * trials))
        strategy = ms.search_strategy.EvolutionarySearch(
            population_size=population, init_min_unmeasured=min(50, population // 2)
        )
        contexts, weights = tune_contexts(
            tasks, tgt, work_dir, strategy, num_threads=num_cores(tgt), seed=seed
        )
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
    verified = verify_finalists(
        tasks, tgt, database, builder, runner, say, top=verify, ours=pipeline == "tvm_fusion"
    )
    if verified:
        database = ms.database.JSONDatabase(work_dir=str(work_dir))
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
        verified,
    )
