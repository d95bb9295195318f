"""Matching for :class:`~.fuse_cross_entropy.FuseCrossEntropy`: which ``log_softmax`` the
fused kernel can replace, and how each reader of it is served.

:func:`plans` returns a :class:`Plan` for every ``L = log_softmax(x)`` (spellings read by
:mod:`._cross_entropy_spellings`) all of whose readers are forms the kernel's columns serve (the
list is in the pass's module docstring); each reader becomes a :class:`Use`. A log-softmax
with any other reader, or whose kernel inputs do not exist at its first reader, gets no plan
and its reason is logged at debug level (under the pass's logger). :func:`weight_picks` finds
PyTorch's gathers of broadcast class weights, which the pass rewrites beside a fused
log-softmax. Nothing here changes the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm import relax, tirx

from ._common import get_logger, op_name, prove_equal_shapes, skip, vars_in
from ._cross_entropy_spellings import log_softmax_source, unwrap_negative_index

# the pass's logger: a log-softmax left alone is reported as FuseCrossEntropy's
logger = get_logger("tvm_fusion.transform.fuse_cross_entropy")
_FLOATS = ("float32", "float16", "bfloat16")


def _consumers(func: relax.Function) -> dict:
    """``var -> [(binding var or None, value)]``: every binding (or the function's result, with
    ``None``) that reads ``var``, once per occurrence."""
    out: dict = {}
    body = func.body
    for block in body.blocks:
        for binding in block.bindings:
            for var in vars_in(binding.value):
                out.setdefault(var, []).append((binding.var, binding.value))
    for var in vars_in(body.body):
        out.setdefault(var, []).append((None, body.body))
    return out


@dataclass
class Use:
    """One reader of the log-probabilities ``L``, and what it becomes."""

    kind: str  # gather | nll | rowsum | rowmean | onehot | wsum | wgather | shape
    var: relax.Var  # the binding of the replaced call
    call: relax.Call  # the call that is replaced (the sum or gather, for the multiply forms)
    keepdims: bool = False
    weights: relax.Expr | None = None  # wgather: the (V,) or (1, V) class weights


@dataclass
class Plan:
    """Every use of one ``L = log_softmax(x)``: one kernel serves them all."""

    lsm: relax.Var
    x: relax.Expr
    uses: list = field(default_factory=list)
    pick: tuple | None = None  # ("gather", idx (N, 1)) or ("vector", t (N,))
    weights: relax.Expr | None = None  # (V,) or (1, V): the weighted row sum's weights
    row_sum: bool = False
    columns: dict | None = None  # emitted: column name -> (N,) float32 var
    wraps: bool = False  # the pick's negative targets count from the end (ONNX indices)


def plans(func: relax.Function) -> list:
    """A plan for every ``log_softmax`` all of whose uses the kernel's columns can serve."""
    var2val = relax.analysis.get_var2val(func)
    consumers = _consumers(func)
    order: dict = {param: -1 for param in func.params}
    position = 0
    for block in func.body.blocks:
        for binding in block.bindings:
            order[binding.var] = position
            position += 1
    found = []
    for lsm, value in var2val.items():
        source = log_softmax_source(lsm, value, var2val, consumers)
        if source is not None:
            plan = _plan(lsm, *source, var2val, consumers, order)
            if plan is not None:
                found.append(plan)
    return found


def _plan(lsm, x, axis, var2val, consumers, order) -> Plan | None:
    what = f"log_softmax {lsm.name}"
    sinfo = x.ty
    if not isinstance(sinfo, relax.TensorType) or sinfo.ndim != 2:
        return _leave(what, "logits are not 2-D (N, V)")
    if str(sinfo.dtype) not in _FLOATS:
        return _leave(what, f"logits of dtype {sinfo.dtype}")
    if axis % 2 != 1:
        return _leave(what, "log_softmax over another axis than the classes")
    if not isinstance(sinfo.shape, relax.ShapeExpr):
        return _leave(what, "logits of unknown shape")
    n, v = sinfo.shape.values
    plan = Plan(lsm, x)
    uses = consumers.get(lsm, [])
    if not uses:
        return _leave(what, "unused")
    for bvar, use_value in uses:
        reason = _add_use(plan, bvar, use_value, n, v, consumers, var2val)
        if reason:
            return _leave(what, reason)
    # the kernel is emitted at the first use that reads it: its inputs must exist there
    reads = [order[use.var] for use in plan.uses if use.kind != "shape"]
    if not reads:
        return _leave(what, "only its shape is read")
    first = min(reads)
    operands = [plan.pick[1] if plan.pick else None, plan.weights]
    operands += [use.weights for use in plan.uses]
    for operand in operands:
        if isinstance(operand, relax.Var) and order.get(operand, first) >= first:
            return _leave(what, f"{operand.name} is computed after the first use")
    return plan


def _int_tensor(expr, ndim: int) -> bool:
    sinfo = expr.ty
    return (
        isinstance(sinfo, relax.TensorType)
        and sinfo.ndim == ndim
        and str(sinfo.dtype).startswith(("int", "uint"))
    )


def _set_pick(plan: Plan, pick: tuple) -> str | None:
    if plan.pick is None:
        plan.pick = pick
        return None
    if plan.pick[0] != pick[0] or not plan.pick[1].same_as(pick[1]):
        return "the uses pick different targets"
    return None


def _row_axis(call: relax.Call) -> bool:
    axis = call.attrs.axis
    return axis is not None and len(axis) == 1 and int(axis[0]) % 2 == 1


def _add_use(plan: Plan, bvar, value, n, v, consumers, var2val) -> str | None:
    """Record one use of ``L``; a reason when the kernel cannot serve it."""
    name = op_name(value)
    lsm = plan.lsm
    if bvar is None:
        return "the log-probabilities are returned"
    if sum(1 for arg in vars_in(value) if arg.same_as(lsm)) != 1:
        return f"{name} reads the log-probabilities twice"
    if name == "relax.shape_of":
        plan.uses.append(Use("shape", bvar, value))
        return None
    if name == "relax.gather_elements":
        reason = _gather_reason(value, lsm, n)
        if reason:
            return reason
        plan.uses.append(Use("gather", bvar, value))
        return _set_pick(plan, _gather_pick(plan, value.args[1], v, var2val))
    if name == "relax.nn.nll_loss":
        t = value.args[1]
        if not value.args[0].same_as(lsm) or not _int_tensor(t, 1):
            return "nll_loss targets are not (N,) integers"
        if str(value.attrs.reduction) not in ("none", "sum", "mean"):
            return f"unknown reduction {value.attrs.reduction!r}"
        plan.uses.append(Use("nll", bvar, value))
        return _set_pick(plan, ("vector", t))
    if name in ("relax.sum", "relax.mean"):
        if not _row_axis(value):
            return f"{name} not over the classes alone"
        if not isinstance(v, tirx.IntImm):
            return "a row sum over a symbolic number of classes"
        kind = "rowsum" if name == "relax.sum" else "rowmean"
        plan.row_sum = True
        plan.uses.append(Use(kind, bvar, value, bool(value.attrs.keepdims)))
        return None
    if name == "relax.multiply":
        return _add_product(plan, bvar, value, n, v, consumers, var2val)
    return f"used by {name or type(value).__name__}"


def _add_product(plan: Plan, bvar, value, n, v, consumers, var2val) -> str | None:
    """``L * m`` read by one row sum (``m`` a one-hot of the targets, or class weights) or by a
    gather of the target column (``m`` class weights: PyTorch's weighted ``nll_loss``)."""
    a, b = value.args
    other = b if a.same_as(plan.lsm) else a
    readers = consumers.get(bvar, [])
    if len(readers) != 1 or readers[0][0] is None:
        return "L * m is used other than by one row sum or gather"
    reader_var, reader = readers[0]
    hot = var2val.get(other) if isinstance(other, relax.Var) else None
    if op_name(hot) == "relax.one_hot":
        if op_name(reader) != "relax.sum" or not _row_axis(reader):
            return "L * one_hot is not summed over the classes"
        t = hot.args[0]
        on, off = hot.args[1], hot.args[2]
        if not _int_tensor(t, 1) or int(hot.attrs.axis) not in (-1, 1):
            return "one_hot of other targets than (N,) integers"
        if not (_prim_is(on, 1) and _prim_is(off, 0) and _equal(hot.attrs.depth, v)):
            return "one_hot is not 1/0 over the V classes"
        plan.uses.append(Use("onehot", reader_var, reader, bool(reader.attrs.keepdims)))
        return _set_pick(plan, ("vector", t))
    if not _class_weights(other, v):
        return "L is multiplied by something other than a one-hot or (V,) weights"
    other = _view_source(other, var2val, v)
    if op_name(reader) == "relax.gather_elements":
        reason = _gather_reason(reader, bvar, n)
        if reason:
            return reason
        plan.uses.append(Use("wgather", reader_var, reader, weights=other))
        return _set_pick(plan, _gather_pick(plan, reader.args[1], v, var2val))
    if op_name(reader) != "relax.sum" or not _row_axis(reader):
        return "L * w is neither summed over the classes nor gathered"
    if plan.weights is not None and not plan.weights.same_as(other):
        return "two different class weightings summed"
    plan.weights = other
    plan.uses.append(Use("wsum", reader_var, reader, bool(reader.attrs.keepdims)))
    return None


def _gather_pick(plan: Plan, idx, v, var2val) -> tuple:
    """The pick of ``gather_elements(L, idx)``: the targets before the importer's negative-index
    ``where`` (the kernel wraps negative targets itself), else ``idx``."""
    targets = unwrap_negative_index(idx, var2val, v)
    if targets is None:
        return ("gather", idx)
    plan.wraps = True
    return ("gather", targets)


def weight_picks(func: relax.Function) -> dict:
    """``gather_elements(broadcast_to(w, (N, V)), idx (N, 1), axis=1)`` with class weights ``w``
    (``(V,)`` / ``(1, V)``): ``{gather call: w}``. PyTorch's weighted ``nll_loss`` with the mean
    reduction picks its denominator's weights so, an (N, V) broadcast that stock builds in
    memory; ``w[idx]`` reads V floats once. Only looked for beside a fused log-softmax."""
    var2val = relax.analysis.get_var2val(func)
    picks = {}
    for value in var2val.values():
        if op_name(value) != "relax.gather_elements" or not isinstance(value.args[0], relax.Var):
            continue
        broadcast = var2val.get(value.args[0])
        sinfo = value.args[0].ty
        if op_name(broadcast) != "relax.broadcast_to" or not isinstance(
            getattr(sinfo, "shape", None), relax.ShapeExpr
        ):
            continue
        if sinfo.ndim != 2:
            continue
        n, v = sinfo.shape.values
        weights = broadcast.args[0]
        if not _class_weights(weights, v) or _gather_reason(value, value.args[0], n):
            continue
        picks[value] = _view_source(weights, var2val, v)
    return picks


def _view_source(expr, var2val, v):
    """Follow ``reshape`` / ``expand_dims`` / ``squeeze`` of class weights back to the tensor
    they view (exporters emit ``w.view(1, V)`` right before each use; the kernel needs a value
    that exists at the first use of the log-probabilities)."""
    views = ("relax.reshape", "relax.expand_dims", "relax.squeeze")
    while isinstance(expr, relax.Var) and op_name(var2val.get(expr)) in views:
        source = var2val[expr].args[0]
        if not _class_weights(source, v):
            break
        expr = source
    return expr


def _class_weights(expr, v) -> bool:
    """``expr`` is a float ``(V,)`` or ``(1, V)`` tensor."""
    sinfo = expr.ty
    if not (
        isinstance(sinfo, relax.TensorType)
        and str(sinfo.dtype) in _FLOATS
        and isinstance(sinfo.shape, relax.ShapeExpr)
        and sinfo.ndim in (1, 2)
    ):
        return False
    dims = sinfo.shape.values
    return _equal(dims[-1], v) and (sinfo.ndim == 1 or _equal(dims[0], 1))


def _gather_reason(call: relax.Call, source, n) -> str | None:
    """Why ``call`` is not ``gather_elements(source, idx (N, 1), axis=1)``, or None."""
    idx = call.args[1]
    if not call.args[0].same_as(source) or int(call.attrs.axis) % 2 != 1:
        return "gather over the rows"
    if not _int_tensor(idx, 2):
        return "gather index is not an integer (N, 1)"
    shape = idx.ty.shape
    if not isinstance(shape, relax.ShapeExpr) or not (
        _equal(shape.values[0], n) and _equal(shape.values[1], 1)
    ):
        return "gather index is not (N, 1)"
    return None


def _prim_is(expr, number) -> bool:
    """``expr`` (an ``IntImm`` / ``FloatImm``, or a ``PrimValue`` of one) equals ``number``."""
    value = getattr(expr, "value", None)
    if isinstance(value, tirx.IntImm | tirx.FloatImm):
        value = value.value
    return isinstance(value, int | float) and float(value) == float(number)


def _equal(a, b) -> bool:
    return prove_equal_shapes(a, b)


def _leave(what: str, reason: str) -> None:
    skip(logger, what, reason)
    return None
