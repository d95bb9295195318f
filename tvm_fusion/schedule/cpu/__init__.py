"""Schedule rules for llvm targets, one per file, in the order the pipeline tries them."""

from .fallback import Fallback
from .gate_fusion import GateFusion
from .grouped import GroupedConv
from .injective import Injective
from .matmul import Matmul
from .reduction import RowReduction
from .window import WindowReduction

__all__ = [
    "Fallback",
    "GateFusion",
    "GroupedConv",
    "Injective",
    "Matmul",
    "RowReduction",
    "WindowReduction",
]
