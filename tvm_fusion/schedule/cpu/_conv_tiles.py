"""Register tiles and reduction blocks of the CPU GEMM rule's window convolutions (``Matmul``,
a k x k window: kh or kw > 1). The tile's rows are the output width, which is never padded
(``pad_einsum`` refuses the window's reads), so the height must divide it: a width with no
divisor near the register budget (13, a prime) left ``unpadded_tile`` one row x 2 vectors on
AVX2, 2 accumulators. Pure arithmetic on extents, as ``_tiles.py``."""

from __future__ import annotations

from .._common import extent, is_static
from ._tiles import unpadded_tile

WEIGHT_BLOCK_BYTES = 16 * 1024  # a channel block's weights (cb x kh x kw x NR), read from L1


def _divisors(n: int, most: int) -> list[int]:
    return [d for d in range(1, min(n, most) + 1) if n % d == 0]


def window_tile(m_ext, j_ext, nr: int, lanes: int, regs: int, gates: int) -> tuple[int, int]:
    """(NR, MR) of a window convolution's register tile over static output widths ``m_ext``.

    ``unpadded_tile``'s, unless it holds at most a quarter of the registers in accumulators
    (a width with no divisor near its height: 13, 26, 1); then the tile of most accumulators
    among heights that divide the width and whole vectors that divide the channels, fewest
    loads per FMA (rows + vectors per rows x vectors) among equals. A tile of one row reads
    each weight vector once (an FMA memory operand): up to 3/4 of the registers in
    accumulators, the broadcast input and two more free (addresses); a taller tile holds a row's
    weight vectors too. On AVX2 (16 registers, 8 lanes), 13 x 13 images at 256 channels: one
    row x 8 vectors (8 accumulators), 192 channels: one row x 12 vectors, 26 wide: 2 rows x 4
    vectors. Such a tile streams its whole weight panel per output row tile: see
    ``channel_block``. SqueezeNet's 64->256 3x3 at 13 x 13: 25 -> 69-73 GFLOP/s, 48->192
    25 -> 70 GFLOP/s, AlexNet's 256->256 25 -> 69 (single thread, CPU time, Zen 3, load
    average 5-6; with ``channel_block``'s blocks of 4-8 channels)."""
    nr_u, mr_u = unpadded_tile(m_ext, j_ext, nr, lanes, regs, gates)
    if gates != 1 or not (is_static(m_ext) and is_static(j_ext)) or j_ext % lanes:
        return nr_u, mr_u
    held = mr_u * -(-nr_u // lanes)
    if 4 * held > regs:
        return nr_u, mr_u
    most = 3 * regs // 4
    best = (held, 0.0, nr_u, mr_u)
    for mr in _divisors(m_ext, most):
        for v in _divisors(j_ext // lanes, most // mr):
            acc = mr * v
            if acc + (v if mr > 1 else 0) + 3 > regs:
                continue
            best = max(best, (acc, -(mr + v) / acc, v * lanes, mr))
    return best[2], best[3]


def channel_block(channels, window: int, nr: int, itemsize: int, row_tiles) -> int | None:
    """Input channels per block of a window convolution's reduction, or None (no blocks).

    The reduction (channels, kh, kw) runs in blocks of ``cb`` channels outside the loop over
    the row's tiles, each block's weights (cb x window x NR, at most ``WEIGHT_BLOCK_BYTES``)
    read from L1 by every tile of the row, the row's accumulators kept in between (as MLAS's
    NCHWc kernel, which sweeps an output row per block of 8 input channels). Unblocked, a
    tile of one row reads its weight panel (channels x window x NR) from L2 once per output
    pixel: 64->256 3x3 at 13 x 13 in tiles of 1 x 8 vectors, 43 -> 73 GFLOP/s in blocks of 8
    channels (single thread, CPU time, Zen 3, load average 5). Only where the panel outgrows
    the block and there are several tiles in the row; ``channels`` static."""
    if not (is_static(channels) and is_static(row_tiles)) or row_tiles < 2:
        return None
    per_channel = window * nr * itemsize
    if channels * per_channel <= WEIGHT_BLOCK_BYTES:
        return None
    return max(_divisors(channels, max(1, WEIGHT_BLOCK_BYTES // per_channel)))


def block_channels(sch, io, k_loops: list, nr: int, itemsize: int):
    """Split the channel loop (``k_loops[0]``; the window's loops follow it) by
    ``channel_block`` and move its outer part above the row's tile loop ``io``. Returns that
    loop, or None where the reduction is not blocked (the schedule is unchanged)."""
    window = 1
    for loop in k_loops[1:]:
        size = extent(sch, loop)
        if not is_static(size):
            return None
        window *= size
    cb = channel_block(extent(sch, k_loops[0]), window, nr, itemsize, extent(sch, io))
    if cb is None:
        return None
    ko, ki = sch.split(k_loops[0], [None, cb])
    sch.reorder(ko, io, ki)
    return ko
