"""Schedule rules for CUDA targets, one per file, tried before dlight's GPU defaults."""

from .gate_fusion import GateFusion

__all__ = ["GateFusion"]
