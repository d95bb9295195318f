"""Steps of the CPU Matmul rule's schedule (matmul.py), each on a schedule it is given: the
accumulator layout, padding to the tile, the fused reduction, B's packing per panel, the K
block, and the operand lookups."""

from __future__ import annotations

import logging

from tvm import tirx

from .._common import extent, schedule_copy, vectorize_innermost, write_order
from ._conv import merged_layout, pointwise_k_block
from ._tiles import k_block

# the rule's own logger: these steps' debug lines read as the Matmul rule's, as before the move
logger = logging.getLogger(__name__.rsplit(".", 1)[0] + ".matmul")


class Block:
    """A block the rule adds to the epilogue (the cut of padded rows), shaped like dlight's
    BlockInfo where the rule reads it."""

    def __init__(self, block_rv):
        self.block_rv = block_rv


def vector_axis_last(sch, block, j_var, merged: tuple = ()) -> None:
    """Lay the tile's accumulators out with the vector axis innermost. An output whose
    columns are not its last axis (a convolution's ``(batch, channels, h, w)``, the
    channels being the vector axis) otherwise gets a ``(channels, w)`` accumulator read
    and written in vectors of a strided axis: LLVM cannot keep it in registers and
    gathers / scatters it through memory at every step of ``k`` (ViT's patch embedding
    at batch 8: 96 us for 1.6 MFLOP, 8 us channels-last)."""
    indices = list(sch.get(block).body.indices)
    dims = [i for i, index in enumerate(indices) if index.same_as(j_var)]
    if len(dims) != 1 or dims[0] == len(indices) - 1:
        return
    d = dims[0]
    # trailing row axes merged into one (_merge_rows): one axis here too
    merge = merged_layout(merged) if merged else None

    def last(*idx):
        if merge is not None:
            *rest, flat = merge(*idx)
            rest = [x for i, x in enumerate(rest) if i != d]
            return (*rest, flat, idx[d])
        return (*idx[:d], *idx[d + 1 :], idx[d])

    try:
        sch.transform_layout(block, ("write", 0), last)
    except Exception as err:  # noqa: BLE001 - the accumulator keeps the output's layout
        logger.debug("matmul: accumulator layout kept: %s", err)


def pad_axes(sch, block, iters, factors: dict, epilogue: list):
    """``pad_einsum`` the axes in ``factors`` to multiples of their factor. Returns the
    padding copies of the inputs and the epilogue list with the cut back to the real extent
    in front (inlined into the first epilogue block when there is one); None when
    ``pad_einsum`` refuses (the schedule is unchanged), False when it padded but left other
    than one consumer (the schedule is changed: give up)."""
    try:
        sch.pad_einsum(block, [factors.get(v, 1) for v in iters])
    except Exception as err:  # noqa: BLE001 - the caller falls back
        logger.debug("matmul: %s not padded: %s", [str(v) for v in factors], err)
        return None
    pads = list(sch.get_producers(block))
    cut = list(sch.get_consumers(block))
    if len(cut) != 1:
        return False
    if epilogue:
        try:
            sch.compute_inline(cut[0])
            return pads, epilogue
        except Exception:  # noqa: BLE001 - keep the cut as its own tile step
            pass
    return pads, [Block(cut[0]), *epilogue]


def fuse_reduction(sch, block, n_red: int) -> bool:
    """Several trailing reduction iterators (XLNet's ``einsum('ibnd,hnd->ibh')`` reduces over
    heads and head size) become one, ``k = ((r0 * E1) + r1) * E2 + ...``; the inner extents
    must be static. Both operands then read ``k`` as the flat index of the reduced axes."""
    iter_vars = sch.get(block).iter_vars
    red = iter_vars[len(iter_vars) - n_red :]
    inner = [iv.dom.extent for iv in red[1:]]
    if not all(isinstance(e, tirx.IntImm) for e in inner):
        return False
    sizes = [int(e) for e in inner]

    def fused(*ivs):
        k = ivs[len(ivs) - n_red]
        for iv, size in zip(ivs[len(ivs) - n_red + 1 :], sizes, strict=True):
            k = k * size + iv
        return (*ivs[: len(ivs) - n_red], k)

    try:
        sch.transform_block_layout(block, tirx.IndexMap.from_func(fused, ndim=len(iter_vars)))
    except Exception as err:  # noqa: BLE001 - leave the kernel to other rules
        logger.debug("matmul: reduction iterators not fused: %s", err)
        return False
    return True


def pack_per_panel(sch, pb, panel_loop, lanes: int, cores: int) -> None:
    """Pack B's panel under the panel loop (the loop must be the panel loop alone)."""
    try:
        sch.compute_at(pb, panel_loop, preserve_unit_loops=True)
        write_order(sch, pb)
        vectorize_innermost(sch, pb, lanes)
    except Exception as err:  # noqa: BLE001 - pack the whole B up front instead
        logger.debug("matmul: B not packed per panel: %s", err)
        schedule_copy(sch, pb, lanes, cores)


def k_block_for(sch, pb, outer, io, k_loop, tile_bytes, cores, row_bytes) -> int | None:
    """KC for blocking the reduction of a packed-B GEMM, or None (``_tiles.k_block``; a 1x1
    convolution's merged rows, ``row_bytes`` nonzero: the bytes of a step of K in its panel,
    ``_conv.pointwise_k_block``)."""
    if pb is None or io is None:
        return None
    outer_exts = [extent(sch, loop) for loop in outer]
    kc = k_block(extent(sch, k_loop), extent(sch, io), tile_bytes, outer_exts, cores)
    if kc is None and row_bytes:
        kc = pointwise_k_block(extent(sch, k_loop), outer_exts, cores, row_bytes)
    return kc


def read_index(stmt, buffer) -> int | None:
    for i, region in enumerate(stmt.reads):
        if region.source.same_as(buffer):
            return i
    return None


def param_index(func: tirx.PrimFunc, buffer) -> int | None:
    for i, param in enumerate(func.params):
        if param.same_as(buffer):  # in 0.27 a buffer parameter is the buffer itself
            return i
    return None
