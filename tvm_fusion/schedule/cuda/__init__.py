"""Schedule rules for CUDA targets, one per file, tried before dlight's GPU defaults."""

from .gate_fusion import GateFusion
from .skinny_matmul import SkinnyMatmul

__all__ = ["GateFusion", "SkinnyMatmul"]
