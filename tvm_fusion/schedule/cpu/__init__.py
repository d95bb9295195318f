"""Schedule rules for llvm targets, one per file, in the order the pipeline tries them."""

from .fallback import Fallback
from .injective import Injective
from .matmul import Matmul
from .reduction import RowReduction

__all__ = ["Fallback", "Injective", "Matmul", "RowReduction"]
