"""The multiply-accumulate the CPU GEMM rule (``Matmul``) matches, and the two forms of a
convolution it schedules apart from a GEMM's: a window reduction (``x[c, h + ry, w + rx]``),
whose reduction loops are kept, and a 1x1 convolution's rows ``(h, w)``, merged into one."""

from __future__ import annotations

import logging

from tvm import sym, tirx
from tvm.ir.expr import TensorLoad

from ...tir_util import vars_in
from .._common import is_static
from . import _tiles

logger = logging.getLogger(__name__)


def _strip_casts(expr):
    while isinstance(expr, tirx.Cast):
        expr = expr.value
    return expr


def update_operands(store) -> list | None:
    """The loads that ``Y = Y + X * W``, ``Y = Y + X``, ``Y = max(Y, X)`` or ``min`` combine
    into ``Y`` (casts allowed), or None for another form."""
    if not isinstance(store, tirx.BufferStore):
        return None
    value = store.value
    if not isinstance(value, tirx.Add | tirx.Max | tirx.Min):
        return None
    lhs, rhs = value.a, value.b
    if isinstance(rhs, TensorLoad) and rhs.source.same_as(store.buffer):
        lhs, rhs = rhs, lhs
    if not (isinstance(lhs, TensorLoad) and lhs.source.same_as(store.buffer)):
        return None
    rhs = _strip_casts(rhs)
    if isinstance(rhs, TensorLoad):
        return [rhs]
    if isinstance(value, tirx.Add) and isinstance(rhs, tirx.Mul):
        a, b = _strip_casts(rhs.a), _strip_casts(rhs.b)
        if isinstance(a, TensorLoad) and isinstance(b, TensorLoad):
            return [a, b]
    return None


def is_mac(store) -> tuple | None:
    """``Y[idx] = Y[idx] + A * B`` (with casts): returns (A load, B load) or None."""
    operands = update_operands(store)
    return tuple(operands) if operands is not None and len(operands) == 2 else None


def is_window(block, n_red: int) -> bool:
    """Several reduction iterators of which one is read by an operand beside a spatial one
    (a convolution's ``x[n, rc, h + ry, w + rx]``): a window, whose reduction loops are kept."""
    mac = is_mac(block.body)
    if mac is None:
        return False
    ivs = [iv.var for iv in block.iter_vars]
    red, spatial = set(ivs[len(ivs) - n_red :]), set(ivs[: len(ivs) - n_red])
    for load in mac:
        for index in load.indices:
            used = vars_in(index)
            if used & red and used & spatial:
                return True
    return False


POINTWISE_KC = 256  # most input channels per reduction block of a 1x1 convolution
POINTWISE_BLOCK_BYTES = 24 * 1024  # a panel's K block: 3/4 of the smallest L1d (Zen 3/4: 32 KiB)


def pointwise_k_block(k_ext, outer_exts: list, cores: int, panel_row_bytes: int = 64):
    """Input channels per reduction block of a 1x1 convolution (merged rows, the channels as
    the vector axis), or None.

    Unblocked, every row tile of a column panel reads the panel's whole K x NR weights: Inception
    v2's 576->128 at 14 x 14 (a 576 x 16 panel, 36 KiB) streams them from L2 for each of its 49
    tiles of 4 rows. In blocks (``panel, k block, row tile, k``, as ``_tiles.k_block`` for a GEMM
    of K >= 1024) a block stays in L1. The block: the largest multiple of 8 dividing K whose
    panel block (``panel_row_bytes`` a step of K: NR x the item size) fits
    ``POINTWISE_BLOCK_BYTES``, at most ``POINTWISE_KC``; K above that, static. The row tiles
    are no longer parallel: only where the panels (``outer_exts``, a symbolic batch counted
    once) split evenly over the cores or number 4 per core.

    On Zen 3 (AVX2, panels of 16 or 24 floats: blocks of up to 256; 2 threads, alternating,
    load average 5): 576->128, 576->224 at 14 x 14 0.79x the time, 576->96 0.92x, 320->128 at
    28 x 28 0.85x, 1024->192 at 7 x 7 0.90x. On AVX-512 (Intel Xeon, panels of 32 floats:
    blocks of up to 192, 128 where K is a power of two; 2 threads, alternating, quiet):
    512->1000 at 13 x 13 0.89x, 512->64 0.82x, 256->1024 at 14 x 14 0.88x, 1024->256 0.85x,
    512->2048 at 7 x 7 0.88x, 2048->512 0.95x; blocks of 256 there (32 KiB of the panel)
    gained nothing (0.95-1.0x)."""
    most = min(POINTWISE_KC, POINTWISE_BLOCK_BYTES // max(panel_row_bytes, 1) // 8 * 8)
    if not is_static(k_ext) or most < 8 or k_ext <= most or cores < 1:
        return None
    panels = 1
    for ext in outer_exts:
        panels *= ext if is_static(ext) else 1  # a symbolic batch: at least one
    if panels < cores or (panels % cores and panels < 4 * cores):
        return None
    blocks = [kc for kc in range(8, most + 1, 8) if k_ext % kc == 0]
    return blocks[-1] if blocks else None


def channels_as_rows(stmt, merged: tuple, lanes: int, regs: int) -> bool:
    """Whether a 1x1 convolution's GEMM (its rows ``(h, w)`` merged: ``merged``, their
    extents) takes the output channels as its rows and the merged ``(h, w)`` as its vector
    axis: ``Y[f, hw] += W[f, c] * X[c, hw]``, as MLAS runs an NCHW 1x1 convolution. In NCHW
    both X and Y are contiguous along ``hw``: X's panels are read (packed) in whole vectors
    and the accumulators are written back in whole vectors, where the other way round (rows
    ``hw``, the channels as vectors) broadcasts X element by element and transposes the whole
    output tile on its way back (a store per lane). Only where neither axis is padded: ``hw``
    a multiple of the lanes (56 x 56, 28 x 28; not 14 x 14 or 7 x 7, which padded through
    copies of X took 60x the time) and the channels a multiple of the standard tile's rows.
    One output channel (a segmentation or depth head, 64 -> 1 at 128 x 128: no channel axis
    left, so the Matmul rule had no vector axis and the fallback rule took 1.4x ONNX
    Runtime's time) is one row: 0.11x ONNX Runtime's time.

    2 threads, alternating with ONNX Runtime (its AVX-512 NCHWc kernels), quiet, Intel Xeon
    (AVX-512, ``emeraldrapids``): ResNet-50's 64->256 at 56 x 56 1.00 -> 0.53 ms (ORT 0.73),
    256->64 at 56 x 56 0.93 -> 0.58 (ORT 0.66), 128->512 at 28 x 28 0.63 -> 0.53 (ORT 0.54);
    built for AVX2 (``znver3``) on the same host: 1.18 -> 0.96, 1.63 -> 1.13, 1.01 -> 0.86."""
    hw = 1
    for size in merged:
        hw *= size
    mac = is_mac(stmt.body)
    if not merged or mac is None or hw % lanes:
        return False
    x_vars = set().union(*(vars_in(i) for i in mac[0].indices))
    w_vars = set().union(*(vars_in(i) for i in mac[1].indices))
    w_spatial = [
        iv for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.DataPar and iv.var in w_vars
    ]
    channels = [iv.dom.extent for iv in w_spatial if iv.var not in x_vars]
    if len(channels) > 1 or (channels and not isinstance(channels[0], tirx.IntImm)):
        return False
    if not channels and w_spatial:
        return False  # a grouped convolution's group axis, not its channels
    f = int(channels[0]) if channels else 1  # one output channel: no iterator left
    nr, mr = _tiles.standard_tile(f, hw, lanes, regs, 1)
    return hw % nr == 0 and f % mr == 0


FLIP_MAX_CHANNELS = 4


def narrow_channels(stmt, load, cols: list, weight_spatial: set, width, lanes: int) -> bool:
    """Whether a window convolution with few output channels (``cols``, the weight's spatial
    axes ``weight_spatial``: at most ``FLIP_MAX_CHANNELS``, static; none left for one
    channel) takes its output width ``width`` as the vector axis instead, the weight
    broadcast: where its input ``load`` reads the width in its innermost index (NCHW), at
    stride 1 over a static width that half a vector or more divides, or for one channel at
    any stride and width (the Fallback rule is its alternative: with no spatial axis left in
    the weight, the rule found no vector axis).

    Intel Xeon (AVX-512, 2 threads), ours / ONNX Runtime, engines alternating
    (``bench_conv_layers.bench_layer``), before -> after: 3x3 64 -> 1 at 128 x 128 3.4 ->
    0.30 (6.6 -> 0.55 ms, the fallback rule before), 64 -> 3 0.94 -> 0.32, 64 -> 4 0.77 ->
    0.42; 30 x 30, batch 2: 64 -> 1 2.8 -> 0.31, 64 -> 3 0.52 -> 0.38; stride 2, 64 -> 1 2.4
    -> 1.0. Built for AVX2 (``znver3``) on the same host: 64 -> 3 1.04 -> 0.48, 5x5 32 -> 3 at
    96 x 96 0.89 -> 0.31. Kept as they were (the flip measured slower or no better): 5-8
    channels at 30 x 30, 2-8 channels at stride 2; a prime width (97) is 3.3-3.6x either way,
    no vector divides it (the padded input's width is not padded further)."""
    if set(cols) != weight_spatial:
        return False
    count, extents = 1, {iv.var: iv.dom.extent for iv in stmt.iter_vars}
    for var in weight_spatial:
        if not isinstance(extents[var], tirx.IntImm):
            return False
        count *= int(extents[var])
    if count > FLIP_MAX_CHANNELS:
        return False
    coeffs = sym.detect_linear_equation(load.indices[-1], [width])
    if len(coeffs) != 2 or not isinstance(coeffs[0], tirx.IntImm) or int(coeffs[0]) < 1:
        return False
    if count == 1:
        return True
    w_ext = extents[width]
    return (
        int(coeffs[0]) == 1
        and isinstance(w_ext, tirx.IntImm)
        and _tiles.dividing_width(int(w_ext), lanes) >= lanes // 2
    )


def merged_layout(merged: tuple):
    """The index map of an accumulator whose trailing axes (extents ``merged``: a 1x1
    convolution's ``(h, w)``) become one, the vector axis of :func:`channels_as_rows`."""
    n = len(merged)

    def flat(*idx):
        index = idx[len(idx) - n]
        for i, size in zip(range(len(idx) - n + 1, len(idx)), merged[1:], strict=True):
            index = index * size + idx[i]
        return (*idx[: len(idx) - n], index)

    return flat


def merge_rows(sch, block, sizes: tuple = ()) -> tuple:
    """Merge the row axes of a 1x1 convolution into one. In NCHW its input ``x[n, c, h, w]``
    and output ``y[n, f, h, w]`` both end in the rows ``(h, w)``, which are contiguous in both:
    one axis of ``h * w`` rows takes the GEMM's tile (ResNet's 14 x 14 images: 196 rows in tiles
    of 4, where the width alone, 14, took tiles of 2 rows). Only where the rows are the trailing
    axes of both (a GEMM's ``A[.., m, k]`` keeps its axes) and their extents are static.
    Returns the merged extents (``(14, 14)``), ``()`` where nothing was merged. With ``sizes``,
    merges a write-back block's trailing iterators of those extents instead."""
    stmt = sch.get(block)
    ivs = [iv.var for iv in stmt.iter_vars]
    ext = {iv.var: iv.dom.extent for iv in stmt.iter_vars}
    if sizes:
        rows = ivs[len(ivs) - len(sizes) :]
        if len(rows) != len(sizes) or any(
            not isinstance(ext[v], tirx.IntImm) or int(ext[v]) != size
            for v, size in zip(rows, sizes, strict=True)
        ):
            return ()
    else:
        mac = is_mac(stmt.body)
        if mac is None:
            return ()
        a_load, b_load = mac
        b_vars = set().union(*(vars_in(i) for i in b_load.indices))

        def trailing(load, buffer_shape):
            names = []
            for index, dim in reversed(list(zip(load.indices, buffer_shape, strict=True))):
                if not isinstance(index, tirx.Var) or index in b_vars:
                    break
                size = ext.get(index)
                if not (isinstance(dim, tirx.IntImm) and isinstance(size, tirx.IntImm)):
                    break
                if int(dim) != int(size):
                    break
                names.append(index)
            return names[::-1]

        rows = trailing(a_load, a_load.source.shape)
        out = trailing(stmt.body, stmt.body.buffer.shape)
        if len(rows) < 2 or len(out) < len(rows):
            return ()
        if not all(a.same_as(b) for a, b in zip(rows, out[-len(rows) :], strict=True)):
            return ()
        sizes = tuple(int(ext[v]) for v in rows)
    pos = [next(i for i, v in enumerate(ivs) if v.same_as(r)) for r in rows]
    if pos != list(range(pos[0], pos[0] + len(rows))):
        return ()

    def merged(*idx):
        flat = idx[pos[0]]
        for i, size in zip(pos[1:], sizes[1:], strict=True):
            flat = flat * size + idx[i]
        return (*idx[: pos[0]], flat, *idx[pos[-1] + 1 :])

    try:
        sch.transform_block_layout(block, tirx.IndexMap.from_func(merged, ndim=len(ivs)))
    except Exception as err:  # noqa: BLE001 - the rows stay apart
        logger.debug("matmul: rows not merged: %s", err)
        return ()
    return tuple(sizes)


def flatten_rows(sch, block, sizes: tuple):
    """Merged rows (``merge_rows``) that the tile's height does not divide (ResNet's 7 x 7
    images: 49 rows, tiles of 4) are padded like a GEMM's, which ``pad_einsum`` refuses while
    the block reads ``x[.., v // 7, v % 7]``: in a copy of ``sch``, the input is read through
    a copy laid out with its rows flat (``x'[.., v]``) and the output written flat (only an
    intermediate buffer, not a parameter), so that the block is an einsum again. Returns
    (that schedule, the input copy's block, the output's copy block or None), or None (``sch``
    is unchanged either way). An output that is a parameter is written through a flat
    intermediate, copied out by a block the caller schedules as the epilogue (ResNet-50's
    convolutions before their batch norm is folded: 512->2048 at 7 x 7 took tiles of ONE
    vector).
    ResNet-50's 1x1 512->2048 and 2048->512 at 7 x 7 on Zen 3 (AVX2, 2 threads): 1.8-2.0x ->
    1.25-1.45x ONNX Runtime's time (alternating, load average 1.0-1.4)."""
    trial = sch.copy()
    stmt = trial.get(block)
    out = stmt.body.buffer
    out_copy = None
    if any(out.same_as(p) for p in trial.mod["main"].params):  # a parameter keeps its shape:
        try:  # the block writes a flat intermediate, copied out as the epilogue
            out_copy = trial.cache_write(block, 0, "global")
        except Exception as err:  # noqa: BLE001 - the rows stay unpadded
            logger.debug("matmul: output not cached: %s", err)
            return None
        stmt = trial.get(block)
    a_buffer = is_mac(stmt.body)[0].source
    reads = [i for i, r in enumerate(stmt.reads) if r.source.same_as(a_buffer)]
    if len(reads) != 1:
        return None
    flat = merged_layout(sizes)
    try:
        copy = trial.cache_read(block, reads[0], "global")
        trial.transform_layout(block, ("read", reads[0]), flat)
        trial.transform_layout(block, ("write", 0), flat)
    except Exception as err:  # noqa: BLE001 - the rows stay unpadded
        logger.debug("matmul: merged rows not flattened: %s", err)
        return None
    return trial, copy, out_copy


def compact_strided(sch, block, pays) -> str | None:
    """A strided 1x1 convolution's input ``x[n, c, 2h, 2w]`` read through a compact copy
    ``x'[n, c, h, w]`` (``reindex``, laid out with the rows last), so that ``merge_rows``
    merges its rows as a stride-1 convolution's. Read in place, every step of the reduction
    broadcasts from rows two image rows apart and each column panel streams the whole image
    again: ResNet-50's 1024->2048 at 14 x 14 -> 7 x 7 took tiles of 7 rows x ONE vector.
    Only where ``pays(merged rows, output width, columns, K)`` (the copy costs a pass over the
    input). Returns the copy block's name (the caller schedules it), None where nothing changed."""
    stmt = sch.get(block)
    mac = is_mac(stmt.body)
    if mac is None:
        return None
    a_load, b_load = mac
    b_vars = set().union(*(vars_in(i) for i in b_load.indices))
    out = list(stmt.body.indices)
    strided = []
    for index, row in zip(a_load.indices[-2:], out[-2:], strict=False):
        if not isinstance(row, tirx.Var) or row in b_vars:
            return None
        if isinstance(index, tirx.Mul) and index.a.same_as(row):
            if not isinstance(index.b, tirx.IntImm) or int(index.b) < 2:
                return None
            strided.append(row)
        elif not index.same_as(row):
            return None
    if len(out) < 2 or len(a_load.indices) < 2 or not strided:
        return None
    rows = out[-2:]
    reads = [i for i, r in enumerate(stmt.reads) if r.source.same_as(a_load.source)]
    if len(reads) != 1:
        return None
    ivs = [iv.var for iv in stmt.iter_vars]
    a_vars = set().union(*(vars_in(i) for i in a_load.indices))
    ext = {iv.var: iv.dom.extent for iv in stmt.iter_vars}
    cols = [v for v in ivs if v in b_vars and v not in a_vars]
    k_ext = 1
    for iv in stmt.iter_vars:
        k_ext *= iv.dom.extent if iv.iter_type == tirx.IterVar.CommReduce else 1
    sizes = [ext[v] for v in rows] + [ext[cols[-1]] if cols else None, k_ext]
    if not all(isinstance(s, tirx.IntImm) for s in sizes):
        return None
    h, w, j, k = (int(s) for s in sizes)
    if not pays(h * w, w, j, k):
        return None
    dims = [v for v in ivs if v in a_vars]  # the reindexed buffer's axes, in iterator order
    if any(all(not v.same_as(d) for d in dims) for v in rows):
        return None
    pos = [next(i for i, d in enumerate(dims) if d.same_as(v)) for v in rows]
    keep = [i for i in range(len(dims)) if i not in pos]
    try:
        copy = sch.reindex(block, ("read", reads[0]))
    except Exception as err:  # noqa: BLE001 - the strided read stays
        logger.debug("matmul: strided rows not compacted: %s", err)
        return None
    try:
        order = keep + pos
        sch.transform_layout(block, ("read", reads[0]), lambda *idx: [idx[i] for i in order])
    except Exception as err:  # noqa: BLE001 - a compact copy still, its rows not last
        logger.debug("matmul: compact copy's rows not last: %s", err)
    return sch.get(copy).name_hint


def weights_outweigh(a_buf, j_ext, k_ext) -> bool:
    """B (columns x reduction, static) larger than one image of A (its static dims): a
    window convolution's weights, whose panel loop then goes outside the output rows."""
    if not (is_static(j_ext) and is_static(k_ext)):
        return False
    a_size = 1
    for dim in a_buf.shape:
        a_size *= int(dim) if isinstance(dim, tirx.IntImm) else 1
    return j_ext * k_ext > a_size
