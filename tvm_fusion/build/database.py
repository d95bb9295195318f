"""The JSON database of a tuning work dir: opened with one-line errors, applied as a pass,
read (best records, trials spent) and rewritten.

A MetaSchedule work dir holds ``database_workload.json`` (one ``[structural hash, base64 of the
IRModule]`` per line) and ``database_tuning_record.json`` (one ``[workload index, [trace, run
seconds, target, argument info]]`` per line), and ``logs/`` with a log per task.
:func:`apply_database_pass` is what ``build_pipeline(tuning_db=...)`` and
``stock_pipeline(target, tuning_db)`` run before the default schedules; the rest serves
:mod:`tvm_fusion.build.tuning`. Here, below both, so that the pipeline and the tuner share it
without importing each other.
"""

from __future__ import annotations

from pathlib import Path

import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms

from ..errors import UsageError, first_line


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


def top_records(database: ms.database.JSONDatabase, mod: tvm.IRModule, limit: int) -> list:
    """The best ``limit`` measured records of ``mod`` (failed builds/runs are not recorded)."""
    if not database.has_workload(mod):
        return []
    return list(database.get_top_k(database.commit_workload(mod), limit))


def trials_spent(work_dir: str | Path) -> int:
    """Trials spent so far, failed ones included: MetaSchedule's per-task logs count them."""
    total = 0
    for log in (Path(work_dir) / "logs").glob("*task_*.log"):
        total += sum(
            1 for line in log.read_text(errors="replace").splitlines() if "] Trial #" in line
        )
    return total


def mean_secs(secs) -> float:
    return sum(float(t) for t in secs) / len(secs)


def record_key(record) -> tuple:
    from tvm_ffi import structural_hash

    return (structural_hash(record.workload.mod), str(record.trace.as_json()))


def rewrite_database(database: ms.database.JSONDatabase, new_secs: dict, dropped: set, say) -> None:
    """Write the records of ``database`` back to its JSON files, with the run time of those in
    ``new_secs`` (by :func:`record_key`) replaced and those in ``dropped`` left out, keeping
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
            key = record_key(r)
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
