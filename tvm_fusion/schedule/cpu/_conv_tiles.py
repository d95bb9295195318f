"""Register tiles and reduction blocks of the CPU GEMM rule's window convolutions (``Matmul``,
a k x k window: kh or kw > 1). The tile's rows are the output width, which is never padded
(``pad_einsum`` refuses the window's reads), so the height must divide it: a width with no
divisor near the register budget (13, a prime) left ``unpadded_tile`` one row x 2 vectors on
AVX2, 2 accumulators. The tile and the channel blocks are pure arithmetic on extents, as in
``_tiles.py``; ``block_channels`` applies the blocks to a schedule."""

from __future__ import annotations

from .._common import extent, is_static
from ._tiles import ACC_ITEMSIZE, STACK_TILE_BYTES, unpadded_tile

FMA_IN_FLIGHT = 8  # accumulators that keep the FMAs busy: 2 ports x 4 cycles (Zen 3, Skylake-X)
WEIGHT_BLOCK_BYTES = 16 * 1024  # a channel block's weights (cb x kh x kw x NR), read from L1


def _divisors(n: int, most: int) -> list[int]:
    return [d for d in range(1, min(n, most) + 1) if n % d == 0]


def window_tile(
    m_ext, j_ext, nr: int, lanes: int, regs: int, gates: int, itemsize: int = ACC_ITEMSIZE
) -> tuple[int, int]:
    """(NR, MR) of a window convolution's register tile over static output widths ``m_ext``:
    MR rows that divide the width x V whole vectors that divide the channels.

    ``unpadded_tile``'s (the most accumulators of at most 2 vectors) is replaced where it holds
    a quarter of the registers or fewer (13 wide, a prime: one row x 2 vectors on AVX2), and on
    16 registers where it keeps the FMAs in flight (``FMA_IN_FLIGHT``) with more loads per FMA
    than another such tile. Loads per FMA: (MR + V) / (MR x V), MR broadcasts of the input and
    V weight vectors, rounded to 0.1; the fewest among tiles of ``FMA_IN_FLIGHT`` or more, then
    more accumulators, then more rows; where none holds that many, the most accumulators. A
    tile of several rows holds a row's weight vectors in registers beside its accumulators,
    the broadcast and two more (addresses): MR x V + V + 3 <= the registers, accumulators at
    most 3/4 of them. A single row reads each weight vector once (an FMA memory operand) but
    its whole weight panel per output pixel (``channel_block``): only where the width leaves
    few accumulators. On AVX2: 13 or 17 wide, one row x 8 vectors (256 channels), 12 (192),
    13 x 1 vector at 13 wide where the vectors have no divisor from 3 to 12 (208 channels);
    26 wide, 2 x 4 (was 2 x 2); 55 wide, 5 x 2 (was 11 x 1); 27 or 9 wide at 96, 192, 384
    channels, 3 x 3 (was 9 x 1). 32 registers (AVX-512, NEON): changed where the old tile held
    8 accumulators or fewer (7 wide at 48 channels: 7 x 3 vectors, was 7 x 1; 111 = 3 x 37:
    3 x 4 vectors, was 3 x 2), not timed.

    Single thread, CPU time, alternating, Zen 3, load average 5-6: SqueezeNet's 64->256 3x3 at
    13 x 13, 24 -> 64 GFLOP/s; AlexNet's 384->256 3x3 at 13 x 13, 24 -> 61; AlexNet's 11 x 11
    stride-4 stem (55 wide), 0.66x the time; 64->192 3x3 at 27 x 27, 0.93x; 16->64 3x3 at 55,
    0.94x. Kept, measured no better: 7 x 1 vector at 7 and 14 wide (7 accumulators; one row x
    8 vectors 1.16x the time at 7, 2 x 4 vectors 0.96-1.03x at 14), 5 x 2 at 15 (3 x 3
    1.04x)."""
    nr_u, mr_u = unpadded_tile(m_ext, j_ext, nr, lanes, regs, gates, itemsize)
    if gates != 1 or not (is_static(m_ext) and is_static(j_ext)) or j_ext % lanes:
        return nr_u, mr_u
    held = mr_u * -(-nr_u // lanes)
    few = 4 * held <= regs
    if not few and (regs != 16 or held < FMA_IN_FLIGHT):
        return nr_u, mr_u
    most = 3 * regs // 4
    tiles = []  # (accumulators, loads per FMA, MR, V)
    for mr in _divisors(m_ext, most):
        if mr == 1 and not few:
            continue
        for v in _divisors(j_ext // lanes, most // mr):
            if mr * v * lanes * itemsize >= STACK_TILE_BYTES:
                continue  # a workspace, not registers (_tiles.STACK_TILE_BYTES)
            if mr * v + (v + 3 if mr > 1 else 3) <= regs:
                tiles.append((mr * v, round((mr + v) / (mr * v), 1), mr, v))
    if not tiles:
        return nr_u, mr_u
    in_flight = [t for t in tiles if t[0] >= FMA_IN_FLIGHT]
    if in_flight:
        _, _, mr, v = min(in_flight, key=lambda t: (t[1], -t[0], -t[2]))
    else:
        _, _, mr, v = max(tiles, key=lambda t: (t[0], -t[1], t[2]))
        # else, on 16 registers, a tile of one vector one row under them (13 x 1: 13
        # accumulators, the weight, the broadcast, one to spare): 96->208 3x3 at 13 x 13 (26
        # vectors: no divisor of them from 3 to 12), 0.38-0.49x the time of one row x 2 vectors
        tall = max(_divisors(m_ext, regs - 3)) if regs == 16 else 0
        if mr * v < tall:
            mr, v = tall, 1
        if mr * v < held:
            return nr_u, mr_u
    return v * lanes, mr


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
