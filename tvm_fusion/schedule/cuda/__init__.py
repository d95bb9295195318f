"""Schedule rules for CUDA targets, one per file, tried before dlight's GPU defaults."""

from .gate_fusion import GateFusion
from .half_tensor_core import HalfTensorCore
from .skinny_matmul import SkinnyMatmul

__all__ = ["GateFusion", "HalfTensorCore", "SkinnyMatmul"]
