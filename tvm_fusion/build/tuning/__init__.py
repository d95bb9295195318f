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

Modules: ``run`` (:func:`tune`, :func:`fused_module`: the fused groups and their tasks, the
report), ``spaces`` (the tune contexts, our gate rule's space on CUDA, our defaults seeded),
``finalists`` (the best records measured again, a record's numbers checked), ``measure`` (the
candidates' build function, the RPC tracker); the database itself is
:mod:`tvm_fusion.build.database`, which the pipeline applies.
"""

from ..database import apply_database_pass, open_database, trials_spent
from .finalists import record_is_correct, verify_finalists
from .measure import build_candidate, check_tracker, parse_tracker
from .run import TuneReport, dry_run, fused_module, tune
from .spaces import (
    NO_RULE,
    PACKS_WEIGHTS,
    gate_space,
    sample_candidates,
    seed_default_schedules,
    tune_contexts,
)

__all__ = [
    "NO_RULE",
    "PACKS_WEIGHTS",
    "TuneReport",
    "apply_database_pass",
    "build_candidate",
    "check_tracker",
    "dry_run",
    "fused_module",
    "gate_space",
    "open_database",
    "parse_tracker",
    "record_is_correct",
    "sample_candidates",
    "seed_default_schedules",
    "trials_spent",
    "tune",
    "tune_contexts",
    "verify_finalists",
]
