"""Stage 2, transform: Relax in, Relax out (the fusions of tvm-fusion, before and after FuseOps).

Graph passes, one per file; file name = class name in snake_case (a pass too big for one file is
a subpackage of that name). Receives the frontend's Relax IRModule; hands on the rewritten
module to lowering (``tvm_fusion.lower``) and, after FuseOps, to FuseTIR and the schedules.

``GRAPH_PASSES`` run on Relax ops before LegalizeOps (Phase 1 of the pipeline);
``POST_FUSION_PASSES`` run after FuseOps/FuseTIR (Phase 3). Each entry is
``(keyword flag, pass class)``; the pipeline builds them with the target.
"""

from __future__ import annotations

from ._common import collect_rewrites
from .channels_last import ChannelsLast
from .check_gather_bounds import CheckGatherBounds
from .choose_recurrence import ChooseRecurrence
from .fold_batch_norm import FoldBatchNorm
from .fuse_attention import FuseAttention
from .fuse_cross_entropy import FuseCrossEntropy
from .fuse_gathered_gates import FuseGatheredGates
from .fuse_grouped_gates import FuseGroupedGates
from .fuse_linear_cross_entropy import FuseLinearCrossEntropy
from .fuse_split_gates import FuseSplitGates
from .gather_to_slice import GatherToSlice
from .grouped_conv_to_gemm import GroupedConvToGemm
from .order_for_memory import OrderForMemory
from .place_shape_on_host import PlaceShapeOnHost
from .sink_views_past_epilogues import SinkViewsPastEpilogues
from .split_grouped_conv import SplitGroupedConv
from .stem_channels_last import StemChannelsLast
from .strip_bookend_views import StripBookendViews
from .winograd_conv import WinogradConv

GRAPH_PASSES: list[tuple[str, type]] = [
    ("choose_recurrence", ChooseRecurrence),  # first: the others read what it makes
    ("place_shape_on_host", PlaceShapeOnHost),
    ("fold_batch_norm", FoldBatchNorm),
    ("split_grouped_conv", SplitGroupedConv),  # after FoldBatchNorm: it folds into the group
    ("channels_last", ChannelsLast),  # after those two (plain convolutions); before the stem's
    ("stem_channels_last", StemChannelsLast),  # after FoldBatchNorm: conv + bias, a constant W
    ("winograd_conv", WinogradConv),  # after FoldBatchNorm: its weight must be a constant
    # before CheckGatherBounds: its check reads the log-probabilities' shape, a use that stops
    # the fusion; the fused kernel reads the target's column t mod V, never out of bounds
    ("fuse_cross_entropy", FuseCrossEntropy),
    ("fuse_linear_cross_entropy", FuseLinearCrossEntropy),  # chunks what the last one made
    ("check_gather_bounds", CheckGatherBounds),  # before anything rewrites a take
    ("gather_to_slice", GatherToSlice),
    ("fuse_grouped_gates", FuseGroupedGates),
    ("fuse_gathered_gates", FuseGatheredGates),  # before FuseSplitGates
    ("fuse_split_gates", FuseSplitGates),
    ("fuse_attention", FuseAttention),
    ("sink_views_past_epilogues", SinkViewsPastEpilogues),
    ("grouped_conv_to_gemm", GroupedConvToGemm),  # after BatchNorm folding: its bias
]
POST_FUSION_PASSES: list[tuple[str, type]] = [
    ("strip_bookend_views", StripBookendViews),
    ("order_for_memory", OrderForMemory),
]

__all__ = [
    "ChannelsLast",
    "CheckGatherBounds",
    "ChooseRecurrence",
    "GRAPH_PASSES",
    "FoldBatchNorm",
    "FuseAttention",
    "FuseCrossEntropy",
    "FuseGatheredGates",
    "FuseGroupedGates",
    "FuseLinearCrossEntropy",
    "FuseSplitGates",
    "POST_FUSION_PASSES",
    "GatherToSlice",
    "GroupedConvToGemm",
    "OrderForMemory",
    "PlaceShapeOnHost",
    "SinkViewsPastEpilogues",
    "SplitGroupedConv",
    "StemChannelsLast",
    "StripBookendViews",
    "WinogradConv",
    "collect_rewrites",
]
