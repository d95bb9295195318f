"""CPU rule for grouped convolutions (``groups`` > 1, not depthwise): a GEMM per group.

Matches a PrimFunc with exactly one reduction block ``Y[.., oc, oh, ow] += X[.., oc // OG * CG +
rc, ..] * W[oc, rc, ..]``: the input channel index adds a floor division of an output-channel
iterator (``oc // OG``, the group) and a reduction iterator (``rc``, the channel in the group).
That is what the importers emit for ``Conv2d(C, K, k, groups=G)`` in NCHW (ResNeXt's grouped
3 x 3; ShuffleNet's grouped 1 x 1 convolutions with a constant weight are einsums for the Matmul
rule since ``GroupedConvToGemm``, the measurements below are from before). The window rule
would take it too (``oc // OG * CG + rc`` adds a spatial and a reduction iterator), as one dot
product per output element: a broadcast weight per multiply-add and a copy of the group's input
planes per output channel.

The schedule, per group a GEMM ``W_g (OG x CG*kh*kw) @ X_g`` computed in place:

- the output positions are one axis ``p`` where a 1 x 1 convolution of stride 1 reads its input
  contiguously (``oh * OW + ow``), else ``ow`` (the rows join the outer loops);
- a register tile of ``MR`` output channels (a divisor of ``OG``: a tile within one group) x
  ``NV`` vectors of positions (a vector: the divisor of a row up to the lanes, 7 of 8 lanes at
  14 x 14; the tile whole rows or a part of one), accumulated in registers over all reduction
  loops, then written back (elementwise epilogues fold into the write-back);
- the tiles' outer loops (channel tiles, batch, rows, position tiles) are fused and parallel
  (the channel tiles first: a symbolic batch of 1 still runs in parallel);
- a padding block is computed whole before (a padded copy of the input), a plain copy is
  inlined.

Measured (``scripts/bench_cnn.py --repeat 5 --budget 3``, 2 threads, the 2 cores shared with
other jobs, the old and new code one after the other): ShuffleNet 27.3 ms against ONNX Runtime's
25.2 (the window rule's dot products: 53.5 against 21.8, load 3-4; 568.9 against 63.9 at load
7-9); its 1 x 1 groups-4 kernel 1 x 272 x 14 x 14 0.17 ms (1.9 ms). AlexNet's 3 x 3 groups-2
convolutions (12 x 12): 103.6 ms against ORT's 107.1 (116.0 against 112.6 before).

Sized from the target: ``lanes`` and the vector registers (accumulators <= registers - 4).

Skipped (left to the next rule, the reason logged at debug level): more than one reduction
block, no grouped input index, symbolic output positions, non-float dtypes, and rows whose
divisors fill under 3/4 of a vector (13 or 27 positions: no vector tail yet).
"""

from __future__ import annotations

import logging

from tvm import tirx
from tvm.ir.expr import Expr, TensorLoad
from tvm.target import Target

from ... import target as _target
from ...tir_util import vars_in
from .._common import (
    ACC_SCOPE,
    CPURule,
    block_dtype,
    covered_by,
    extent,
    inline_is_cheap,
    loop_nest_work,
    parallelize_outer,
    same_domain,
    schedule_copy,
    single_reduction,
    sole_consumer,
    vectorize_innermost,
)
from ._conv import update_operands

logger = logging.getLogger(__name__)


def _group_division(index, spatial: set, reduce: set):
    """``(oc, OG)`` when ``index`` adds ``oc // OG * CG`` (``oc`` spatial) to a reduction
    iterator, else None."""
    found = []

    def visit(expr):
        if isinstance(expr, tirx.FloorDiv):
            if isinstance(expr.a, tirx.Var) and expr.a in spatial:
                if isinstance(expr.b, tirx.IntImm) and int(expr.b) > 1:
                    found.append((expr.a, int(expr.b)))
            return
        for name in ("a", "b", "value"):
            child = getattr(expr, name, None)
            if isinstance(child, Expr):
                visit(child)

    visit(index)
    if len(found) != 1 or not vars_in(index) & reduce:
        return None
    return found[0]


def grouped_conv(stmt) -> tuple | None:
    """``(data load, weight load, oc, OG)`` of a grouped convolution block, else None."""
    iters = list(stmt.iter_vars)
    kinds = ["R" if iv.iter_type == iv.CommReduce else "S" for iv in iters]
    n_spatial = len(kinds) - len("".join(kinds).lstrip("S"))
    if n_spatial == 0 or "S" in kinds[n_spatial:] or n_spatial == len(kinds):
        return None
    if str(stmt.writes[0].source.dtype) not in ("float32", "float64", "float16"):
        return None
    operands = update_operands(stmt.body)
    if operands is None or len(operands) != 2:
        return None
    spatial = {iv.var for iv in iters[:n_spatial]}
    reduce = {iv.var for iv in iters[n_spatial:]}
    for data, weight in (operands, operands[::-1]):
        groups = [_group_division(i, spatial, reduce) for i in data.indices]
        groups = [g for g in groups if g is not None]
        if len(groups) != 1:
            continue
        oc, og = groups[0]
        w_vars = set().union(*(vars_in(i) for i in weight.indices))
        if oc in w_vars and not w_vars & (spatial - {oc}):
            return data, weight, oc, og
    return None


def _vector_width(row: int, lanes: int) -> int:
    """The positions of one vector: the divisor of ``row`` up to ``lanes`` that fills the most of
    a vector register (14 positions: 7 of 8 lanes; a longer vector, which LLVM splits, measured
    several times slower: 1 x 272 x 14 x 14, groups 4, 3.0 against 0.5 ms)."""
    return max(d for d in range(1, min(row, lanes) + 1) if row % d == 0)


def _tile(og: int, ext: int, row: int, vw: int, budget: int) -> tuple[int, int]:
    """``(MR, NV)``: output channels (a divisor of ``OG`` up to 8) x vectors of positions
    (``NV * vw`` divides ``ext`` and is whole rows or a part of one: the tile's write-back is
    one box of the output), at most ``budget`` accumulators, the most multiply-adds per load."""
    best, best_key = (1, 1), None
    for mr in (8, 6, 4, 3, 2, 1):
        for nv in (4, 3, 2, 1):
            nr = nv * vw
            if og % mr or mr * nv > budget or ext % nr or (nr % row and row % nr):
                continue
            key = (mr * nv / (mr + nv), mr)
            if best_key is None or key > best_key:
                best, best_key = (mr, nv), key
    return best


class GroupedConv(CPURule):
    """Grouped convolutions on llvm (see module docstring)."""

    def apply(self, func, target: Target, tunable: bool):  # noqa: PLR0911, PLR0912
        if not self.applicable(func, target):
            return None
        found = single_reduction(func)
        if found is None:
            return None
        sch, infos, at = found
        block = infos[at].block_rv
        if any(not info.is_injective() for i, info in enumerate(infos) if i != at):
            return None
        stmt = sch.get(block)
        match = grouped_conv(stmt)
        if match is None:
            logger.debug("grouped: not a grouped convolution")
            return None
        data, _weight, oc, og = match
        iters = list(stmt.iter_vars)
        spatial = [iv for iv in iters if iv.iter_type != iv.CommReduce]
        n_red = len(iters) - len(spatial)
        at_oc = next(i for i, iv in enumerate(spatial) if iv.var.same_as(oc))
        after = spatial[at_oc + 1 :]
        if not after or any(not isinstance(iv.dom.extent, tirx.IntImm) for iv in spatial[at_oc:]):
            logger.debug("grouped: no static output positions after the channels")
            return None
        dtype = block_dtype(sch, block)
        lanes = _target.vector_lanes(target, dtype)
        regs = _target.vector_registers(target)
        cores = _target.num_cores(target)
        work = loop_nest_work(sch, block)
        loops = sch.get_loops(block)
        if len(loops) != len(iters):
            return None
        s_loops, r_loops = loops[: len(spatial)], loops[len(spatial) :]
        outer, oc_loop = s_loops[:at_oc], s_loops[at_oc]
        pos = s_loops[at_oc + 1 :]
        # 1 x 1, stride 1, unpadded: the positions' input index is the output's
        data_tail = [str(i) for i in data.indices[-len(after) :]]
        flat = len(after) > 1 and data_tail == [str(iv.var) for iv in after]
        p_loop = sch.fuse(*pos) if flat else pos[-1]
        rows = [] if flat else pos[:-1]
        p_ext = int(extent(sch, p_loop))
        row = int(after[-1].dom.extent)
        vw = _vector_width(row, lanes)
        if vw < row and vw * 4 < lanes * 3:
            # no vector tail here (yet): a row of 13 would run as scalars, one of 27 as
            # vectors of 3 (AlexNet's groups-2 convolutions): the window rule's vector tail
            logger.debug("grouped: rows of %d fill %d of %d lanes", row, vw, lanes)
            return None
        mr, nv = _tile(og, p_ext, row if flat else p_ext, vw, max(regs - 4, 2))
        oc_o, oc_i = sch.split(oc_loop, [None, mr])
        p_o, p_v, p_i = sch.split(p_loop, [None, nv, vw])
        # the channel tiles outermost: the parallel loop when the batch is symbolic (or 1)
        sch.reorder(oc_o, *outer, *rows, p_o, *r_loops, oc_i, p_v, p_i)
        acc = sch.cache_write(block, 0, ACC_SCOPE)
        for info in infos[at + 1 :]:
            if not same_domain(sch, acc, info.block_rv) or not sole_consumer(sch, acc):
                break
            if not inline_is_cheap(sch, acc, [info.block_rv]):
                break
            try:
                sch.reverse_compute_inline(info.block_rv)
            except Exception:  # noqa: BLE001 - computed under the tile below
                break
        sch.reverse_compute_at(acc, p_o, preserve_unit_loops=True)
        for info in infos[at + 1 :]:
            try:
                sch.get(info.block_rv)
            except Exception:  # noqa: BLE001 - inlined above
                continue
            try:
                if not covered_by(sch, acc, info.block_rv):
                    raise ValueError("it writes more than the convolution (a pad)")
                sch.reverse_compute_at(info.block_rv, p_o, preserve_unit_loops=True)
            except Exception as err:  # noqa: BLE001 - left at the root
                logger.debug("grouped: epilogue apart: %s", err)
                schedule_copy(sch, info.block_rv, lanes, cores)
                continue
            vectorize_innermost(sch, info.block_rv, lanes)
        # parallel before the init is split off (the update alone is no complete block)
        parallelize_outer(sch, [oc_o, *outer, *rows, p_o], cores, work=work)
        sch.unroll(oc_i)
        sch.unroll(p_v)
        sch.vectorize(p_i)
        sch.decompose_reduction(block, sch.get_loops(block)[-(n_red + 3)])
        for pro in reversed([info.block_rv for info in infos[:at]]):
            # a plain copy is inlined; the padding (an ``if_then_else`` in the tile's loads
            # would scalarise them: AlexNet's 3 x 3 groups-2, 12 x 12) is a padded copy
            if isinstance(getattr(sch.get(pro).body, "value", None), TensorLoad):
                try:
                    sch.compute_inline(pro)
                    continue
                except Exception as err:  # noqa: BLE001 - computed whole below
                    logger.debug("grouped: copy not inlined: %s", err)
            schedule_copy(sch, pro, lanes, cores)
        # the accumulators' write-back: vectorised under the tile
        vectorize_innermost(sch, acc, lanes)
        return sch
