"""What a compiled (or partly compiled) module does: kernels, fused groups, schedules, shape
work, memory, and the fusion report; public as ``tvm_fusion.analysis``.

``kernel_count(mod)`` works at every stage of the pipeline: before fusion it counts ops that will
become kernels, after FuseOps it counts fused groups, after FuseTIR and VM lowering it counts
PrimFunc and extern calls (``kernels``). ``schedule_info`` / ``fallback_kernels`` say how each
kernel of a lowered module is scheduled and by which rule (``schedules``); ``shape_work`` counts
shape-only kernels and host copies (``shapes``); ``peak_bytes`` / ``allocations`` read memory
planning (``memory``); ``fusion_report(mod, target)`` lists stock's groups and ours side by side
with our rewrites, and ``to_dot`` draws the fused graph (``report``).
"""

from .kernels import Kernel, kernel_count, kernels, view_count
from .memory import Allocation, allocations, peak_bytes
from .report import FusionReport, fusion_report, grouped, to_dot
from .schedules import ScheduleInfo, fallback_kernels, schedule_info
from .shapes import ShapeWork, shape_work

__all__ = [
    "Allocation",
    "FusionReport",
    "Kernel",
    "ScheduleInfo",
    "ShapeWork",
    "allocations",
    "fallback_kernels",
    "fusion_report",
    "grouped",
    "kernel_count",
    "kernels",
    "peak_bytes",
    "schedule_info",
    "shape_work",
    "to_dot",
    "view_count",
]
