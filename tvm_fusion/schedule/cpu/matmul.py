"""CPU rule for GEMM and GEMV with a fused epilogue.

Matches a PrimFunc with exactly one reduction block of the form
``Y[...] += A[...] * B[...]`` (casts allowed) whose reduction iterates one axis ``k`` read by both
operands, plus injective blocks before it and after it (the epilogue). Blocks before it that
feed only the epilogue (DeBERTa-v2's ``c2p / s + p2c / s`` added to the scores, T5's mask) are
inlined into the epilogue; data movement into an operand is inlined into its read; a computed
operand (``x / s + y``) is materialised first in one parallel, vectorised pass.

Block iterators are sorted into roles by the operand that reads them: ``rows`` (A only),
``cols`` (B only), ``batch`` (both). The schedule is the classic CPU one:

- output tile of ``MR`` rows x ``NR`` columns (x every small extra B-only axis, e.g. the gate
  axis of ``FuseSplitGates``' ``Y[n, gate, d]``), accumulated in registers over ``k``;
  ``NR`` is 2-4 vector registers wide, ``MR * NR / lanes`` accumulators fit the register file;
  the accumulators are laid out with the vector axis innermost whatever the output's layout
  (a convolution's ``(batch, channels, h, w)``), so that they stay in registers;
- B is packed into panels ``[cols / NR, k, (gates), NR]`` so the inner loop streams contiguous
  vectors. When B is a constant (``layout_free_buffers``), the packing block is annotated as a
  layout-rewrite preproc: ``SplitLayoutRewritePreproc`` + ``FoldConstant`` do it at compile time;
  otherwise it is packed at run time when there are enough rows to repay it, else read in place;
- the epilogue is computed on the tile: inlined into the accumulator's write-back when it is
  elementwise, else computed at the tile loop, so the full GEMM output never exists in memory;
- a long reduction (K >= 1024, B packed) runs in blocks of 256 (as MLAS): ``panel, k block,
  row tile, k``, so a panel's KC x NR block of B is read from L1 by every row tile; on AVX2,
  static rows get 12 accumulators: 4 rows x 3 vectors for K >= 256 (B's columns padded in its
  packing when needed, ``wide_tile``), else 6 x 2 or a divisor of the rows (``_tiles.py``);
  a 1x1 convolution's K too, in blocks of at most 24 KiB of its panel (256 channels of a
  16- or 24-float panel on AVX2, 128-192 of a 32-float one on AVX-512;
  ``_conv.pointwise_k_block``);
- the loop over (column panels, row tiles) is parallel (column panels alone when K is blocked);
- the panel loop goes outside the outer rows (a window convolution's output rows, an NHWC 1x1
  convolution's ``h``) when the weights outweigh one image of A and, for a plain GEMM of rows
  on two axes, reach ``PANELS_OUTSIDE_ROWS_BYTES`` (2 MiB): each panel read once, not per row;
- on AVX2, a GEMM of packed B whose A exceeds 4 MiB runs its rows in blocks of at most 4 MiB
  outside the (parallel) panel loop, each block read from L2/L3 by every panel (``row_block``;
  a run-time B of at most 32 MiB is then packed whole up front, not per panel);
- symbolic rows (``batch * seq``) and a symbolic vector axis (attention's ``seq`` columns) are
  padded to a multiple of the tile (``pad_einsum``: operands copied into padded buffers, the
  result cut back where it is written), so the tile loops carry no tail predicate, which would
  make TVM keep the accumulator in memory at full size. ``pad_einsum`` takes einsum reads
  only: a convolution's static columns (channels) that no tile divides get a tile width that
  divides them instead (20 channels: 10), and its static rows likewise;
- a convolution (_conv.py): a k x k window keeps its reduction loops (channels, kh, kw; B
  packed as ``[cols / NR, c, kh, kw, NR]``), where one flat ``k`` read its input at
  ``k // 9, h + k % 9 // 3, w + k % 3``; a 1x1 convolution's rows ``(h, w)`` become one axis
  (its accumulators and write-back too): the GEMM's columns where they are whole vectors
  (the channels its rows, as MLAS: ``channels_as_rows``), else its rows, padded through flat
  copies where the tile's height does not divide them (7 x 7: 49 rows in tiles of 4 on AVX2)
  or the wide tile pads its columns (SqueezeNet's 1000 channels: 1008); a window
  convolution to 1-4 channels in NCHW takes its output width as the columns, the channels as
  rows, the weight broadcast (``_conv.narrow_channels``: one channel went to the fallback rule);
- an epilogue block that writes more than the GEMM (a fused Pad) stays at the root
  (``_common.covered_by``).
"""

from __future__ import annotations

import logging
from functools import partial

from tvm import DataType, s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.target import Target

from ... import target as _target
from ...tir_util import expr_size, vars_in
from .._common import (
    ACC_SCOPE,
    GATE_ATTR,
    CPURule,
    covered_by,
    extent,
    inline_is_cheap,
    inline_padding,
    is_static,
    loop_nest_work,
    parallelize_outer,
    same_blocks,
    same_domain,
    schedule_copy,
    sole_consumer,
    try_inline_safe,
    vectorize_innermost,
)
from . import prefetch
from ._conv import (
    channels_as_rows,
    compact_strided,
    flatten_rows,
    is_mac,
    is_window,
    merge_rows,
    merged_layout,
    narrow_channels,
    weights_outweigh,
)
from ._conv_tiles import block_channels, window_tile
from ._matmul_steps import (
    Block,
    fuse_reduction,
    k_block_for,
    pack_per_panel,
    pad_axes,
    param_index,
    read_index,
    vector_axis_last,
)
from ._tiles import (
    ACC_ITEMSIZE,
    RUNTIME_PACK_MAX,
    compact_pays,
    dividing_width,
    row_block,
    standard_tile,
    unpadded_tile,
    wide_tile,
)

logger = logging.getLogger(__name__)

# A GEMM whose rows span two loops (an NHWC 1x1 convolution's h and w), A static, and whose
# weights outgrow a core's L2 (2 MiB on Intel Xeons, 0.5-1 MiB on Zen 3/4) and one image of A:
# the panel loop outside the outer rows, as for window convolutions (weights_outweigh). With
# h outside, each of the h rows streams all the weights again. ResNet-50 in NHWC, Intel Xeon
# (AVX-512), kernel by kernel inside the model, alternating, ms for all calls: 512->2048 at
# 7 x 7 (4 MiB) 3.22 -> 1.69, 2048->512 at 7 x 7 2.07 -> 1.11, 1024->512 at 14 x 14 (2 MiB)
# 0.97 -> 0.79; the whole model 0.94x (twice). All 1x1 layers moved (no threshold): 256->1024
# at 14 x 14 (1 MiB, in L2 either way) 3.15 -> 3.52, hence the threshold.
PANELS_OUTSIDE_ROWS_BYTES = 2 * 1024 * 1024

PREPROC = "meta_schedule.layout_rewrite_preproc"


def _is_cheap(store) -> bool:
    """Data movement (a load, with casts) or a small expression (``x * scale`` on two indices),
    which an operand's read may recompute."""
    value = store.value
    while isinstance(value, tirx.Cast):
        value = value.value
    return isinstance(value, TensorLoad) or expr_size(store.value, 16) <= 8


class _WideRefused(Exception):
    """A step of the wide tile's schedule (or of merged rows', _merge_rows) failed: schedule
    the function again without it."""


class Matmul(CPURule):
    """GEMM/GEMV + epilogue on llvm (see module docstring)."""

    _tile = staticmethod(standard_tile)  # (NR, MR) of the standard tile; see _tiles.py

    def __init__(self, max_gate_axis: int = 8):
        self.max_gate_axis = max_gate_axis

    def apply(self, func, target: Target, tunable: bool):
        if not self.applicable(func, target):
            return None
        try:
            return self._apply(func, target, wide_ok=True)
        except _WideRefused as err:
            logger.debug("matmul: no wide tile (%s): the standard tile", err)
        try:
            return self._apply(func, target, wide_ok=False)
        except _WideRefused as err:
            logger.debug("matmul: rows kept apart (%s)", err)
            return self._apply(func, target, wide_ok=False, merge_ok=False)

    def _apply(self, func, target: Target, wide_ok: bool, merge_ok: bool = True):  # noqa: C901 - one linear recipe
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        reductions = [b for b in infos if not b.is_injective()]
        if len(reductions) != 1:
            return None
        red = reductions[0]
        kinds = red.dom_kind()
        n_red = len(kinds) - len(kinds.rstrip("R"))
        if n_red == 0 or kinds.count("R") != n_red:
            return None
        window = n_red > 1 and is_window(sch.get(red.block_rv), n_red)
        if n_red > 1 and not window and not fuse_reduction(sch, red.block_rv, n_red):
            return None
        flat = None  # merged rows padded through flat buffers (flatten_rows)
        lanes = _target.vector_lanes(target, str(sch.get(red.block_rv).writes[0].source.dtype))
        regs = _target.vector_registers(target)
        pays = partial(compact_pays, lanes=lanes, regs=regs)
        compact = compact_strided(sch, red.block_rv, pays) if not window and merge_ok else None
        merged = merge_rows(sch, red.block_rv) if not window and merge_ok else ()
        stmt = sch.get(red.block_rv)
        mac = is_mac(stmt.body)
        if mac is None:
            return None
        a_load, b_load = mac
        swapped = bool(merged) and channels_as_rows(stmt, merged, lanes, regs)
        if swapped:  # the output channels as rows, (h, w) as the vector axis (_conv.py)
            a_load, b_load = b_load, a_load
        iters = [iv.var for iv in stmt.iter_vars]
        # a convolution keeps its reduction loops (channels, kh, kw): fused into one flat k,
        # its input's index is k // 9, h + k % 9 // 3, w + k % 3, a division per step of k
        k_vars = iters[len(iters) - n_red :] if window else iters[-1:]
        k_var = k_vars[0]
        a_vars = set().union(*(vars_in(i) for i in a_load.indices))
        b_vars = set().union(*(vars_in(i) for i in b_load.indices))
        if any(k not in a_vars or k not in b_vars for k in k_vars):
            return None
        spatial = iters[: len(iters) - len(k_vars)]
        cols = [v for v in spatial if v in b_vars and v not in a_vars]
        rows = [v for v in spatial if v in a_vars and v not in b_vars]
        # A window convolution to 1-4 channels (a segmentation, depth or image head): its
        # output width is the vector axis (read in whole vectors at each tap), the channels
        # the rows, the weight broadcast (narrow_channels)
        weight_spatial = b_vars - set(k_vars)
        flipped = window and bool(rows)
        flipped = flipped and narrow_channels(stmt, a_load, cols, weight_spatial, rows[-1], lanes)
        if flipped:
            a_load, b_load, a_vars, b_vars = b_load, a_load, b_vars, a_vars
            cols, rows = rows, cols
        if not cols:
            return None
        out_buf = stmt.writes[0].source
        dtype = str(out_buf.dtype)
        if dtype not in ("float32", "float64", "float16"):
            return None

        # Injective producers: those that only feed the epilogue are inlined into it (computed
        # once per output); data movement into an operand (transpose, reshape, cast) is inlined
        # into the operand's read; a computed operand (a divide/add before the GEMM) is
        # materialised first, in one pass, its producers inlined into it: inlined into the
        # operand's read it would be recomputed for every column panel.
        red_index = infos.index(red)
        prologue = infos[:red_index]
        materialised = [compact] if compact else []
        for info in reversed(prologue):
            block_rv = info.block_rv
            value = sch.get(block_rv).body
            if not isinstance(value, tirx.BufferStore):
                return None
            feeds_gemm = any(
                sch.get(c).same_as(sch.get(red.block_rv)) for c in sch.get_consumers(block_rv)
            )
            if feeds_gemm and not _is_cheap(value):
                materialised.append(sch.get(block_rv).name_hint)
                continue
            try:
                sch.compute_inline(block_rv)
            except Exception as err:  # noqa: BLE001 - a producer that cannot be inlined stays
                logger.debug("matmul: prologue block kept: %s", err)
                materialised.append(sch.get(block_rv).name_hint)
        epilogue = try_inline_safe(sch, list(infos[red_index + 1 :]))
        block = red.block_rv

        lanes = _target.vector_lanes(target, dtype)
        loops = sch.get_loops(block)
        loop_of = dict(zip(iters, loops, strict=True))

        # The vector axis: the innermost B-only axis. In FuseSplitGates' kernels, small extra
        # B-only axes (the gates) join the tile, so that the gate math finds every gate of a unit
        # in it; elsewhere (XLNet's heads in einsum('ibh,hnd->ibnd')) they are outer columns,
        # which leaves the registers to more rows: a B panel is reused by MR rows, not one.
        j_var = cols[-1]
        gated = func.attrs is not None and GATE_ATTR in func.attrs
        gate_vars = [
            v
            for v in cols[:-1]
            if gated
            and is_static(extent(sch, loop_of[v]))
            and extent(sch, loop_of[v]) <= self.max_gate_axis
        ]
        outer_cols = [v for v in cols[:-1] if v not in gate_vars]
        n_gates = 1
        for v in gate_vars:
            n_gates *= extent(sch, loop_of[v])
        i_var = rows[-1] if rows else None
        j_ext = extent(sch, loop_of[j_var])
        m_ext = extent(sch, loop_of[i_var]) if i_var is not None else 1

        itemsize = DataType(dtype).bits // 8
        nr, mr = standard_tile(m_ext, j_ext, lanes, regs, n_gates, itemsize)
        # the window and unpadded tiles count float64 accumulators as 8 bytes (under the stack
        # limit), narrower ones as float32's 4, as before
        acc_bytes = max(itemsize, ACC_ITEMSIZE)
        if window and is_static(m_ext):
            # a window's rows (the output width) are never padded (pad_einsum refuses its
            # reads): a height that divides them, sized on the register file (_conv_tiles.py)
            nr, mr = window_tile(m_ext, j_ext, nr, lanes, regs, n_gates, acc_bytes)
        layout_free = {int(i) for i in func.attrs.get("layout_free_buffers", [])}
        b_param = param_index(func, b_load.source)
        is_const_b = b_param is not None and b_param in layout_free
        k_ext = 1
        for k in k_vars:
            k_ext = k_ext * extent(sch, loop_of[k])
        wide = wide_tile(m_ext, j_ext, k_ext, lanes, regs, n_gates) if wide_ok else None
        if swapped and wide is not None and (j_ext % wide[0] or m_ext % wide[1]):
            wide = None  # (h, w) or the channels would be padded: through copies of x
        if wide is not None:
            nr, mr = wide
            logger.debug("matmul: %s rows x %s columns in tiles of %s x %s", m_ext, j_ext, mr, nr)
        a_pads: list = []
        pad_rows = mr > 1 and (not is_static(m_ext) or m_ext % mr != 0)
        pad_cols = not is_static(j_ext) or j_ext % nr != 0
        static_cols = is_static(j_ext)
        if pad_rows or pad_cols:
            # Symbolic rows or columns: pad their domain to a multiple of the tile (operands
            # copied into padded buffers, the result cut back to the real extent), so the
            # accumulating block has no tail predicate; with one, TVM 0.27's
            # CompactBufferAllocation keeps the accumulator at its full (rows, cols) size in
            # memory instead of an MR x NR tile in registers.
            factors = {i_var: mr} if pad_rows else {}
            if pad_cols:
                factors[j_var] = nr
            padded = pad_axes(sch, block, iters, factors, epilogue)
            nr_u, mr_u = (
                unpadded_tile(m_ext, j_ext, nr, lanes, regs, n_gates, acc_bytes)
                if merged
                else (0, 0)
            )
            flat_rows = pad_rows and is_static(m_ext) and mr_u * nr_u < mr * nr
            flat_rows = flat_rows and not swapped
            if padded is None and merged and (flat_rows or (pad_cols and wide is not None)):
                # 49 rows: 13 tiles of 4 x 2 vectors on AVX2, not 7 tiles of 7 x 1 vector
                flat = flatten_rows(sch, block, merged)
                out_copy = [Block(flat[2])] if flat and flat[2] is not None else []
                flat = None if out_copy and epilogue else flat  # a parameter written and read
                later = out_copy or epilogue
                padded = pad_axes(flat[0], block, iters, factors, later) if flat else None
                if padded:
                    sch = flat[0]
                    try:
                        kept = [p for p in padded[0] if not sch.get(p).same_as(sch.get(flat[1]))]
                        sch.compute_inline(flat[1])  # the padded copy reads the input itself
                        padded = (kept, padded[1])
                    except Exception as err:  # noqa: BLE001 - the flat copy stays
                        logger.debug("matmul: flat copy kept: %s", err)
                padded, flat = (padded, flat) if padded else (None, None)
            if padded is None and pad_cols and static_cols and wide is None:
                # pad_einsum refuses reads that are not an einsum's (a convolution's
                # x[.., w + k % 3]): static columns then take a tile width that divides them
                nr = dividing_width(j_ext, lanes)
                pad_cols = False
                logger.debug("matmul: columns not padded, tiles of %s of them", nr)
                if pad_rows and is_static(m_ext):
                    mr, pad_rows = dividing_width(m_ext, mr), False  # nor rows (9 -> 3)
                if pad_rows:
                    padded = pad_axes(sch, block, iters, {i_var: mr}, epilogue)
                else:
                    padded = ([], epilogue)
            if padded is False or (padded is None and pad_cols):
                if wide is not None:
                    raise _WideRefused("columns not padded")
                return None  # padded but not understood, or columns that need the padding
            if padded is None and is_static(m_ext):
                # static rows that pad_einsum refuses (a convolution's output width, 5 or 7):
                # a height that divides them, sized on the whole register file (below)
                nr, mr = unpadded_tile(m_ext, j_ext, nr, lanes, regs, n_gates, acc_bytes)
                logger.debug("matmul: rows not padded, tiles of %s x %s", mr, nr)
            elif padded is None:
                mr = 1
            else:
                a_pads, epilogue = padded
                # A's copy is read in place with its rows clamped; B's (padded columns, its
                # vector axis) stays a copy: clamped lanes would make its packing a gather.
                a_buf = is_mac(sch.get(block).body)[int(swapped or flipped)].source
                rows_pad = [p for p in a_pads if sch.get(p).writes[0].source.same_as(a_buf)]
                inlined = inline_padding(sch, rows_pad) if rows_pad else None
                if inlined is not None:
                    kept = [p for p in a_pads if p not in rows_pad]
                    (block,) = same_blocks(sch, inlined, [block])
                    epilogue = [
                        Block(b) for b in same_blocks(sch, inlined, [i.block_rv for i in epilogue])
                    ]
                    a_pads = same_blocks(sch, inlined, kept)
                    sch = inlined
                stmt = sch.get(block)
                a_load, b_load = is_mac(stmt.body)[:: -1 if swapped or flipped else 1]
                loops = sch.get_loops(block)
                loop_of = dict(zip(iters, loops, strict=True))
                j_ext = extent(sch, loop_of[j_var])

        # Pack B into panels [.., j/NR, k, gates.., NR] indexed by the block's iterators.
        b_index = read_index(stmt, b_load.source)
        many_rows = not is_static(m_ext) or m_ext >= 16
        pack = is_const_b or many_rows
        # A run-time B is packed one panel at a time inside the (parallel) panel loop when that
        # loop alone feeds every core: a K x NR buffer per thread instead of a copy of all of B
        # (the LM head's 125 MiB weight, packed again by every row chunk).
        cores = _target.num_cores(target)
        pb = None
        const_pack = False  # B packed at compile time
        divisible = (is_static(j_ext) and j_ext % nr == 0) or pad_cols
        if pack and b_index is not None and divisible:
            b_batch = [v for v in spatial if v in b_vars and v in a_vars]
            order = b_batch + outer_cols

            def packed(*ivs):
                env = dict(zip(iters, ivs, strict=True))
                return (
                    *[env[v] for v in order],
                    env[j_var] // nr,
                    *[env[k] for k in k_vars],
                    *[env[v] for v in gate_vars],
                    env[j_var] % nr,
                )

            try:
                index_map = tirx.IndexMap.from_func(packed, ndim=len(iters), index_dtype="int64")
                pb = sch.reindex_cache_read(block, b_index, "global", index_map)
                const_pack = is_const_b
                if pad_cols:
                    # B's padded columns: the zeros join the packing (done at compile time for
                    # a constant B) instead of a padded copy of B per call that is then packed
                    b_buf = sch.get(pb).reads[0].source
                    b_pads = [p for p in a_pads if sch.get(p).writes[0].source.same_as(b_buf)]
                    for pad in b_pads:
                        try:
                            sch.compute_inline(pad)
                            a_pads.remove(pad)
                        except Exception:  # noqa: BLE001 - the padded copy is packed per call
                            if wide is not None:
                                raise
                            const_pack = False  # its input is the padded copy now
                if const_pack:
                    sch.annotate(pb, PREPROC, True)
            except Exception as err:  # noqa: BLE001
                if wide is not None:
                    raise _WideRefused(f"B not packed: {err}") from err
                logger.debug("matmul: B not packed: %s", err)
                return None
            loops = sch.get_loops(block)
            loop_of = dict(zip(iters, loops, strict=True))

        work = loop_nest_work(sch, block)
        # Tile: [batch.., rows.., outer cols.., jo, io, k, ii, gates.., jio, jiv]
        jo, ji = sch.split(loop_of[j_var], [None, nr])
        if i_var is not None:
            io, ii = sch.split(loop_of[i_var], [None, mr])
        else:
            io, ii = None, None
        other_outer = [loop_of[v] for v in spatial if v not in cols and v is not i_var]
        panel_loops = [loop_of[v] for v in outer_cols] + [jo]
        # a strided 1x1 convolution left uncompacted reads A's rows at computed indices
        strided = len(rows) > 1 and any(
            vars_in(i) & set(rows) and not isinstance(i, tirx.Var) for i in a_load.indices
        )
        # (A static: a symbolic batch counts as 1 in weights_outweigh, and may be large)
        big_b = len(rows) > 1 and is_static(j_ext) and is_static(k_ext)
        big_b = big_b and all(isinstance(d, tirx.IntImm) for d in a_load.source.shape)
        big_b = big_b and j_ext * k_ext * itemsize >= PANELS_OUTSIDE_ROWS_BYTES
        if (window or strided or big_b) and weights_outweigh(a_load.source, j_ext, k_ext):
            # VGG's 512-channel layers (9.4 MB of weights, a 14 x 14 or 28 x 28 image), ResNet's
            # 1024->2048 at 14 x 14 stride 2 (8 MiB): the panel loop outside the output rows,
            # each panel of weights read from memory once and reused from L2 by every row, not
            # streamed again for every row
            outer_rows = [loop_of[v] for v in rows if v is not i_var]
            other_outer = [lp for lp in other_outer if all(lp is not r for r in outer_rows)]
            panel_loops += outer_rows
        order = other_outer + panel_loops
        order += [io] if io is not None else []
        order += [loop_of[k] for k in k_vars]
        order += [ii] if ii is not None else []
        order += [loop_of[v] for v in gate_vars] + [ji]
        sch.reorder(*order)
        jio, jiv = sch.split(ji, [None, min(lanes, nr)])
        sch.vectorize(jiv)
        sch.unroll(jio)
        for v in gate_vars:
            sch.unroll(loop_of[v])
        if ii is not None:
            sch.unroll(ii)

        tile_loop = io if io is not None else jo
        outer = other_outer + panel_loops
        tile_bytes = mr * n_gates * nr * DataType(dtype).bits // 8
        kc = rb = None
        if not window:
            # a 1x1 convolution in rows (h, w): its panel's K block sized on the panel's width
            row_bytes = tile_bytes // mr if merged and not swapped else 0  # a panel's row of B
            kc = k_block_for(sch, pb, outer, io, loop_of[k_var], tile_bytes, cores, row_bytes)
        elif io is not None and outer and mr <= 2:
            # the row's tiles under each block of input channels (_conv_tiles.channel_block)
            blocked = block_channels(sch, io, [loop_of[k] for k in k_vars], nr, itemsize)
            if blocked is not None:
                loop_of[k_var], tile_loop, io = blocked, outer[-1], None
        if kc:
            # K in blocks: a panel's KC x NR block of B stays in L1 while every row tile of the
            # panel reads it, the accumulators of all the panel's rows stay local in between.
            ko, ki = sch.split(loop_of[k_var], [None, kc])
            sch.reorder(ko, io, ki)
            loop_of[k_var] = ko
            tile_loop = panel_loops[-1]  # jo, or the outer rows moved under it
        else:
            # a run-time B of at most RUNTIME_PACK_MAX is then packed whole, not per panel
            b_item = DataType(str(b_load.source.dtype)).bits // 8
            whole_b = static_cols and is_static(k_ext) and not outer_cols
            whole_b = whole_b and pb is not None and k_ext * j_ext * b_item <= RUNTIME_PACK_MAX
            if io is not None and (const_pack or whole_b) and not other_outer:
                a_item = DataType(str(a_load.source.dtype)).bits // 8
                rb = row_block(extent(sch, io), mr, k_ext, a_item, regs) if not window else None
            if rb:
                # A in blocks of rows, each read by every (parallel) panel from L2/L3
                ic, io = sch.split(io, [None, rb])
                sch.reorder(ic, *panel_loops)
                tile_loop = io
            outer += [io] if io is not None else []
        if not kc and const_pack and io is not None and n_gates == 1 and len(k_vars) == 1:
            if static_cols and is_static(k_ext) and not (window or merged or flat):
                # a large prepacked B: its next panel fetched ahead (prefetch.py)
                b_size, n_panels = DataType(str(b_load.source.dtype)).bits // 8, -(-j_ext // nr)
                k_loop = prefetch.mark(sch, loop_of[k_var], io, n_panels, k_ext, nr, b_size)
                loop_of[k_var] = k_loop
        acc = sch.cache_write(block, 0, ACC_SCOPE)
        if swapped:
            if not flat:  # (flat copies write (h, w) flat already)
                sch.transform_layout(block, ("write", 0), merged_layout(merged))
        else:
            vector_axis_last(sch, block, j_var, () if flat else merged)
        # Epilogue on the tile: elementwise consumers fold into the write-back, the rest are
        # computed under the tile loop.
        for info in epilogue:
            if not same_domain(sch, acc, info.block_rv) or not sole_consumer(sch, acc):
                break
            if not inline_is_cheap(sch, acc, [info.block_rv]):
                break  # a chain of fast-math ops would multiply the expression size
            try:
                sch.reverse_compute_inline(info.block_rv)
            except Exception:  # noqa: BLE001
                break
        if merged:
            # the write-back iterates the merged rows too: over (h, w) it would cover the
            # bounding box of a tile's rows, lanes of the accumulators the tile never wrote
            for later in [acc, *epilogue]:
                later_rv = later if later is acc else later.block_rv
                try:
                    if later is not acc:
                        sch.get(later_rv)
                    elif flat:
                        continue  # it writes the flat padded rows
                except Exception:  # noqa: BLE001 - inlined above
                    continue
                if not merge_rows(sch, later_rv, merged):
                    raise _WideRefused("the write-back's rows not merged")  # retried unmerged
        sch.reverse_compute_at(acc, tile_loop, preserve_unit_loops=True)
        vectorize_innermost(sch, acc, lanes)
        apart = False  # an epilogue block that writes more than the GEMM (a pad), and after it
        for info in epilogue:
            try:
                sch.get(info.block_rv)
            except Exception:  # noqa: BLE001 - inlined above
                continue
            apart = apart or not covered_by(sch, block, info.block_rv)
            if apart:  # at the root, after the GEMM (_common.covered_by)
                schedule_copy(sch, info.block_rv, lanes, cores)
                continue
            sch.reverse_compute_at(info.block_rv, tile_loop, preserve_unit_loops=True)
            vectorize_innermost(sch, info.block_rv, lanes)
        if (pad_cols and static_cols) or flat:
            # the cut back to the real columns (or flat rows) reads the tile's accumulators,
            # not a (rows, padded columns) copy of them in memory
            try:
                sch.compute_inline(acc)
            except Exception as err:  # noqa: BLE001 - the copy stays
                logger.debug("matmul: padded accumulators written back: %s", err)

        panels = j_ext // nr if is_static(j_ext) else None
        per_panel = (
            pb is not None
            and not const_pack
            and not other_outer
            and not outer_cols
            and panels is not None
            and panels >= cores * 8
            and not rb  # A in row blocks: B packed once, up front
        )
        if pb is not None and not const_pack and not per_panel:
            schedule_copy(sch, pb, lanes, cores)
        for pad in a_pads:
            schedule_copy(sch, pad, lanes, cores)
        pad_names = {sch.get(p).name_hint for p in a_pads}
        for name in materialised:
            if name in pad_names:
                continue  # pad_einsum made it the operand's padded copy, scheduled above
            try:
                schedule_copy(sch, sch.get_sblock(name), lanes, cores)
            except Exception as err:  # noqa: BLE001 - it runs as a plain loop nest
                logger.debug("matmul: prologue block %s not scheduled: %s", name, err)
        parallel = parallelize_outer(sch, outer, cores, min_extent_per_core=8, work=work)
        if per_panel:
            pack_per_panel(sch, pb, parallel if parallel is not None else jo, lanes, cores)
        sch.decompose_reduction(block, loop_of[k_var])
        return sch
