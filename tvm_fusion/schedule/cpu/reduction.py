"""CPU rule for row reductions: softmax, log-softmax, layer/RMS norm, sums and maxima over rows.

Matches PrimFuncs whose blocks all start with the same spatial axes (the rows) and whose
reduction blocks reduce the trailing axes. The schedule:

- injective blocks are inlined into their consumers where TIR allows it (``x - max`` into the
  exp-sum and into the output), so fewer passes go over each row;
- rows run in parallel; every block is computed at the row loop, so intermediates shrink to
  one row (no buffer of the full input size); short rows (under 8 vectors, a static even
  number of them) go two per iteration, so a core has two rows' chains of dependent steps
  in flight (``_pair_rows``);
- each reduction is vectorised by ``rfactor``: ``lanes`` partial results per row accumulated in
  vector registers, then folded; LLVM cannot vectorise a float reduction loop itself without
  reassociation, which TVM's codegen does not allow. ``rfactor`` needs a static extent; over a
  symbolic one (softmax of attention scores) the legalisation has already written the split
  (partials over whole vectors + a scalar tail), and the rule vectorises the partials; a
  costly reduction (an exp inlined into a sum) over a static row under two vectors is
  rfactored with the whole row as its lanes: its terms one vector per row (``_costly_update``);
- injective blocks are vectorised on their innermost loop;
- a reduction of a few terms read along the rows (ONNX ``Sum`` imported as
  ``sum(stack([a, b]), 0)``, ResNet's residual add) is elementwise in the rows: its producers
  inlined, the terms' loop outside a vector across the rows, unrolled (``_short_reduction``);
- a row buffer that the output reads where it writes (softmax's ``exp(x - max)``) is the
  output itself: the exp pass writes the output row, the output block scales it in place
  (``output_as_row_buffer``); left as a buffer where that is not provably the same.
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.target import Target

from ... import target as _target
from .._common import (
    MIN_PARALLEL_WORK,
    CPURule,
    block_dtype,
    extent,
    inline_is_cheap,
    is_reduction,
    is_static,
    is_trivial_reduction,
    loop_nest_work,
    parallelize_outer,
    vectorize_innermost,
    vectorize_with_tail,
)
from ._row_buffer import output_as_row_buffer, row_buffers_of
from .window import window_reduction

logger = logging.getLogger(__name__)


KEEP_EXPR = 48  # expression nodes: more, and a block read twice is computed once (see below)


def _unit(extent) -> bool:
    return isinstance(extent, tirx.IntImm) and int(extent) == 1


def _is_partial_iters(iters) -> bool:
    """``(..., lanes: static spatial, k: reduction)``, the partials of ``legalize._row_reduce``."""
    if len(iters) < 2 or iters[-1].iter_type != iters[-1].CommReduce:
        return False
    partials = iters[-2]
    return partials.iter_type != partials.CommReduce and isinstance(
        partials.dom.extent, tirx.IntImm
    )


def _vectorize_rf(sch, rf) -> None:
    """An rfactor block's innermost loop is its lanes axis: vectorised, the init split off
    at the reduction loop around it."""
    rf_loops = sch.get_loops(rf)
    sch.vectorize(rf_loops[-1])
    sch.decompose_reduction(rf, rf_loops[-2])


def _vectorize_row(sch, block, lanes: int) -> None:
    """``vectorize_innermost``, except for a static row at least two vectors long that the
    vector width does not divide: that one is left to ``vectorize_with_tail`` (whole vectors,
    then one short vector). ``vectorize_innermost`` would take the largest power of two
    dividing it, 2 lanes for a row of 30522 or 4002 (log_softmax 64 x 30522 ran at 2 lanes)."""
    loops = sch.get_loops(block)
    if loops:
        ext = extent(sch, loops[-1])
        if is_static(ext) and ext >= 2 * lanes and ext % lanes:
            return
    vectorize_innermost(sch, block, lanes)


ROW_BLOCK = 2  # short rows: rows computed together per iteration of the (parallel) row loop
SHORT_ROW = 8  # vectors: a row shorter than this is short


def _pair_rows(sch, row_loop, row_axes, lanes: int) -> bool:
    """Whether the rows go ``ROW_BLOCK`` at a time: a static number of rows that ``ROW_BLOCK``
    divides, each shorter than ``SHORT_ROW`` vectors. A short row is a chain of dependent
    steps (the max's fold of ``lanes`` partials, the exp, the sum's fold, the reciprocal)
    with little work beside it; two rows per iteration, every block computed for both, give
    the core two independent chains (softmax 4096 x 77: 1.14-1.33x ORT -> 1.01-1.02x). At a
    row of 211 it ran slower (0.98-1.02x -> 1.31-1.47x), so longer rows go one at a time."""
    rows = extent(sch, row_loop)
    if not is_static(rows) or rows % ROW_BLOCK or rows < 2 * ROW_BLOCK or not row_axes:
        return False
    length = 1
    for loop in row_axes:
        ext = extent(sch, loop)
        if not is_static(ext):
            return False
        length *= ext
    if length >= SHORT_ROW * lanes:
        logger.debug("row of %d: one row per iteration", length)
        return False
    return True


def _leading_s(kinds: str) -> int:
    return len(kinds) - len(kinds.lstrip("S"))


COSTLY_UPDATE = 24  # expression nodes of a reduction's update: more, a short row is rfactored


def _costly_update(sch, block) -> bool:
    """Whether a reduction's update computes more than it loads (an exp inlined into a sum:
    cross entropy's ``sum(exp(x - max))``). Over a static row shorter than two vectors
    ``rfactor`` then takes the whole row as the lanes: its terms computed as one vector (13
    lanes for 13 classes, in one register), folded after. A scalar loop evaluated the
    polynomial exp once per element: cross entropy 6626 x 13 ran 1.25x ORT with it."""
    from ...tir_util import expr_size

    body = sch.get(block).body
    value = getattr(body, "value", body)
    return expr_size(value, COSTLY_UPDATE + 1) > COSTLY_UPDATE


ROW_CHUNK = 512  # elements of the rows a short reduction's parallel loop takes at a time
SHORT_REDUCTION = 8  # terms: at most, a reduction whose terms are rows' vectors is unrolled


def _short_reduction(sch, block, rows: int, lanes: int, cores: int) -> bool:
    """A reduction of a few terms (at most :data:`SHORT_REDUCTION`, static) each read along the
    innermost row axis: ONNX ``Sum`` of two tensors, imported as ``sum(stack([a, b]), 0)``,
    ``Y[c, h, w] = sum_r (a[c, h, w] if r == 0 else b[c, h, w])``. Its terms are elementwise
    in the rows: the reduction loop goes outside the rows' innermost loop, which is
    vectorised (as the injective rule's, by the lanes or a power-of-two divisor), the reduction
    unrolled, the init split off and vectorised, the outer rows parallel. ``rfactor`` takes
    none of it (fewer terms than two vectors) and the reduction loop innermost is scalar.
    Returns whether it applied; the schedule is unchanged when not."""
    from tvm.ir.expr import TensorLoad

    from ...tir_util import expr_children

    stmt = sch.get(block)
    iters = list(stmt.iter_vars)
    loops = sch.get_loops(block)
    if rows >= len(iters) or len(loops) != len(iters):
        return False
    if not isinstance(stmt.body, tirx.BufferStore):
        return False
    terms = 1
    for loop in loops[rows:]:
        ext = extent(sch, loop)
        if not is_static(ext):
            return False
        terms *= int(ext)
    if terms < 2 or terms > SHORT_REDUCTION or not is_static(extent(sch, loops[rows - 1])):
        return False
    last_row = iters[rows - 1].var
    out = stmt.body.buffer
    stack = [stmt.body.value]
    while stack:  # every term's load reads along the innermost row axis
        node = stack.pop()
        if isinstance(node, TensorLoad) and not node.source.same_as(out):
            index = node.indices[-1] if len(node.indices) else None
            if index is None or not index.same_as(last_row):
                return False
        stack.extend(expr_children(node))
    work = loop_nest_work(sch, block)
    red = loops[rows:]
    red_loop = sch.fuse(*red) if len(red) > 1 else red[0]
    chunk = None if work is None else _row_chunk(work // terms, lanes, cores)
    if chunk is not None:  # whole vectors across the rows (a 7 x 7 image: 49 a channel)
        outer, inner = sch.split(sch.fuse(*loops[:rows]), [None, chunk])
        sch.reorder(red_loop, inner)
        spatial = [outer]
    else:
        sch.reorder(red_loop, loops[rows - 1])
        spatial = list(loops[: rows - 1])
    vectorize_innermost(sch, block, lanes)
    parallelize_outer(sch, spatial, cores, work=work)  # before the update loses its init
    init = sch.decompose_reduction(block, red_loop)
    vectorize_innermost(sch, init, lanes)
    sch.unroll(red_loop)
    return True


def _row_chunk(total: int, lanes: int, cores: int) -> int | None:
    """Rows per iteration of the short reduction's parallel loop: the largest ``lanes * 2^j``
    up to :data:`ROW_CHUNK` elements that divides ``total`` and leaves 4 iterations a core;
    None when no multiple of ``lanes`` divides it."""
    if total % lanes:
        return None
    chunk = lanes
    while chunk * 2 <= ROW_CHUNK and total % (chunk * 2) == 0 and total // (chunk * 2) >= 4 * cores:
        chunk *= 2
    return chunk


def _window(sch, block) -> bool:
    """Whether ``block`` reads its input through a window (pooling, a depthwise convolution):
    the window rule's (``window_reduction``), which vectorises the output row. Without a
    padding block before it (SqueezeNet's and GoogLeNet's unpadded max pooling) it came here,
    a scalar loop of 9 maxima per output."""
    return window_reduction(sch, block) is None


MIN_WINDOW_LANES = 4  # a window row shorter than this stays a scalar loop


def _is_window(reduces) -> bool:
    """Two or more reduction iterators (a pooling window's rows and columns), each
    of more than one element."""
    return len(reduces) >= 2 and not any(_unit(iv.dom.extent) for iv in reduces)


def _rfactor_partials(sch: s_tir.Schedule, block, vec):
    """rfactor ``block`` over the reduction loop ``vec`` (its iterations become the partial
    results), the partials' iterator moved last; None if TVM cannot."""
    try:
        rf = sch.rfactor(vec, factor_axis=len(sch.get(block).writes[0].region))
    except Exception as err:  # noqa: BLE001 - not a commutative reducer TVM knows
        logger.debug("rfactor failed: %s", err)
        return None
    # rfactor puts the lanes iterator first; move it last so that, once the block is
    # computed at the row loop, the lanes loop is innermost (vectorisable) and the
    # reduction loop just outside it.
    iter_vars = sch.get(rf).iter_vars
    order = list(range(1, len(iter_vars)))
    spatial = [i for i in order if iter_vars[i].iter_type != iter_vars[i].CommReduce]
    reduce = [i for i in order if iter_vars[i].iter_type == iter_vars[i].CommReduce]
    sch.reorder_block_iter_var(rf, spatial + reduce + [0])
    return rf


class RowReduction(CPURule):
    def apply(self, func, target: Target, tunable: bool):
        if not self.applicable(func, target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or all(info.is_injective() for info in infos):
            return None
        last_iters = sch.get(infos[-1].block_rv).iter_vars
        if (
            last_iters
            and is_reduction(sch, infos[-1].block_rv)
            and all(iv.iter_type == iv.CommReduce or _unit(iv.dom.extent) for iv in last_iters)
        ):
            return self._total_reduction(sch, infos, target)
        if infos[-1].is_injective() and self._one_row(sch, infos):
            return self._single_row(sch, infos, target)
        for info in infos:
            kinds = info.dom_kind()
            if not kinds.startswith("S") or set(kinds) - {"S", "R"}:
                return None
            if not info.is_injective() and "S" in kinds[_leading_s(kinds) :]:
                return None  # a spatial axis after a reduction axis: not a row reduction
        if not infos[-1].is_injective():
            return self._reduction_last(sch, infos, target)
        rows = min(_leading_s(info.dom_kind()) for info in infos)
        if rows == 0:
            return None
        # The rows must be the same loops for every block.
        row_extents = [extent(sch, loop) for loop in sch.get_loops(infos[-1].block_rv)[:rows]]
        for info in infos:
            ext = [extent(sch, loop) for loop in sch.get_loops(info.block_rv)[:rows]]
            if any(str(a) != str(b) for a, b in zip(ext, row_extents, strict=True)):
                return None

        infos = self._inline_injective(sch, infos)
        cores = _target.num_cores(target)
        last = infos[-1].block_rv
        lanes = _target.vector_lanes(target, block_dtype(sch, last))

        # rfactor the reductions first (rfactor needs the block alone under its loops)
        reductions = [i.block_rv for i in infos[:-1] if not i.is_injective()]
        rf_blocks = {}
        for block in reductions:
            if self._is_partials(sch, block, lanes):
                continue  # already split into lanes (legalize._row_reduce)
            rf = self._rfactor(sch, block, lanes)
            if rf is not None:
                rf_blocks[block] = rf

        work = sum(loop_nest_work(sch, i.block_rv) or MIN_PARALLEL_WORK for i in infos)
        loops = sch.get_loops(last)
        row_loop = sch.fuse(*loops[:rows]) if rows > 1 else loops[0]
        paired = _pair_rows(sch, row_loop, loops[rows:], lanes)
        if paired:
            row_loop, _ = sch.split(row_loop, [None, ROW_BLOCK])
        if work >= MIN_PARALLEL_WORK and cores > 1:
            sch.parallel(row_loop)
        if len(loops) > rows:  # else the innermost loop is the row loop (mean with keepdims)
            _vectorize_row(sch, last, lanes)

        for info in reversed(infos[:-1]):
            block = info.block_rv
            sch.compute_at(block, row_loop, preserve_unit_loops=True)
            if block in rf_blocks:
                sch.compute_at(rf_blocks[block], row_loop, preserve_unit_loops=True)

        for info in infos[:-1]:
            block = info.block_rv
            if info.is_injective():
                _vectorize_row(sch, block, lanes)
            elif block in rf_blocks:
                rf = rf_blocks[block]
                _vectorize_rf(sch, rf)
                try:
                    init = sch.get_sblock(sch.get(rf).name_hint + "_init")
                    vectorize_innermost(sch, init, lanes)
                except Exception:  # noqa: BLE001 - init name differs: leave it scalar
                    pass
            else:
                self._schedule_plain_reduction(sch, block, lanes)
        # last: the partition replaces the blocks it splits
        row_buffers = row_buffers_of(sch, infos)
        for info in infos[:-1]:
            if info.is_injective():
                vectorize_with_tail(sch, info.block_rv, lanes)
        if len(loops) > rows:
            vectorize_with_tail(sch, last, lanes)
        return output_as_row_buffer(sch, row_buffers, rows, ROW_BLOCK if paired else 1)

    @staticmethod
    def _is_partials(sch, block, lanes: int) -> bool:
        """A reduction already split like an rfactor block: one reduction iterator after a
        static spatial axis of ``lanes`` partial results (``legalize._row_reduce``)."""
        iters = sch.get(block).iter_vars
        return _is_partial_iters(iters) and int(iters[-2].dom.extent) % lanes == 0

    @staticmethod
    def _schedule_plain_reduction(sch, block, lanes: int) -> None:
        """A reduction that ``rfactor`` did not split.

        Already split like an rfactor block (a static spatial axis of partial results right
        before one reduction axis: how the legalisation writes row reductions over a symbolic
        or an odd static axis, see ``tvm_fusion.lower.legalize._row_reduce``): the reduction loop
        goes outside and the partials axis is vectorised. Any other reduction over a symbolic extent
        gets its init out of the reduction loop, where lowering would put it: the extent may be
        0 (the scalar tail of a row of whole vectors) and the init must run all the same."""
        iters = sch.get(block).iter_vars
        loops = sch.get_loops(block)
        if not iters or iters[-1].iter_type != iters[-1].CommReduce:
            return
        if not RowReduction._is_partials(sch, block, lanes):
            if not is_static(extent(sch, loops[-1])):
                sch.decompose_reduction(block, loops[-1])
            return
        sch.reorder(loops[-1], loops[-2])
        reduce_loop = sch.get_loops(block)[-2]
        accumulators = vectorize_innermost(sch, block, lanes)
        if accumulators is not None:  # several vectors of partials: independent accumulators
            sch.unroll(accumulators)
        sch.decompose_reduction(block, reduce_loop)
        try:
            vectorize_innermost(sch, sch.get_sblock(sch.get(block).name_hint + "_init"), lanes)
        except Exception:  # noqa: BLE001 - init name differs: leave it scalar
            pass

    def _reduction_last(self, sch, infos, target):
        """Plain reductions whose output is the reduction itself (sum/max over rows); injective
        producers are inlined into it (``stack`` before ONNX ``Sum``'s ``sum``). A short
        reduction over terms contiguous along the rows goes outside the rows' vector
        (:func:`_short_reduction`). With producers, only that short reduction is taken: a
        window (pooling, a depthwise convolution behind its padding) is the window rule's."""
        inlined = len(infos) > 1
        if inlined:
            if not all(info.is_injective() for info in infos[:-1]):
                return None
            for info in reversed(infos[:-1]):
                try:
                    sch.compute_inline(info.block_rv)
                except Exception:  # noqa: BLE001 - a producer that stays: not this rule's
                    return None
            infos = infos[-1:]
        info = infos[0]
        rows = _leading_s(info.dom_kind())
        if rows == 0:
            return None
        block = info.block_rv
        lanes = _target.vector_lanes(target, block_dtype(sch, block))
        cores = _target.num_cores(target)
        if _short_reduction(sch, block, rows, lanes, cores):
            return sch
        if inlined:
            return None
        if _window(sch, block):
            return None
        rf = self._rfactor(sch, block, lanes)
        work = loop_nest_work(sch, block)
        loops = sch.get_loops(block)
        parallelize_outer(sch, loops[:rows], cores, work=work)
        if rf is not None:
            sch.compute_at(rf, sch.get_loops(block)[0], preserve_unit_loops=True)
            _vectorize_rf(sch, rf)
        return sch

    @staticmethod
    def _one_row(sch, infos) -> bool:
        """One row (batch-1 logits, a (1, n) softmax): the output's spatial iterators but the
        innermost have extent 1, and so do every reduction's, a lanes axis of partials
        (``legalize._row_reduce``) apart."""
        out_iters = sch.get(infos[-1].block_rv).iter_vars
        if len(out_iters) < 1 or not all(_unit(iv.dom.extent) for iv in out_iters[:-1]):
            return False
        for info in infos[:-1]:
            iters = sch.get(info.block_rv).iter_vars
            spatial = [iv for iv in iters if iv.iter_type != iv.CommReduce]
            if is_reduction(sch, info.block_rv) and spatial:
                # the innermost may be a lanes axis of partials, nothing else: a reduction
                # whose spatial axis is the output's row (a global average pool's channels,
                # the output normalised to (channels,)) reduces many rows
                if not all(_unit(iv.dom.extent) for iv in spatial[:-1]):
                    return False
                reduces = [iv for iv in iters if iv.iter_type == iv.CommReduce]
                if (
                    reduces
                    and not _unit(spatial[-1].dom.extent)
                    and not _is_partial_iters(iters)
                    and _is_window(reduces)
                ):
                    return False
        return True

    def _single_row(self, sch, infos, target):
        """A row reduction over one row: the row rule's schedule without the row loop (every
        block at the root, in order), nothing parallel."""
        infos = self._inline_injective(sch, infos)
        last = infos[-1].block_rv
        lanes = _target.vector_lanes(target, block_dtype(sch, last))
        for info in infos[:-1]:
            block = info.block_rv
            if info.is_injective() and not is_reduction(sch, block):
                _vectorize_row(sch, block, lanes)
            elif (
                not self._is_partials(sch, block, lanes)
                and (rf := self._rfactor(sch, block, lanes)) is not None
            ):
                _vectorize_rf(sch, rf)
            elif is_trivial_reduction(sch, block):
                vectorize_innermost(sch, block, lanes)  # a masked tail vector
            else:
                self._schedule_plain_reduction(sch, block, lanes)
        _vectorize_row(sch, last, lanes)
        row_buffers = row_buffers_of(sch, infos)
        row_dims = len(sch.get(last).iter_vars) - 1
        for info in infos[:-1]:
            if info.is_injective() and not is_reduction(sch, info.block_rv):
                vectorize_with_tail(sch, info.block_rv, lanes)
        vectorize_with_tail(sch, last, lanes)
        return output_as_row_buffer(sch, row_buffers, row_dims, 1)

    def _total_reduction(self, sch, infos, target):
        """A reduction to one value (a loss' mean over the rows), elementwise producers
        before it: the producers inlined, the reduction vectorised by ``rfactor`` where the
        vector width divides it, serial (one value, no rows to share out)."""
        if not all(info.is_injective() for info in infos[:-1]):
            return None
        infos = self._inline_injective(sch, infos)
        block = infos[-1].block_rv
        lanes = _target.vector_lanes(target, block_dtype(sch, block))
        for info in infos[:-1]:
            vectorize_innermost(sch, info.block_rv, lanes)
        rf = self._rfactor(sch, block, lanes)
        if rf is not None:
            _vectorize_rf(sch, rf)
        return sch

    @staticmethod
    def _inline_injective(sch, infos):
        """Inline injective non-output blocks into their consumers where allowed. A costly one
        (more than ``KEEP_EXPR`` nodes) that a reduction and the output both read, softmax's
        ``exp(x - max)``, stays a block: computed once into a row buffer instead of twice
        (softmax 1767 x 1021: 2.3x ORT with the polynomial exp in both)."""
        from ...tir_util import expr_size

        output = sch.get(infos[-1].block_rv).name_hint
        kept = []
        for info in infos[:-1]:
            block = info.block_rv
            if info.is_injective() and not is_reduction(sch, block):
                consumers = sch.get_consumers(block)
                value = sch.get(block).body
                shared = len(consumers) > 1 and any(
                    sch.get(c).name_hint == output for c in consumers
                )
                if shared and expr_size(getattr(value, "value", value), KEEP_EXPR + 1) > KEEP_EXPR:
                    kept.append(info)
                    continue
                if consumers and inline_is_cheap(sch, block, consumers):
                    try:
                        sch.compute_inline(block)
                        continue
                    except Exception:  # noqa: BLE001 - e.g. an output buffer: keep it
                        pass
            kept.append(info)
        kept.append(infos[-1])
        return kept

    @staticmethod
    def _rfactor(sch: s_tir.Schedule, block, lanes: int):
        """Split the innermost reduction loop by ``lanes`` and rfactor it; None if not possible.
        Several static reduction axes whose product no vector divides, the last one of
        ``MIN_WINDOW_LANES`` to 4 vectors long: that last one is the partials."""
        loops = sch.get_loops(block)
        kinds = "".join(
            "R" if iv.iter_type == iv.CommReduce else "S" for iv in sch.get(block).iter_vars
        )
        n_red = kinds.count("R")
        if n_red == 0:
            return None
        red_loops = loops[len(loops) - n_red :]
        exts = [extent(sch, loop) for loop in red_loops]
        if n_red > 1 and all(is_static(e) for e in exts):
            total = 1
            for e in exts:
                total *= int(e)
            if total % lanes and MIN_WINDOW_LANES <= int(exts[-1]) <= 4 * lanes:
                # a window that no vector divides (a global average pool over 13 x 13 or
                # 7 x 7): its last axis gives the partials, one short vector per window row
                # (SqueezeNet's 1000 x 13 x 13 mean: 66 -> 11 us, a scalar chain before)
                return _rfactor_partials(sch, block, red_loops[-1])
        if n_red > 1:
            inner = sch.fuse(*red_loops)
        else:
            inner = red_loops[0]
        ext = extent(sch, inner)
        if not is_static(ext):
            return None
        if ext < 2 * lanes and ext > 1 and _costly_update(sch, block):
            lanes = ext  # a short row: its terms in one vector, see _costly_update
        elif ext < 2 * lanes or ext % lanes:
            return None
        _, vec = sch.split(inner, [None, lanes])
        return _rfactor_partials(sch, block, vec)
