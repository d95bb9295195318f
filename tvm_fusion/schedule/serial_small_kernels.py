"""SerialSmallKernels: a CPU kernel with little work runs on the calling thread, decided at run time
where its extents are symbolic.

Every ``T.parallel`` loop is a launch on TVM's thread pool, which partitions the loop statically:
the calling thread runs its share, then waits for each worker to run its own. Quiet, that costs a
few microseconds; when another runtime's threads (torch/OpenMP, ONNX Runtime) or another process
share the cores, the worker runs only when the OS gives it a time slice, once per launch (issue
#37: a small dynamic LSTM export at 739x its quiet time beside a busy torch thread). The rules
leave a static nest of less than :data:`~._common.MIN_PARALLEL_WORK` iterations serial; with
symbolic extents they cannot know, and parallelise.

This pass runs after the rules, on every scheduled PrimFunc that has a parallel loop:

- it counts each parallel loop's work per launch: the iterations of its innermost statements
  (each loop's extent times its body's, summed over sequences, both branches of an ``if``;
  vector lanes count), as an expression of the function's shape variables;
- the threshold is the kernel's class: :data:`SERIAL_BELOW` for elementwise and row kernels,
  :data:`SERIAL_BELOW_DENSE` for GEMMs, convolutions and attention (several multiply-adds per
  load, on registers), both measured (bench/neighbours.md);
- every launch static and under it: the parallel loops become serial;
- symbolic: ``if every launch < threshold`` runs a serial copy of the body, else the body as
  scheduled. The copy's variables and buffers are fresh (``s_tir.RenewDefs``), its parameters
  bound to the function's by ``match_buffer`` (its shape variables and scalar parameters by
  ``Bind``), so that the two bodies share nothing and each one's buffers are allocated inside
  its own loops; a kernel written without blocks (attention) gets its copy renamed by
  ``ConvertSSA``. The condition is stored to a one-element buffer and read back: TVM's
  simplifier, told it directly, bounds the shape variables by it and can stop the build;
- anything it cannot count (a ``while``, an extent that reads a loop or data variable), and a
  kernel whose launches reach the threshold at extents of 1, are left as the rules scheduled
  them.

Cost: the symbolic kernels are compiled twice (about +50% compile time for a dynamic transformer
export, measured on GPT-2's: 4.1 -> 6.2-7.4 s).
"""

from __future__ import annotations

import functools
import logging

import tvm
import tvm_ffi
from tvm import s_tir, sym, tirx

from ..tir_util import expr_children, iter_stmts, rebuilt_for, vars_in

logger = logging.getLogger(__name__)

ATTR = "tvm_fusion.serial_below"
RULE_ATTR = "tvm_fusion.schedule_rule"  # as schedule/__init__.py writes it
# Work per launch (innermost iterations, vector lanes counted) below which a parallel loop runs
# serially: see bench/neighbours.md for how it was chosen.
SERIAL_BELOW = 4096
# The same for dense kernels (GEMMs, convolutions, attention: fused multiply-adds on registers,
# several per load), whose work goes faster per iteration than an elementwise kernel's.
SERIAL_BELOW_DENSE = 524288
DENSE_RULES = ("Matmul", "GateFusion", "GroupedConv")
# Set by hand-written dense kernels (lower/attention.py) that no rule schedules.
DENSE_ATTR = "tvm_fusion.dense_kernel"


def threshold_of(func: tirx.PrimFunc) -> int:
    """:data:`SERIAL_BELOW_DENSE` for a dense kernel (its rule or :data:`DENSE_ATTR`), else
    :data:`SERIAL_BELOW`."""
    attrs = func.attrs or {}
    dense = str(attrs.get(RULE_ATTR, "")) in DENSE_RULES or bool(attrs.get(DENSE_ATTR, False))
    return SERIAL_BELOW_DENSE if dense else SERIAL_BELOW


_LEAVES = (tirx.BufferStore, tirx.Evaluate, tirx.Bind, tirx.DeclBuffer, tirx.AllocBuffer)
# The statement kinds the pass was written and tested for; a kernel with another is left alone.
_KNOWN = (
    *_LEAVES,
    tirx.For,
    tirx.SeqStmt,
    tirx.IfThenElse,
    tirx.AttrStmt,
    s_tir.SBlock,
    s_tir.SBlockRealize,
)


# Pragmas of a hand-written parallel region (lower/rnn_loop.py: one launch for a whole
# sequence, a join per step); with no parallel loop left under them, codegen fails ("Cannot
# find parallel loop within parallel launch"), so the serial copy drops them.
_LAUNCH_PRAGMAS = ("pragma_parallel_launch_point", "pragma_parallel_barrier_when_finish")


def _serial_copy(stmt):
    """``stmt`` with its parallel loops serial and their launch pragmas dropped
    (``tvm_ffi.structural_map``, as :func:`~tvm_fusion.tir_util.replace_buffer` rebuilds TIR)."""

    def on_attr(attr):
        return attr.body if str(attr.attr_key) in _LAUNCH_PRAGMAS else attr

    def on_for(loop):
        if loop.kind != tirx.ForKind.PARALLEL:
            return loop
        return rebuilt_for(loop, kind=tirx.ForKind.SERIAL)

    return tvm_ffi.structural_map(stmt, [(tirx.For, on_for), (tirx.AttrStmt, on_attr)])


def _work(stmt):
    """Iterations of the innermost statements under ``stmt`` (an expression); None when a loop
    has a step or a statement kind is not counted."""
    if stmt is None:
        return 0
    if isinstance(stmt, _LEAVES):
        return 1 if isinstance(stmt, tirx.BufferStore | tirx.Evaluate) else 0
    if isinstance(stmt, tirx.For):
        if stmt.step is not None and not (isinstance(stmt.step, tirx.IntImm) and stmt.step == 1):
            return None
        inner = _work(stmt.body)
        return None if inner is None else stmt.extent * inner
    if isinstance(stmt, tirx.SeqStmt):
        parts = [_work(s) for s in stmt.seq]
        return None if any(p is None for p in parts) else sum(parts[1:], parts[0])
    if isinstance(stmt, s_tir.SBlockRealize):
        return _work(stmt.block)
    if isinstance(stmt, s_tir.SBlock | tirx.IfThenElse):
        first = stmt.body if isinstance(stmt, s_tir.SBlock) else stmt.then_case
        second = stmt.init if isinstance(stmt, s_tir.SBlock) else stmt.else_case
        a, b = _work(first), _work(second)
        return None if a is None or b is None else a + b
    if isinstance(stmt, tirx.AttrStmt):
        return _work(stmt.body)
    return None


def _is_buffer(param) -> bool:
    return isinstance(getattr(param, "ty", None), tirx.BufferType)


def _free_vars(func: tirx.PrimFunc) -> set:
    """The variables a function's parameters define (shape variables, scalar parameters)."""
    found = set()
    for param in func.params:
        if _is_buffer(param):
            for expr in [*param.shape, *param.strides, param.elem_offset]:
                found |= vars_in(expr)
        else:
            found.add(param)
    return found


def _least(work) -> int:
    """``work`` with every shape variable 1: when that reaches the threshold, the serial path
    is never taken (a GEMM's 16-row tile), and TVM's simplifier, told ``work < threshold``,
    would find its divisors zero ("Find divide by zero")."""
    analyzer = sym.Analyzer()
    for var in vars_in(work):
        analyzer.bind(var, tirx.IntImm(var.ty.dtype, 1))
    least = analyzer.simplify(work)
    return int(least) if isinstance(least, tirx.IntImm) else 1 << 62


def _pair_vars(new, old, pairs: dict) -> None:
    """The variables of ``new`` mapped to those at the same place in ``old`` (the same
    expression, its variables renewed)."""
    if isinstance(new, tirx.Var) and isinstance(old, tirx.Var):
        pairs.setdefault(new, old)
        return
    for a, b in zip(expr_children(new), expr_children(old), strict=True):
        _pair_vars(a, b, pairs)


def _bound_copy(func: tirx.PrimFunc, serial):
    """``serial`` with fresh definitions (``s_tir.RenewDefs``), its parameters bound to
    ``func``'s: its shape variables and scalar parameters by ``Bind``, its buffers by
    ``match_buffer`` over the whole of ``func``'s (the extents written with the fresh
    variables, so that a shape ``n - n // 2`` matches itself)."""
    fresh = tvm_ffi.get_global_func("s_tir.RenewDefs")(func.with_body(serial))
    pairs: dict = {}
    matches = []
    for new, old in zip(fresh.params, func.params, strict=True):
        if not _is_buffer(old):
            pairs.setdefault(new, old)
            continue
        for a, b in zip(
            [*new.shape, *new.strides, new.elem_offset],
            [*old.shape, *old.strides, old.elem_offset],
            strict=True,
        ):
            _pair_vars(a, b, pairs)
        region = [tvm.ir.Range.from_min_extent(0, d) for d in new.shape]
        matches.append(s_tir.MatchBufferRegion(new, tirx.BufferRegion(old, region)))
    inner = s_tir.SBlock([], [], [], "serial", fresh.body, None, [], matches)
    binds = [tirx.Bind(new, old) for new, old in pairs.items()]
    return tirx.SeqStmt([*binds, s_tir.SBlockRealize([], True, inner)])


def _launch_works(func: tirx.PrimFunc) -> list | None:
    """The work of each parallel loop, per launch (its extent times its body's), simplified;
    None where one is not countable from the function's parameters alone."""
    free, analyzer, works = _free_vars(func), sym.Analyzer(), []
    for stmt in iter_stmts(func.body):
        if isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.PARALLEL:
            work = _work(stmt)
            if work is None:
                return None
            work = analyzer.simplify(work)
            if not vars_in(work) <= free:
                return None
            works.append(work)
    return works


def serialize_small(func: tirx.PrimFunc, threshold: int | None = None) -> tirx.PrimFunc:
    """``func`` with a serial path where every parallel loop has less work than ``threshold``
    (default :func:`threshold_of`) per launch (see the module's text)."""
    threshold = threshold_of(func) if threshold is None else threshold
    works = _launch_works(func)
    if not works:
        return func
    if any(_least(w) >= threshold for w in works):
        return func  # a launch with enough work at the smallest shapes: parallel as scheduled
    if not all(isinstance(s, _KNOWN) for s in iter_stmts(func.body)):
        return func
    serial = _serial_copy(func.body)
    symbolic = [w for w in works if not isinstance(w, tirx.IntImm)]
    if not symbolic:
        return func.with_body(serial)
    # The condition goes through a one-element buffer: TVM's simplifier, told the condition
    # itself (or a variable bound to it), bounds the shape variables by it and can find a tile
    # count's divisor zero ("Find divide by zero") where only empty extents reach the serial
    # path; it does not follow a buffer's contents.
    flag = tirx.decl_buffer((1,), "int32", name="serial", scope="local", layout=None)
    cond = functools.reduce(tirx.And, [w < threshold for w in symbolic])
    store = tirx.BufferStore(flag, tirx.Cast("int32", cond), [0])
    taken = tirx.BufferLoad(flag, [0]) != 0
    if not isinstance(func.body, s_tir.SBlockRealize):
        # Written without blocks (lower/attention.py): its buffers are allocated in place, and
        # ConvertSSA gives the copy's loop variables and allocations their own definitions.
        branch = tirx.IfThenElse(taken, serial, func.body)
        new = func.with_body(tirx.SeqStmt([tirx.AllocBuffer(flag), store, branch]))
        new = tirx.transform.ConvertSSA()(tvm.IRModule({"main": new}))["main"]
        return new.with_attr(ATTR, threshold)
    try:
        serial_body = _bound_copy(func, serial)
    except RuntimeError as err:  # a parameter the copy cannot be bound to
        logger.debug("SerialSmallKernels: kept %s parallel: %s", func, err)
        return func
    branch = tirx.IfThenElse(taken, serial_body, func.body)
    root = s_tir.SBlock([], [], [], "root", tirx.SeqStmt([store, branch]), None, [flag], [], None)
    new = func.with_body(s_tir.SBlockRealize([], True, root)).with_attr(ATTR, threshold)
    return new


def _called(mod: tvm.IRModule) -> set:
    """The GlobalVars the module's Relax functions refer to (a reshape kernel that the stock
    RewriteDataflowReshape made a view is left uncalled: not worth a copy)."""
    from tvm import relax

    found: set = set()

    def visit(expr):
        if isinstance(expr, relax.GlobalVar):
            found.add(expr)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return found


@tvm.transform.module_pass(opt_level=0, name="SerialSmallKernels")
class SerialSmallKernels:
    """:func:`serialize_small` on every PrimFunc of the module (CPU builds)."""

    def __init__(self, threshold: int | None = None):
        self.threshold = threshold

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        changed, called = {}, _called(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and gv in called:
                new = serialize_small(func, self.threshold)
                if not new.same_as(func):
                    changed[gv] = new
        if not changed:
            return mod
        functions = {gv: changed.get(gv, func) for gv, func in mod.functions_items()}
        return tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)
