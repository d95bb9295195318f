"""The ONNX fuzzer as :func:`.session.frontend_module` hands it out: ``FAMILIES``, ``generate``
(a :class:`Case` of a family and a seed, checked by ``onnx.checker``), the worker's ``RUNNER``
/ ``LOADER`` / ``save_case`` (:mod:`.onnx_run`) and ``save_failure`` (minimised by
:mod:`.onnx_minimise`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from . import onnx_convnets, onnx_families
from .common import FAMILIES as SHARED
from .common import draw, family_builders
from .onnx_minimise import minimise
from .onnx_run import save_case

RUNNER = "tvm_fusion.testing.fuzz.onnx_run:run_case"
LOADER = "tvm_fusion.testing.fuzz.onnx_run:load_case"


@dataclasses.dataclass
class Case:
    """One generated graph: the model, two feeds at different dynamic sizes, what it tests."""

    family: str
    seed: int
    model: object  # onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]
    note: str = ""

    @property
    def name(self) -> str:
        return f"{self.family}-{self.seed}"

    @property
    def args(self) -> tuple:
        """What :meth:`Worker.run` takes for this case."""
        return (self.model, self.feeds)


# the six kinds both sides share, and random CNNs (ONNX only)
FAMILIES = (*SHARED, "convnets")
_BUILDERS = family_builders({**vars(onnx_families), **vars(onnx_convnets)}, FAMILIES)


def generate(family: str, seed: int) -> Case:
    """The case of ``family`` for ``seed``: deterministic; redraws until the graph is valid."""
    import onnx

    model, feeds, note = draw(_BUILDERS, family, seed)
    onnx.checker.check_model(model, full_check=True)
    return Case(family, seed, model, feeds, note)


def save_failure(
    directory: Path, case: Case, outcome: str, reason: str, worker, minimise_s: float
) -> dict:
    """Minimise a failing ONNX case and save it under ``directory``; what the report adds."""
    model, feeds, why = minimise(case.model, case.feeds, outcome, worker.run, minimise_s)
    save_case(directory, model, feeds, f"{outcome}: {why or reason}")
    return {"minimised_reason": why or reason, "nodes": len(model.graph.node)}
