"""A fuzzing session: :func:`fuzz` runs cases round-robin over a frontend's families in one
:class:`~.worker.Worker`, saves the failures and counts the outcomes (:class:`Totals`). The
frontends table (:data:`FRONTENDS`, :func:`frontend_module`) sits here, above both fuzzers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from . import onnx_frontend
from .common import FAILING, OUTCOMES
from .worker import Worker


@dataclasses.dataclass
class Totals:
    counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    failures: list[dict] = dataclasses.field(default_factory=list)
    refusals: list[dict] = dataclasses.field(default_factory=list)

    def add(self, family: str, outcome: str) -> None:
        row = self.counts.setdefault(family, dict.fromkeys(OUTCOMES, 0))
        row[outcome] += 1


FRONTENDS = ("onnx", "torch")


def frontend_module(frontend: str):
    """The module that generates and runs the cases of ``frontend``:
    :mod:`tvm_fusion.testing.fuzz.onnx_frontend` for ONNX,
    :mod:`tvm_fusion.testing.fuzz.torch_frontend` for torch.export. Each has ``FAMILIES``,
    ``generate``, ``RUNNER`` / ``LOADER`` / ``save_case`` (the worker's side) and
    ``save_failure``."""
    if frontend == "onnx":
        return onnx_frontend
    if frontend == "torch":
        from . import torch_frontend

        return torch_frontend
    raise ValueError(f"unknown frontend {frontend!r}; known: {', '.join(FRONTENDS)}")


def fuzz(
    families=None,
    seed: int = 0,
    minutes: float | None = None,
    cases: int | None = None,
    out_dir: Path | None = None,
    timeout_s: float = 120.0,
    minimise_s: float = 120.0,
    log: Callable[[str], None] = lambda _m: None,
    progress: Callable[[Totals], None] = lambda _t: None,
    frontend: str = "onnx",
) -> Totals:
    """Cases ``seed, seed + 1, ...`` round-robin over ``families`` (default: all of
    ``frontend``'s) until ``minutes`` or ``cases`` run out; failures saved into ``out_dir``
    (``FAMILY-SEED/``; ONNX cases minimised first)."""
    front = frontend_module(frontend)
    families = tuple(families or front.FAMILIES)
    totals = Totals()
    deadline = time.monotonic() + minutes * 60 if minutes else None
    worker = Worker(timeout_s, runner=front.RUNNER, loader=front.LOADER, save=front.save_case)
    i = 0
    try:
        while True:
            if cases is not None and i >= cases * len(families):
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            family, case_seed = families[i % len(families)], seed + i // len(families)
            i += 1
            case = front.generate(family, case_seed)
            outcome, reason = worker.run(*case.args)
            totals.add(family, outcome)
            entry = {"case": case.name, "note": case.note, "reason": reason}
            if outcome == "refused":
                totals.refusals.append(entry)
            if outcome in FAILING:
                log(f"{outcome}: {case.name} ({case.note}): {reason}")
                if out_dir is not None:
                    entry.update(
                        front.save_failure(
                            out_dir / case.name, case, outcome, reason, worker, minimise_s
                        )
                    )
                entry["outcome"] = outcome
                totals.failures.append(entry)
            progress(totals)
    finally:
        worker.close()
    return totals
