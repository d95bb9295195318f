"""Register tiles of the CPU GEMM rule (``Matmul``): how many rows (MR) and columns (NR) one
micro-kernel accumulates, sized from the target's lanes and vector registers. Pure arithmetic
on extents, so the choices can be read and tested without scheduling anything."""

from __future__ import annotations

from .._common import is_static

K_BLOCK_MIN = 1024  # shorter reductions keep a panel's whole K x NR block in L1/L2
K_WIDE_MIN = 256  # shorter reductions keep standard_tile's tile (the wide one is not measured)
A_BLOCK_BYTES = 4 << 20  # A's rows above this are read in blocks of at most this (row_block)
RUNTIME_PACK_MAX = 32 << 20  # a run-time B up to this is packed whole for row_block's blocks
# TVM 0.27's LowerTVMBuiltin keeps a CPU allocation on the stack (where LLVM holds the
# accumulator tile in registers) only under kMaxStackAlloca, 1024 bytes; a tile of 1024 bytes
# or more becomes a TVMBackendAllocWorkspace buffer, zeroed by memset and stored back every
# tile (see _common.ACC_SCOPE). That is AVX-512's 8 x 2 float32 vectors exactly: 7 x 2 instead,
# Intel AVX-512 host, 2 threads, alternating: 3136 x 64 @ 64 x 256 0.882 -> 0.568 ms,
# 784 x 128 @ 128 x 512 0.582 -> 0.426, 784 x 512 @ 512 x 128 0.539 -> 0.468.
STACK_TILE_BYTES = 1024
ACC_ITEMSIZE = 4  # bytes of an accumulator element (float32), unless a caller says otherwise


def stack_rows(row_bytes: int) -> int:
    """Most rows of ``row_bytes`` of accumulators each whose tile stays under
    ``STACK_TILE_BYTES`` (at least 1): 7 for AVX-512's 2 float32 vectors, 15 for 1."""
    return max(1, (STACK_TILE_BYTES - 1) // max(row_bytes, 1))


def padded(extent: int, tile: int) -> int:
    """``extent`` rounded up to a multiple of ``tile``."""
    return -(-extent // tile) * tile


def dividing_width(extent: int, most: int) -> int:
    """The widest tile, at most ``most``, that divides ``extent`` (20 columns, 16 lanes: 10)."""
    return next(w for w in range(min(most, extent), 0, -1) if extent % w == 0)


def unpadded_tile(
    m_ext: int, j_ext: int, nr: int, lanes: int, regs: int, gates: int, itemsize: int = ACC_ITEMSIZE
):
    """(NR, MR) for static rows that cannot be padded to ``standard_tile``'s height: MR
    divides the rows, and MR x gates x NR / lanes accumulators, one row's weight vectors
    (loaded once per ``k``) and its broadcast input fit the ``regs`` vector registers (as
    ``tile_rows`` in gate_fusion.py). ``standard_tile``'s NR, or fewer whole vectors of it that
    divide the columns where that holds more accumulators. A convolution over 7 output
    positions, 32 channels, on AVX2 (16 registers, 8 lanes): 7 rows x 1 vector (7 accumulators
    + 1 + 1), where 2 vectors left 1 row (2 accumulators: 2 FMA chains, latency-bound); over 5
    positions: 5 x 2 vectors. ``itemsize``: bytes an accumulator (float64: 8), for
    ``STACK_TILE_BYTES``."""
    best = (0, nr, 1)  # (accumulators, NR, MR)
    vecs = max(nr // lanes, 1)
    for v in range(vecs, 0, -1):
        width = v * lanes if nr >= lanes else nr
        if v < vecs and j_ext % width:
            continue
        per_row = gates * v
        # the accumulators leave a row's weights twice over and two more registers free (a
        # convolution's window addresses, LLVM's spills): 14 x 14 images at 512 channels on
        # AVX2 in tiles of 7 rows x 1 vector, where 14 rows (16 registers in all) took
        # 1.7x ONNX Runtime's time, 7 rows 1.0x (alternating in one run, load average 7.5)
        # and at most 3/4 of the file in accumulators (AVX-512, 56 rows: 8 x 2 vectors, not
        # 28 x 1)
        most = min(regs - 2 - 2 * per_row, 3 * regs // 4) // per_row
        most = min(most, stack_rows(gates * width * itemsize))
        mr = dividing_width(m_ext, max(1, most))
        best = max(best, (mr * per_row, width, mr))
    return best[1], best[2]


def wide_tile(m_ext, j_ext, k_ext, lanes, regs, n_gates) -> tuple | None:
    """(NR, MR) = (3 vectors, 4 rows) for a GEMM on AVX2, or None (keep ``standard_tile``'s).

    4 rows x 2 vectors are 8 accumulators, as many as the FMAs in flight (2 ports x 4 cycles of
    latency on Zen 3): no slack, and each ``k`` is 2 weight loads + 4 broadcasts per 8 FMAs.
    4 rows x 3 vectors is MLAS's register budget (12 accumulators + 3 weight vectors + the
    broadcast = the 16 registers). Where: a reduction of K >= ``K_WIDE_MIN``, static rows
    (16 or more) padded to a multiple of 4 when they are not one already, and a single output
    axis of static columns padded to a multiple of 3 vectors likewise (at most 1/16 of either
    padding: B's zeros join its packing, at compile time for a constant B, in the per-panel
    packing for a run-time one; a 1x1 convolution's merged rows are padded through flat
    copies). SwiGLU's
    down projection (64 x 5632 @ 5632 x 2048, constant B): 8.85-8.98 -> 8.58 ms in paired
    runs, ONNX Runtime's Gemm 8.5-8.9; a run-time B (136 x 1021 @ 1021 x 2039, single thread,
    CPU time, alternating): 1.24 -> 1.09x ONNX Runtime's; 128 x 1000 @ 1000 x 999 1.00 ->
    0.91x (Zen 3, load average 3-4). Rows not in 4s, which kept the standard tile (one vector
    for 1000 columns: 125 x 8, 12 rows): 169 x 512 @ 512 x 1000 0.62x the time, 77 x 768 @
    768 x 1000 0.63x, 49 x 2048 @ 2048 x 1000 0.88x, 170 x 512 @ 512 x 1024 (5 x 2 before)
    0.97x (single thread, CPU time, alternating, load average 5). SqueezeNet's final 1x1
    convolution 512->1000 at 13 x 13: 0.33x (2 threads, load average 4.4)."""
    if regs != 16 or n_gates != 1:
        return None
    if not (is_static(m_ext) and is_static(j_ext) and is_static(k_ext)):
        return None
    nr, mr = 3 * lanes, 4
    if k_ext < K_WIDE_MIN or m_ext < 16 or (padded(m_ext, mr) - m_ext) * 16 > m_ext:
        return None
    if (padded(j_ext, nr) - j_ext) * 16 > j_ext:
        return None
    return nr, mr


def accumulator_budget(m_ext, regs: int, n_gates: int) -> int:
    """How many vector accumulators ``standard_tile`` fills: half the registers, but on 16 of
    them (AVX2) 12 for static rows without gates, MLAS's budget (6 rows x 2 vectors + 2 weight
    vectors + the broadcast = 15 registers): 8 accumulators are just the FMAs in flight on Zen 3
    (2 ports x 4 cycles). 165 x 2914 @ 2914 x 99 in tiles of 5 x 2 vectors, not 3 x 2:
    1.20 -> 0.90x ONNX Runtime's; 258 x 509 @ 509 x 389 (6 x 2, not 3 x 2): 1.28 -> 0.98x
    (single thread, CPU time, alternating, Zen 3, load average 3-4). Symbolic rows keep 8 (they
    are padded to the tile's height: not measured)."""
    if regs == 16 and n_gates == 1 and is_static(m_ext):
        return 12
    return regs // 2


def standard_tile(
    m_ext, j_ext, lanes: int, regs: int, n_gates: int, itemsize: int = ACC_ITEMSIZE
) -> tuple[int, int]:
    """(NR, MR): NR a multiple of ``lanes`` (or a narrow axis' own width); MR rows so that
    MR * gates * NR / lanes accumulators use about half the registers. Any extent gets a
    tile: a vector axis that no tile width divides (a vocabulary of 50257, 211 columns) or
    a symbolic one (attention's ``seq`` columns) is padded to NR by the caller, and rows
    that MR does not divide (97, a prime) are padded to MR unless a divisor of them at
    least half as tall exists (129 rows: tiles of 3) or a height down to half of MR pads
    fewer rows. Padded columns take a tile of one vector where wider tiles pad far more
    (CLIP's 77 x 64 @ 64 x 77 scores: 1.32 -> 1.14x ONNX Runtime, 19 x 97 x 155 x 97
    1.30 -> 1.05x, AMD EPYC, AVX-512). The tile stays under ``STACK_TILE_BYTES`` (``itemsize``
    bytes an accumulator): AVX-512's 2 float32 vectors take 7 rows, not 8."""
    budget = accumulator_budget(m_ext, regs, n_gates)
    if not is_static(j_ext):
        vecs = 2 if n_gates * 2 <= budget else 1
        nr = vecs * lanes
    else:
        # Symbolic rows get the same tile; the caller pads their domain to a multiple of MR.
        small_m = is_static(m_ext) and m_ext <= 2
        choices = [v for v in ((4, 2, 1) if small_m else (2, 4, 1)) if n_gates * v <= budget]
        vecs = next((v for v in choices if j_ext % (v * lanes) == 0), None)
        if vecs is not None:
            nr = vecs * lanes
        else:
            # a narrow axis that half a vector divides keeps its own width (no padding);
            # anything else is padded to whole vectors, no more of them than it fills
            nr = lanes
            while nr > 1 and j_ext % nr:
                nr //= 2
            vecs = 1
            if nr < max(lanes // 2, 4) or j_ext > lanes:
                vecs = min(choices[0], -(-j_ext // lanes)) if choices else 1
                # a wider tile that pads many more columns than one vector does (77
                # columns: 96 in tiles of 2 vectors, 80 in tiles of 1) takes one vector
                if padded(j_ext, vecs * lanes) - padded(j_ext, lanes) > j_ext // 8:
                    vecs = 1
                nr = vecs * lanes
    per_row = n_gates * max(vecs, 1)
    # the accumulators, one row's weight vectors and the broadcast fit the registers
    mr = max(1, min(budget, regs - 1 - per_row) // per_row)
    mr = min(mr, stack_rows(n_gates * nr * itemsize))
    if is_static(m_ext):
        if m_ext <= mr:
            return nr, m_ext
        divisor = next(d for d in range(mr, 0, -1) if m_ext % d == 0)
        if 2 * divisor >= mr:
            mr = divisor
        else:
            # no divisor at least half as tall (97 rows, a prime): a height down to half
            # the budget that pads the fewest rows, where that saves over 1/16 of them
            # (97 rows in tiles of 1 vector: 14, 98 rows, where 16 padded to 112)
            best = min(range(mr, (mr - 1) // 2, -1), key=lambda d: padded(m_ext, d))
            if padded(m_ext, mr) - padded(m_ext, best) > m_ext // 16:
                mr = best
    return nr, mr


def k_block(k_ext, tiles, tile_bytes: int, outer_exts: list, cores: int) -> int | None:
    """KC for blocking the reduction of a packed-B GEMM (the MLAS/GotoBLAS order ``panel,
    k block, row tile, k``), or None. Only where it pays and stays small: B packed (its
    panel's KC x NR block is contiguous), a long static K (1024 or more) with a block of
    256 (else 512, 128) dividing it, several static row tiles (``tiles``) re-reading each
    block, the panel's accumulators (all its rows) within 32 KiB, and enough panels above
    (``outer_exts``) to feed the cores (the row tiles are no longer parallel). SwiGLU's down
    projection (64 x 5632 @ 5632 x 2048): 10.7 -> 10.1-10.4 ms, 9.9 -> 9.1 in another phase
    (the whole 5632 x 16 panel, 360 KiB, was re-read from L2 by each of the 16 row tiles)."""
    if not is_static(k_ext) or k_ext < K_BLOCK_MIN or not is_static(tiles) or tiles < 2:
        return None
    if tiles * tile_bytes > 32 * 1024:
        return None
    work = 1
    for ext in outer_exts:
        if not is_static(ext):
            return None
        work *= ext
    if work < cores * 8:
        return None
    return next((kc for kc in (256, 512, 128) if k_ext % kc == 0), None)


def row_block(tiles, mr: int, k_ext, itemsize: int, regs: int) -> int | None:
    """Row tiles per block of A's rows, or None (all of them under each B panel). The GEMM's
    loops are ``panel, row tile, k``: every panel reads all of A again, from L3 or memory
    once A outgrows the caches; in blocks (``row block, panel, row tile, k``, the panels still
    parallel) both cores read one block of A, at most ``A_BLOCK_BYTES``, under every panel,
    and B is read once per block. Only where A (static rows, ``tiles`` x ``mr`` of them, and
    K) exceeds ``A_BLOCK_BYTES`` and a block of at least a quarter of that divides the tiles
    (no tail: 1021 rows in 171 tiles of 6, blocks of 57); only on 16 vector registers (AVX2,
    where it was measured). Zen 3, constant B, share of the FMA peak, best of 6 alternating
    rounds: 2048^3 one thread 77.9 -> 88.9%, two threads 84.8% either way (median time
    0.88x); 4096 x 1024 @ 1024 x 1024 81.3 -> 90.9%, two threads 68.1 -> 81.2%; 1536^3
    two threads 76.1 -> 90.1% (load average 2-3); 1024^3 (A 4 MiB, one block): 92%."""
    if regs != 16 or not (is_static(tiles) and is_static(k_ext)):
        return None
    tile_a = mr * k_ext * itemsize  # one row tile's rows of A
    if tiles * tile_a <= A_BLOCK_BYTES:
        return None
    most = A_BLOCK_BYTES // tile_a
    block = next(d for d in range(min(most, tiles), 0, -1) if tiles % d == 0)
    return block if 4 * block >= most and block < tiles else None


def compact_pays(m_ext: int, width: int, j_ext: int, k_ext: int, lanes: int, regs: int) -> bool:
    """Whether a strided 1x1 convolution's rows, merged (``m_ext`` of them, through a compact
    copy of its input: ``_conv.compact_strided``), get a tile of more accumulators than its
    output rows of ``width`` alone (``unpadded_tile``). ResNet-50's 1024->2048 at 14 x 14 ->
    7 x 7 on AVX2: 4 x 3 vectors merged, 7 x 1 apart (0.67x the time with the copy); its
    256->128 at 56 x 56 -> 28 x 28: 4 x 2 vectors either way, the copy alone (1.24x)."""
    nr, mr = wide_tile(m_ext, j_ext, k_ext, lanes, regs, 1) or standard_tile(
        m_ext, j_ext, lanes, regs, 1
    )
    nr_u, mr_u = unpadded_tile(
        width, j_ext, standard_tile(width, j_ext, lanes, regs, 1)[0], lanes, regs, 1
    )
    return mr * nr > mr_u * nr_u
