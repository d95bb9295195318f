"""Differential fuzzer: random ONNX graphs of the patterns our passes rewrite, ours vs ORT; and
random ``torch.nn`` modules through ``torch.export``, ours vs torch eager.

Each ONNX case is a small ONNX model built with :mod:`onnx.helper` (as
:mod:`tvm_fusion.tools.sweep` builds its models) from a family and a seed, checked with
``onnx.checker`` and run by ONNX Runtime (CPU) on two feeds whose dynamic dims differ (both
other than any size the graph names). The worker imports it with :func:`tvm_fusion.load_onnx`,
compiles it with the ``tvm_fusion`` pipeline for :func:`tvm_fusion.host_target`, runs both
feeds and compares with ORT (floats within ``RTOL`` / ``ATOL`` times the output's scale,
integers exactly, shapes and dtypes equal).

Outcomes (:data:`OUTCOMES`): ``ok``; ``discarded`` (ORT itself failed: not counted as run);
``refused`` (a one-line ModelError / UsageError from us where stock TVM's importer and
pipeline fail too); ``failure`` (wrong numbers or shapes, another exception, a refusal of what
stock runs), ``crash`` (the worker died) and ``hang`` (past the per-case timeout). Cases run
in a worker subprocess that handles many of them (TVM is imported once); when it dies or
hangs the case is recorded and a new worker starts. :func:`minimise` shrinks a failing case
(outputs dropped, nodes bypassed, then the feeds' dynamic dims cut) while it keeps failing
the same way.

``python scripts/fuzz.py --minutes N`` runs it and writes ``bench/fuzz.md`` / ``.json``;
``--frontend torch`` runs the torch.export side (:mod:`.torch_frontend`).

Modules, bottom up (each imports only those above it in this list):

- :mod:`.common`: what both sides share: ``OUTCOMES``, ``SIZES``, the families' kinds,
  :class:`InvalidCase`, :func:`draw`, :func:`compare`, compiling and running a module.
- :mod:`.onnx_graph`, :mod:`.onnx_families`: the ONNX graph builder and the ONNX families.
- :mod:`.onnx_run`: one ONNX case in the worker (ORT, ours, stock TVM) and its files.
- :mod:`.onnx_minimise`: shrinking a failing ONNX case.
- :mod:`.onnx_frontend`: the ONNX side as a frontend (``generate``, ``RUNNER`` ...).
- :mod:`.torch_spec`, :mod:`.torch_families`, :mod:`.torch_dtypes`: the torch.export
  families; :mod:`.torch_frontend`: the torch side as a frontend.
- :mod:`.worker`: the worker subprocess (:class:`Worker`).
- :mod:`.session`: :func:`fuzz` and the frontends table (``FRONTENDS``,
  :func:`frontend_module`).

This package's names are the ONNX side's and the session's, as scripts and tests use them.
"""

from .common import (
    ATOL,
    FAILING,
    OUTCOMES,
    RTOL,
    SIZES,
    InvalidCase,
    compare,
    draw,
    family_builders,
)
from .onnx_frontend import FAMILIES, LOADER, RUNNER, Case, generate, save_failure
from .onnx_minimise import minimise
from .onnx_run import load_case, ort_outputs, run_case, save_case
from .session import FRONTENDS, Totals, frontend_module, fuzz
from .worker import Worker

__all__ = [
    "ATOL",
    "FAILING",
    "FAMILIES",
    "FRONTENDS",
    "LOADER",
    "OUTCOMES",
    "RTOL",
    "RUNNER",
    "SIZES",
    "Case",
    "InvalidCase",
    "Totals",
    "Worker",
    "compare",
    "draw",
    "family_builders",
    "frontend_module",
    "fuzz",
    "generate",
    "load_case",
    "minimise",
    "ort_outputs",
    "run_case",
    "save_case",
    "save_failure",
]
