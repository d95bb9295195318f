"""Graph passes of tvm-fusion, one per file; file name = class name in snake_case.

``GRAPH_PASSES`` run on Relax ops before LegalizeOps (Phase 1 of the pipeline);
``POST_FUSION_PASSES`` run after FuseOps/FuseTIR (Phase 3). Each entry is
``(keyword flag, pass class)``; the pipeline builds them with the target.
"""

from __future__ import annotations

from ._common import collect_rewrites

GRAPH_PASSES: list[tuple[str, type]] = []
POST_FUSION_PASSES: list[tuple[str, type]] = []

__all__ = ["GRAPH_PASSES", "POST_FUSION_PASSES", "collect_rewrites"]
