"""CUDA-core schedules of float16 / bfloat16 gate kernels, sized for 2-byte elements (issue #26,
items 1 and 4), checked without a GPU: the tiles count shared-memory stages in bytes (64-step
``K`` slabs of halves, half the bytes of the same float32 tile), take unit blocks of whole 16-byte
vectors, stay within the register, thread and 48 KB budgets and give >= 132 blocks at the
benchmark sizes.
"""

from __future__ import annotations

import pytest
from helpers import assert_gate_tile_fits

from tvm_fusion.schedule.cuda.gate_fusion import SMS, _smem_bytes, blocks, choose_tile


@pytest.mark.parametrize(
    "rows, units, gemm_gates, k", [(64, 1024, [3], 1024), (64, 5632, [2], 2048), (19, 48, [2], 128)]
)
def test_half_tiles_fit_the_budgets(rows, units, gemm_gates, k):
    tile = choose_tile(rows, units, 32 if units % 32 == 0 else 16, gemm_gates, k, elem=2)
    assert tile.bk == 64 and tile.bn % 8 == 0, tile  # 128-byte rows of x, 16-byte vectors
    assert_gate_tile_fits(tile, gemm_gates, elem=2)
    assert _smem_bytes(tile, gemm_gates, 2) == _smem_bytes(tile, gemm_gates) // 2
    if rows * units >= SMS * 32 * 8:
        assert blocks(tile, rows, units) >= SMS, tile
