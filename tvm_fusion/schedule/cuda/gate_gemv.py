"""The split-K GEMV schedule of the CUDA gate rule (:mod:`.gate_fusion`): few static rows.

See :func:`_schedule_gemv`; :func:`gemv_or_none` is what :class:`.gate_fusion.GateFusion`
calls.
"""

from __future__ import annotations

import logging

import tvm
from tvm import s_tir
from tvm.s_tir.dlight.analysis import normalize_prim_func

from ...tir_util import expr_children, loads_of
from .._common import extent, is_reduction, is_static, try_inline_safe

logger = logging.getLogger(__name__)

TU = 4  # units per thread (one float4 of the blocked weight per gate)
ACC_BUDGET = 48  # accumulators per thread (all GEMMs of the kernel live at once)
GEMV_SPLITS = (32, 64, 128)  # threads splitting K in the split-K GEMV, when tuned


def vector(elem: int) -> int:
    """Elements of ``elem`` bytes per 128-bit copy: 4 floats, 8 halves."""
    return 16 // elem


def sample(sch: s_tir.Schedule, options: list):
    """One of ``options``, chosen by a ``sample_categorical`` decision of ``sch`` (uniform): a
    decision MetaSchedule samples anew for each candidate and records in its trace."""
    if len(options) == 1:
        return options[0]
    pick = sch.sample_categorical(list(range(len(options))), [1 / len(options)] * len(options))
    return options[int(sch.get(pick))]


def elem_bytes(buf) -> int:
    return tvm.DataType(str(buf.dtype)).bits // 8


def gemv_or_none(func, params, tunable=False):
    """The split-K GEMV schedule of ``func`` from scratch, None when it does not apply."""
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    reductions = [i.block_rv for i in infos if is_reduction(sch, i.block_rv)]
    others = [i for i in infos if not is_reduction(sch, i.block_rv)]
    remaining = [i.block_rv for i in try_inline_safe(sch, others)]
    finals = [b for b in remaining if any(w.source in params for w in sch.get(b).writes)]
    inner = [b for b in remaining if b not in finals]
    try:
        return _schedule_gemv(sch, reductions, finals, inner, tunable)
    except Exception as err:  # noqa: BLE001 - not the expected form: the few-rows schedule
        logger.debug("gate fusion (cuda): split-K GEMV failed: %s", str(err)[:300])
        return None


def _schedule_gemv(sch: s_tir.Schedule, reductions, finals, inner, tunable=False):
    """Few static rows: a thread block per ``TU`` units (and per ``RT`` rows); its ``KS``
    threads split ``K`` (thread ``t`` takes ``k = t, t + KS, ...``: a warp reads one contiguous
    run of the blocked weight, each thread ``gates`` float4 per step), each keeping ``RT x gates
    x TU`` partial sums in registers (rfactor); then one cross-thread reduction per sum (warp
    shuffles, then shared memory across warps) and the gate math on the block's units.

    Half-precision weights: a thread's ``gates x TU`` halves of one ``k`` (8 bytes a gate) are
    read as 16-byte loads of 8 halves where they are whole vectors (an even number of gates:
    LSTM), else as 8-byte loads per gate (GRU's 3 gates: taking two consecutive ``k`` per
    thread would make whole vectors, but TVM 0.27's CUDA codegen then writes the vector's
    index as an 8-lane int64 vector, ``make_longlong4`` with 8 arguments, that nvcc rejects)."""
    *row_loops, unit_loop = sch.get_loops(finals[0])
    gemm_gates = []
    k_max = 0
    for red in reductions:
        stmt = sch.get(red)
        shape = stmt.writes[0].source.shape
        gemm_gates.append(int(shape[-3]))
        k_max = max(
            k_max, *(int(iv.dom.extent) for iv in stmt.iter_vars if iv.iter_type == iv.CommReduce)
        )
    ks = 64 if k_max >= 64 * 8 else 32
    if gathered(sch, reductions):
        # pad_einsum refuses W[ids[row], ...]: the most threads up to ks that divide every K
        ks = max(t for t in (64, 32, 16, 8, 4, 2, 1) if t <= ks and not _k_rest(sch, reductions, t))
    elif tunable:  # MetaSchedule chooses the split (the default first)
        ks = sample(sch, [ks, *(v for v in GEMV_SPLITS if v != ks and v <= max(k_max, 32))])
    # split K over the threads first: rfactor wants the reduction first in its loop nest; a K
    # that the threads do not divide is padded with zeros (no predicate in the partial sums)
    factored, pads = [], []
    for red in reductions:
        stmt = sch.get(red)
        k_ext = [int(iv.dom.extent) for iv in stmt.iter_vars if iv.iter_type == iv.CommReduce]
        if k_ext[0] % ks:
            before = {sch.get(b).name_hint for b in sch.get_consumers(red)}
            factors = [ks if iv.iter_type == iv.CommReduce else 1 for iv in stmt.iter_vars]
            sch.pad_einsum(red, factors)
            pads += list(sch.get_producers(red))
            for cut in sch.get_consumers(red):
                if sch.get(cut).name_hint not in before:
                    sch.compute_inline(cut)
        *_, k_loop = sch.get_loops(red)
        _, kt = sch.split(k_loop, [None, ks])
        factored.append((red, sch.rfactor(kt, 0)))
    bx, tu = sch.split(unit_loop, [None, TU])
    sch.bind(bx, "blockIdx.x")
    if row_loops:  # a single row may have no loop left
        rows = sch.fuse(*row_loops) if len(row_loops) > 1 else row_loops[0]
        ext = extent(sch, rows)  # symbolic (gathered expert weights only): a row a block
        rt = max(1, min(ext, ACC_BUDGET // (sum(gemm_gates) * TU))) if is_static(ext) else 1
        by, ri = sch.split(rows, [None, rt])
        sch.reorder(bx, by, ri, tu)
        sch.bind(by, "blockIdx.y")
    else:
        by = bx
    loops = [sch.get(loop) for loop in sch.get_loops(finals[0])]
    depth = next(i for i, loop in enumerate(loops) if loop.same_as(sch.get(by))) + 1
    for other in reversed(inner):
        sch.compute_at(other, by, preserve_unit_loops=True)
        sch.set_scope(other, 0, "local")
    for red, rf in factored:
        sch.compute_at(red, by, preserve_unit_loops=True)
        sch.set_scope(red, 0, "local")
        sch.compute_at(rf, by, preserve_unit_loops=True)
        kt_rf, *acc, ko_rf = sch.get_loops(rf)[depth:]
        sch.reorder(kt_rf, ko_rf, *acc)
        sch.bind(kt_rf, "threadIdx.x")
        sch.set_scope(rf, 0, "local")
        for loop in acc:
            sch.unroll(loop)
        # the weights of one k: gates x TU contiguous elements, read as float4 (halves: as
        # 16-byte vectors where gates x TU is a multiple of 8, else 8 bytes a gate)
        reads = sch.get(rf).reads
        weight = max(range(len(reads)), key=lambda i: len(reads[i].source.shape))
        width = vector(elem_bytes(reads[weight].source))
        if _indirect(sch.get(rf), reads[weight].source):
            # a gathered expert weight, W[ids[row], ...]: a cache of it would span every
            # expert (its region is not bounded by the loops); the units of one k are read
            # straight into the partial sums, TU at a time (float4; halves 8 bytes a gate)
            if extent(sch, acc[-1]) == TU:
                sch.vectorize(acc[-1])
            sch.decompose_reduction(rf, ko_rf)
            _write_back(sch, red, depth)
            continue
        cache = sch.cache_read(rf, weight, "local")
        sch.compute_at(cache, ko_rf, preserve_unit_loops=True)
        *_, vec = sch.get_loops(cache)
        run = sch.get_loops(cache)[-2:]  # gate, unit
        total = [extent(sch, loop) for loop in run]
        if width > TU and all(isinstance(e, int) for e in total) and total[0] * total[1] % width:
            run = []  # halves of an odd number of gates: 8 bytes a gate
        if extent(sch, vec) == width:
            sch.vectorize(vec)
        elif width > TU and run:  # halves: (gate, unit) fused into 16-byte vectors
            sch.vectorize(sch.split(sch.fuse(*run), [None, width])[1])
        elif extent(sch, vec) == TU:
            sch.vectorize(vec)
        sch.decompose_reduction(rf, ko_rf)
        _write_back(sch, red, depth)
    for pad in pads:  # read in place, zeros past K
        sch.compute_inline(pad)
    return sch


def _write_back(sch: s_tir.Schedule, red, depth: int) -> None:
    """The write-back of a factored sum: one cross-thread reduction per partial sum."""
    wb_loops = sch.get_loops(red)[depth:]
    ivs = sch.get(red).iter_vars
    (kt_wb,) = [
        loop for loop, iv in zip(wb_loops, ivs, strict=True) if iv.iter_type == iv.CommReduce
    ]
    spatial = [loop for loop in wb_loops if not sch.get(loop).same_as(sch.get(kt_wb))]
    sch.reorder(*spatial, kt_wb)
    sch.bind(kt_wb, "threadIdx.x")


def _k_rest(sch: s_tir.Schedule, reductions, threads: int) -> bool:
    """Whether ``threads`` leaves a remainder of some GEMM's ``K``."""
    for red in reductions:
        for iv in sch.get(red).iter_vars:
            if iv.iter_type == iv.CommReduce and int(iv.dom.extent) % threads:
                return True
    return False


def gathered(sch: s_tir.Schedule, reductions) -> bool:
    """Whether a GEMM of the kernel reads its weight per row through an index buffer
    (FuseGatheredGates' ``W[ids[row], ...]``)."""
    for red in reductions:
        block = sch.get(red)
        own = [w.source for w in block.writes]
        for region in block.reads:
            buf = region.source
            if not any(buf.same_as(o) for o in own) and _indirect(block, buf):
                return True
    return False


def _indirect(block, buf) -> bool:
    """Whether ``block`` reads ``buf`` at an index that loads from another buffer (a gathered
    expert weight ``W[ids[row], ...]``)."""
    from tvm.ir.expr import TensorLoad

    value = getattr(block.body, "value", None)
    if value is None:
        return False
    return any(
        isinstance(node, TensorLoad)
        for load in loads_of(value, buf)
        for index in load.indices
        for node in _subexprs(index)
    )


def _subexprs(expr) -> list:
    out, stack = [], [expr]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(expr_children(node))
    return out
