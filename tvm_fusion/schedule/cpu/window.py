"""CPU rule for window reductions: depthwise convolution, max / average pooling (1d, 2d, 3d).

Matches a PrimFunc with exactly one reduction block whose iterators are spatial axes followed
by reduction axes, whose update is ``Y = Y + X * W`` (a convolution), ``Y = Y + X`` (the sum of
an average pool) or ``Y = max(Y, X)`` / ``min`` (pooling), and whose input ``X`` is read through
a window: some index of ``X`` adds a spatial iterator and a reduction iterator (``oh * 2 + ry``).
Every reduction iterator of extent > 1 must be such a window offset, and a weight ``W`` (if any)
must not be read by the innermost spatial axis. That is what the importers emit for
``Conv2d(C, C, k, groups=C)`` (ConvNeXt's 7 x 7) and ``MaxPool`` / ``AvgPool`` in NCHW; a
regular convolution reduces over input channels, not a window, and stays with the Matmul rule
(which is tried first), as do GEMMs and row reductions. Injective blocks before the reduction
(the importers' ``pad_temp`` with its ``if_then_else`` border) and after it (a bias, the average
pool's division, a fused activation) are kept as blocks.

The schedule:

- the spatial axes but the innermost are rows; leading rows are fused and run in parallel
  (``parallelize_outer``), and the padding block is computed under that parallel loop: a padded
  copy of the planes one iteration reads (NCHW: one (n, c) plane, 52 KiB at 112 x 112), no padded
  copy of the whole input, and no ``if_then_else`` in the reduction's loads (inlined, TVM's
  vectoriser scalarises it). The copy's rows and columns are partitioned into the borders and
  the interior, where the condition simplifies away and the copy is a plain loop for LLVM;
- the innermost spatial axis (``ow``, or the channels of a channels-last layout) is the vector
  axis, moved inside the window loops: each step of the window adds one input vector (one
  weight broadcast) to a row of outputs, which stays in L1. A static extent that the vector
  width does not divide gets whole vectors and a vector tail; a symbolic one, or one read with
  a stride (TVM would load each lane apart), is left as one loop for LLVM's loop vectoriser.
  A row with a tail has its init split off first and its whole vectors and tail partitioned
  as plain loops for LLVM: vectorised with the init inside the window loops, TVM scalarised
  the row (depthwise 7 x 7 at 28 wide, single thread: 0.33 -> 0.16 ms). Max pooling with a
  stride over the width is legalised with its input planes deinterleaved
  (:mod:`tvm_fusion.lower.pooling`): a prologue copy whose phases this rule unrolls inside
  its column loop, for LLVM's interleaved loads (``_deinterleave``), and a row read
  contiguously;
- the epilogue blocks are computed at the row loop (the reduction's result is a row buffer)
  and vectorised the same way.

Measured (``scripts/bench_window.py``, bench/window.md): faster than the fallback rule on
every case, the depthwise 7 x 7 by an order of magnitude. Tried and not kept: a register tile
of 8 output rows x 8 lanes for the depthwise convolution (ConvNeXt's 1 x 96 x 56 x 56:
0.2755 against 0.2798 ms for the row of accumulators in L1, the same run); its padding is not
what costs (0.29 ms unpadded on a 62 x 62 input). Max pooling with a width stride
arrives with its input planes split into the stride's phases (lower/pooling.py, CPU targets),
so an output row reads contiguous vectors (ResNet's stem pool 4.3x -> 0.5x ONNX Runtime's
time, loaded); the padded pools' copy keeps its bounds checks.

Skipped (left to the next rule, the reason logged at debug level): more than one reduction
block, a reduction over a non-window axis of extent > 1, other update forms, non-float dtypes.
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.ir.expr import Call
from tvm.target import Target

from ... import target as _target
from ...tir_util import vars_in
from .._common import (
    CPURule,
    block_dtype,
    block_realize,
    covered_by,
    extent,
    is_static,
    loop_nest_work,
    parallelize_outer,
    single_reduction,
    vectorize_innermost,
)
from ._conv import update_operands

logger = logging.getLogger(__name__)

DEINTERLEAVE = "tvm_fusion.deinterleave"  # block annotation of lower.pooling's planes copy


def window_reduction(sch: s_tir.Schedule, block) -> str | None:
    """Why ``block`` is not a window reduction (see the module docstring), or None if it is."""
    stmt = sch.get(block)
    iters = list(stmt.iter_vars)
    kinds = ["R" if iv.iter_type == iv.CommReduce else "S" for iv in iters]
    n_spatial = len(kinds) - len("".join(kinds).lstrip("S"))
    if n_spatial == 0 or "S" in kinds[n_spatial:] or n_spatial == len(kinds):
        return "not spatial axes then reduction axes"
    if str(stmt.writes[0].source.dtype) not in ("float32", "float64", "float16"):
        return "not a float reduction"
    operands = update_operands(stmt.body)
    if operands is None:
        return "update is not a sum, a sum of products or a max / min"
    spatial = {iv.var for iv in iters[:n_spatial]}
    reduce = {iv.var for iv in iters[n_spatial:]}
    window_vars: set = set()
    data = None
    for load in operands:
        for index in load.indices:
            used = vars_in(index)
            if used & spatial and used & reduce:
                window_vars |= used & reduce
                data = load
    if data is None:
        return "no input index adds a spatial and a reduction iterator"
    for iv in iters[n_spatial:]:
        unit = isinstance(iv.dom.extent, tirx.IntImm) and int(iv.dom.extent) == 1
        if iv.var not in window_vars and not unit:
            return f"reduces over {iv.var.name}, which is no window offset"
    inner = iters[n_spatial - 1].var
    for load in operands:
        if load is not data and any(inner in vars_in(i) for i in load.indices):
            return "the weight is read by the innermost spatial axis"
    if not any(inner in vars_in(i) for i in data.indices):
        return "the innermost spatial axis does not index the input"
    return None


def _evaluate(expr, env: dict) -> int | None:
    """``expr`` (adds, multiplies, floor divisions and remainders, casts of iterators and
    constants) at ``env``, else None."""
    if isinstance(expr, tirx.IntImm):
        return int(expr)
    if isinstance(expr, tirx.Var):
        return env.get(expr, 0)
    if isinstance(expr, tirx.Cast):
        return _evaluate(expr.value, env)
    if isinstance(expr, tirx.Add | tirx.Sub | tirx.Mul | tirx.FloorDiv | tirx.FloorMod):
        a, b = _evaluate(expr.a, env), _evaluate(expr.b, env)
        divides = isinstance(expr, tirx.FloorDiv | tirx.FloorMod)
        if a is None or b is None or (divides and b == 0):
            return None
        if isinstance(expr, tirx.Mul):
            return a * b
        if isinstance(expr, tirx.FloorDiv):
            return a // b
        if isinstance(expr, tirx.FloorMod):
            return a % b
        return a + b if isinstance(expr, tirx.Add) else a - b
    return None


def vector_stride(stmt) -> int | None:
    """How far apart in the input two neighbouring outputs of the innermost spatial axis read
    (2 for a pooling of stride 2 over ``ow``); None when it is not a simple product."""
    iters = list(stmt.iter_vars)
    spatial = [iv for iv in iters if iv.iter_type != iv.CommReduce]
    inner = spatial[-1].var
    strides = set()
    for load in update_operands(stmt.body) or []:
        for index in load.indices:
            if inner in vars_in(index):
                one, zero = _evaluate(index, {inner: 1}), _evaluate(index, {})
                strides.add(None if one is None or zero is None else one - zero)
    return strides.pop() if len(strides) == 1 else None


def _border(block, var) -> tuple[int, int] | None:
    """``(lo, hi)`` when ``block`` stores ``if_then_else(... and lo <= var and var < hi ...,
    load, constant)`` (the importers' padding) with static bounds on ``var``."""
    store = block.body
    value = store.value if isinstance(store, tirx.BufferStore) else None
    if not (isinstance(value, Call) and getattr(value.op, "name", "").endswith("if_then_else")):
        return None
    lo = hi = None
    stack = [value.args[0]]
    while stack:
        cond = stack.pop()
        if isinstance(cond, tirx.And):
            stack += [cond.a, cond.b]
        elif isinstance(cond, tirx.LE) and cond.b.same_as(var) and isinstance(cond.a, tirx.IntImm):
            lo = int(cond.a)
        elif isinstance(cond, tirx.LT) and cond.a.same_as(var) and isinstance(cond.b, tirx.IntImm):
            hi = int(cond.b)
    return (lo, hi) if lo is not None and hi is not None else None


def _partition_border(sch: s_tir.Schedule, block) -> bool:
    """Split the two innermost loops of a padding block (a plane's rows and columns) into the
    border before, the interior and the border after (``loop_partition``): in the interior
    rows and columns the conditions of its ``if_then_else`` are provably true and simplify
    away, so the copy of an interior row is a plain loop that LLVM vectorises. With the
    conditions, TVM's vectoriser makes every element a scalar branch, and a row condition
    left in the loop keeps LLVM from vectorising it (ResNet's maxpool 1 x 64 x 112 x 112:
    0.30 ms, 0.09 ms without padding). Replaces the block (the last step for it); False when
    the block has another form (it is left as it was)."""
    loops = sch.get_loops(block)
    stmt = sch.get(block)
    realize = block_realize(sch, block)
    if realize is None:
        return False
    plans = []
    for loop in loops[-2:][::-1]:  # columns first: the rows' partition copies them
        ext = extent(sch, loop)
        loop_var = sch.get(loop).loop_var
        var = next(
            (
                iv.var
                for iv, value in zip(stmt.iter_vars, realize.iter_values, strict=True)
                if value.same_as(loop_var)
            ),
            None,
        )
        bounds = _border(stmt, var) if var is not None and is_static(ext) else None
        if bounds is None:
            continue
        lo, hi = max(bounds[0], 0), min(bounds[1], ext)
        parts = [lo, hi - lo, ext - hi]
        if lo >= hi or parts[0] == 0 and parts[2] == 0:
            continue
        factors = [p for p in parts if p]
        factors[-1] = None
        plans.append((loop, factors))
    done = False
    for loop, factors in plans:
        try:
            sch.loop_partition(loop, factors)
            done = True
        except Exception as err:  # noqa: BLE001 - the copy stays one loop
            logger.debug("window: padding not partitioned: %s", err)
            break
    return done


def _deinterleave(sch: s_tir.Schedule, block) -> bool:
    """The deinterleaved planes of a strided max pool (:mod:`tvm_fusion.lower.pooling`, the
    block annotated ``DEINTERLEAVE``; loops ``(.., phase, column)``): the phase loop moved
    inside and unrolled, so that one iteration of the column loop reads ``stride`` neighbours
    and LLVM's loop vectoriser loads them as contiguous vectors and shuffles them (TVM's
    vectoriser would load the strided vector lane by lane: 2.5x the pool's time at 1 x 64 x
    111 x 111). False (the block untouched) for any other block."""
    if DEINTERLEAVE not in sch.get(block).annotations:
        return False
    loops = sch.get_loops(block)
    if len(loops) < 2 or not is_static(extent(sch, loops[-2])):
        return False
    sch.reorder(loops[-1], loops[-2])
    sch.unroll(loops[-2])
    return True


class WindowReduction(CPURule):
    """Depthwise convolution and pooling on llvm (see module docstring)."""

    def apply(self, func, target: Target, tunable: bool):
        if not self.applicable(func, target):
            return None
        found = single_reduction(func)
        if found is None:
            return None
        sch, infos, at = found
        block = infos[at].block_rv
        # checked on the block as written: normalize_prim_func drops unit iterators, and an
        # output axis of extent 1 leaves its window offset (``ow + rx``) a bare ``rx``
        raw = s_tir.Schedule(func)
        why = window_reduction(raw, raw.get_sblock(sch.get(block).name_hint))
        if why is not None:
            logger.debug("window: %s", why)
            return None
        # A strided vector axis (pooling with stride 2) reads a vector from every other
        # element: TVM's vectoriser loads it lane by lane, LLVM's loop vectoriser with two
        # contiguous loads and a shuffle. Such a loop is left plain for LLVM.
        contiguous = vector_stride(raw.get(raw.get_sblock(sch.get(block).name_hint))) == 1
        prologue = [info.block_rv for info in infos[:at]]
        epilogue = [info.block_rv for info in infos[at + 1 :]]
        if any(not info.is_injective() for info in infos[:at] + infos[at + 1 :]):
            return None
        n_spatial = infos[at].dom_kind().count("S")
        lanes = _target.vector_lanes(target, block_dtype(sch, block))
        cores = _target.num_cores(target)
        work = loop_nest_work(sch, block)
        loops = sch.get_loops(block)
        rows, vec, window = loops[: n_spatial - 1], loops[n_spatial - 1], loops[n_spatial:]
        sch.reorder(*window, vec)
        apart = []  # epilogue blocks left at the root (another domain: a transpose)
        for epi in epilogue:
            # the epilogue at the row loop: the reduction's result is one row
            try:
                if not rows:
                    raise ValueError("no row loop")
                if not covered_by(sch, block, epi):
                    raise ValueError("it writes more than the reduction (a pad)")
                sch.reverse_compute_at(epi, rows[-1], preserve_unit_loops=True)
            except Exception as err:  # noqa: BLE001 - the block keeps its own loops
                logger.debug("window: epilogue block apart: %s", err)
                apart.append(epi)
        parallel = parallelize_outer(sch, rows, cores, work=work) if rows else None
        for pro in reversed(prologue):
            # the padded planes that one parallel iteration reads
            if parallel is not None:
                try:
                    sch.compute_at(pro, parallel, preserve_unit_loops=True)
                except Exception as err:  # noqa: BLE001 - the block stays whole
                    logger.debug("window: prologue not computed at the rows: %s", err)
            if _partition_border(sch, pro) or _deinterleave(sch, pro):
                continue
            self._schedule_spatial(sch, pro, lanes, cores if parallel is None else 1)
        # vectorised before the init is split off: the update block without its init is
        # neither a complete nor a reduction block for schedules (vectorize refuses it)
        first_window = sch.get_loops(block)[-len(window) - 1]
        row = extent(sch, sch.get_loops(block)[-1])
        if contiguous and is_static(row) and row > lanes and row % lanes:
            # whole vectors and a tail: ``_vectorize`` partitions the row (which replaces
            # the block) before the init is split off, and each part keeps the init inside
            # the window loops, a branch that TVM's vectoriser scalarises (a 3 x 3 stride-2
            # pool 55 wide: 6x the time). Here the init goes first and the parts stay plain
            # loops (contiguous, no alias: LLVM vectorises them; TVM refuses to vectorise
            # an update block without its init).
            try:
                sch.decompose_reduction(block, first_window)
                sch.loop_partition(sch.get_loops(block)[-1], [row - row % lanes, None])
            except Exception as err:  # noqa: BLE001
                logger.debug("window: init not split off: %s", err)
        else:
            if contiguous:
                self._vectorize(sch, block, lanes)
            try:
                sch.decompose_reduction(block, first_window)
            except Exception as err:  # noqa: BLE001
                logger.debug("window: init not split off: %s", err)
        for blk in epilogue:
            if any(blk is a for a in apart):
                self._schedule_spatial(sch, blk, lanes, cores)
            else:
                self._vectorize(sch, blk, lanes)
        return sch

    @staticmethod
    def _vectorize(sch, block, lanes: int) -> None:
        """The innermost loop as whole vectors and a vector tail: a static extent that
        ``lanes`` divides is split into vectors; a shorter one is one short vector (LLVM
        computes a 7-lane vector in one register); a longer one is partitioned into the whole
        vectors and the rest (``loop_partition``, which replaces the block: the last step for
        it). A symbolic extent stays one loop, for LLVM's loop vectoriser."""
        loops = sch.get_loops(block)
        if not loops:
            return
        ext = extent(sch, loops[-1])
        if not is_static(ext) or ext < 2:
            return
        if ext % lanes == 0:
            vectorize_innermost(sch, block, lanes)
            return
        try:
            if ext < lanes:
                sch.vectorize(loops[-1])
                return
            head, tail = sch.loop_partition(loops[-1], [ext - ext % lanes, None])
            if ext >= 2 * lanes:
                _, head = sch.split(head, [None, lanes])
            sch.vectorize(head)
            if ext % lanes > 1:
                sch.vectorize(tail)
        except Exception as err:  # noqa: BLE001 - the loop stays whole, for LLVM
            logger.debug("window: no vector tail: %s", err)

    @staticmethod
    def _schedule_spatial(sch, block, lanes: int, cores: int) -> None:
        loops = sch.get_loops(block)
        vectorize_innermost(sch, block, lanes)
        if cores > 1 and len(loops) > 1:
            parallelize_outer(
                sch, sch.get_loops(block)[:-1], cores, work=loop_nest_work(sch, block)
            )
