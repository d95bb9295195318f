"""The row rule's output as its row buffer (``RowReduction``): softmax's ``exp(x - max)``
row stored in the output row itself, where that is provably the same, so that no row buffer is
allocated per row (``output_as_row_buffer``)."""

from __future__ import annotations

import logging

import tvm_ffi
from tvm import s_tir, sym, tirx

from .._common import is_reduction

logger = logging.getLogger(__name__)


def row_buffers_of(sch, kept):
    """The output buffer and the buffers of the kept injective blocks (before the partition
    of ``vectorize_with_tail`` replaces those blocks)."""
    last = sch.get(kept[-1].block_rv)
    out = last.writes[0].source if len(last.writes) == 1 else None
    buffers = []
    for info in kept[:-1]:
        block = sch.get(info.block_rv)
        if info.is_injective() and not is_reduction(sch, info.block_rv) and len(block.writes) == 1:
            buffers.append(block.writes[0].source)
    return out, buffers


def output_as_row_buffer(sch, row_buffers, row_dims: int, rows_per_iteration: int):
    """The schedule with a kept row buffer (softmax's ``exp(x - max)``, see
    ``_inline_injective``) stored in the output instead, as ONNX Runtime's softmax does: the
    exp pass writes the output row, the sum reads it back, the output block scales it in
    place. A row buffer longer than 1024 bytes is otherwise allocated through
    ``TVMBackendAllocWorkspace`` once per row (TVM's limit for stack allocations): softmax
    1767 x 1021 ran 1.2-1.5x ORT with that. Sound when the output block reads the buffer only
    where it writes, nothing reads the output, every other access of the buffer comes before
    the output's first store, and an iteration of the row loop touches its own rows only
    (the compacted buffer holds ``rows_per_iteration`` rows); else ``sch`` unchanged."""
    from ...tir_util import replace_buffer

    out, buffers = row_buffers
    func = sch.mod["main"]
    root = getattr(func.body, "block", None)
    if out is None or root is None or not any(p.same_as(out) for p in func.params):
        return sch
    analyzer = sym.Analyzer()
    for buf in buffers:
        if not any(b.same_as(buf) for b in root.alloc_buffers) or buf.dtype != out.dtype:
            continue
        if len(buf.shape) != len(out.shape) or not all(
            analyzer.can_prove_equal(a, b) for a, b in zip(buf.shape, out.shape, strict=True)
        ):
            continue
        if sharing_is_sound(func, buf, out, row_dims, rows_per_iteration):
            return s_tir.Schedule(replace_buffer(func, buf, out))
    return sch


def sharing_is_sound(func, buf, out, row_dims: int, rows_per_iteration: int) -> bool:
    from ...tir_util import compacted_allocations, iter_stmts, loads_of

    def same(a, b) -> bool:
        return len(a) == len(b) and all(
            tvm_ffi.structural_equal(x, y, map_free_vars=False) for x, y in zip(a, b, strict=True)
        )

    output_started = False
    for stmt in iter_stmts(func.body):
        if not isinstance(stmt, tirx.BufferStore):
            continue
        if loads_of(stmt.value, out) or any(loads_of(i, out) for i in stmt.indices):
            logger.debug("output as row buffer: the output is read")
            return False
        reads = loads_of(stmt.value, buf)
        if stmt.buffer.same_as(out):
            if not all(same(load.indices, stmt.indices) for load in reads):
                logger.debug("output as row buffer: read elsewhere than written")
                return False
            output_started = True
        elif output_started and (reads or stmt.buffer.same_as(buf)):
            logger.debug("output as row buffer: accessed after the output's first store")
            return False
    if not output_started:
        return False
    compacted = [b for b in compacted_allocations(func) if b.name == buf.name]
    if len(compacted) != 1:
        return False
    count = 1
    for dim in compacted[0].shape[:row_dims]:
        if not isinstance(dim, tirx.IntImm):
            return False
        count *= int(dim)
    if count != rows_per_iteration:
        logger.debug("output as row buffer: %d rows an iteration", count)
        return False
    return True
