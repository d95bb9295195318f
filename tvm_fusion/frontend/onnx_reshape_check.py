"""A run-time check of an ONNX ``Reshape`` whose target is computed from the data (issue #40).

The importer's ``Reshape`` of a run-time target (``tensor_to_shape`` matched to fresh dims, 0
and -1 written as Selects, :class:`~.onnx_ops.Reshape`) cannot prove that the target holds as
many elements as the input: ``Reshape(x of 12, [1, 6])`` returned a (1, 6) view, ``[3, 6]``
one that read past ``x``'s buffer (ONNX Runtime refuses both; so did stock TVM's converter
not). A small TIR kernel, called in place on ``x`` (which it does not touch) with the target's
dims as scalars, asserts ONNX's rules first::

    x1 = call_tir_inplace(check_reshape, (x, t0, t1, ...), inplace_indices=0)   # x1 is x
    y = reshape(x1, (Select(t0 == 0, x0, t0), ...))

so the reshape depends on it (neither dead-code elimination nor reordering drops it). Rules:
every dim >= -1, at most one -1, a 0 copies the input's dim at its position (``allowzero=0``;
with ``allowzero=1`` it stays 0), and the product of the dims is the input's element count or,
with one -1, a positive divisor of it. On failure: ``ValueError: Reshape <node> of <x>: ...``.
Constant targets never come here; a target computed from shapes only (``Shape`` of a dynamic
input through Mul / Concat / Cast, which the importer keeps as tensor ops) is evaluated
symbolically (:func:`_values`) and gets no kernel where the analyzer proves it valid.
"""

from __future__ import annotations

import contextlib
import itertools

import tvm
from tvm import relax, tirx
from tvm.ir.expr import GenericConst

from ..check_kernels import Buf, assert_kernel
from ..transform._common import as_i64, op_name

_ARITH = {
    "relax.add": lambda a, b: a + b,
    "relax.subtract": lambda a, b: a - b,
    "relax.multiply": lambda a, b: a * b,
    "relax.floor_divide": tirx.floordiv,
}


def checked_input(
    bb, data: relax.Expr, target: relax.Expr, dims: list, allowzero: bool, what: str
) -> relax.Expr:
    """``data`` through a ``check_reshape`` kernel (in place) that fails unless the run-time
    dims ``dims`` (fresh int64 vars matched to ``target``'s values) are a valid ONNX Reshape
    target of ``data``; ``data`` itself where ``target`` is proven valid."""
    ty = data.ty
    if _proven(_values(bb, target), list(ty.shape.values), allowzero):
        return data
    kernel = reshape_kernel(ty, len(dims), allowzero, what)
    gv = bb.add_func(kernel, "check_reshape")
    args = (data, *(relax.prim_value(d) for d in dims))
    return bb.emit(relax.call_tir_inplace(gv, args, 0, ty))


def computed_from_data(bb, target: relax.Expr) -> bool:
    """Whether ``target`` is computed by tensor ops from a model input's values (not a model
    input itself, not constants or shapes only: ``Shape`` -> ``Gather`` -> ``Concat`` chains,
    which PlaceShapeOnHost turns into symbolic shapes)."""
    bound = bb.lookup_binding(target) if isinstance(target, relax.Var) else target
    return isinstance(bound, relax.Call) and _reads_data(bb, bound, 0)


def _reads_data(bb, expr, depth: int) -> bool:
    if depth > 64:
        return False  # unsure: the Selects (correct, slower to compile)
    if isinstance(expr, relax.Var):
        bound = bb.lookup_binding(expr)
        if bound is None:  # a function parameter: data unless it is a shape or scalar
            return isinstance(expr.ty, relax.TensorType)
        return _reads_data(bb, bound, depth + 1)
    if isinstance(expr, relax.Tuple):
        return any(_reads_data(bb, f, depth + 1) for f in expr.fields)
    if isinstance(expr, relax.Call):
        if op_name(expr) in ("relax.shape_to_tensor", "relax.shape_of"):
            return False
        return any(_reads_data(bb, a, depth + 1) for a in expr.args)
    return False


def resolved_shape(bb, target: relax.Expr, in_dims: list, allowzero: bool) -> relax.ShapeExpr:
    """The dims of an ONNX Reshape of an input of ``in_dims`` to the run-time ``target`` (a
    1-D int64 tensor, checked by :func:`checked_input`): each 0 the input's dim at its position
    (``allowzero=0``), a -1 the element count over the other dims' product; computed by tensor
    ops, matched to fresh dims."""
    rank = int(target.ty.shape.values[0].value)

    def const(v):
        return relax.const(v, "int64")

    def emit(expr):
        return bb.emit(expr)

    def shape_tensor(values):
        return emit(relax.op.shape_to_tensor(relax.ShapeExpr([as_i64(v) for v in values])))

    t = target
    if str(t.ty.dtype) != "int64":
        t = emit(relax.op.astype(t, "int64"))
    if not allowzero and in_dims:
        copied = [in_dims[i] if i < len(in_dims) else 0 for i in range(rank)]
        t = emit(relax.op.where(relax.op.equal(t, const(0)), shape_tensor(copied), t))
    total = as_i64(1)
    for d in in_dims:
        total = total * as_i64(d)
    infer = emit(relax.op.equal(t, const(-1)))
    known = emit(relax.op.prod(relax.op.where(infer, const(1), t), axis=[0], keepdims=True))
    inferred = relax.op.floor_divide(shape_tensor([total]), relax.op.maximum(known, const(1)))
    t = emit(relax.op.where(infer, emit(inferred), t))
    dims = [tirx.Var(f"reshape_to_{i}", "int64") for i in range(rank)]
    bb.match_cast(emit(relax.op.tensor_to_shape(t)), relax.ShapeType(dims))
    return relax.ShapeExpr(dims)


def reshape_kernel(x_ty: relax.TensorType, rank: int, allowzero: bool, what: str):
    """``check_reshape(x, t0, ..)``: ``ValueError`` unless ``(t0, ..)`` is a valid ONNX
    Reshape target of ``x`` (its shape read at run time; its data not read)."""
    xs = [f"x{i}" for i in range(x_ty.ndim)]
    ts = [f"t{i}" for i in range(rank)]
    one = "T.int64(1)"
    dims = [
        f"T.Select({t} == T.int64(0), {xs[i]}, {t})" if i < len(xs) and not allowzero else t
        for i, t in enumerate(ts)
    ]
    total = " * ".join(xs) or one
    pairs = zip(ts, dims, strict=True)
    known = " * ".join(f"T.Select({t} == T.int64(-1), {one}, {d})" for t, d in pairs)
    known = f"({known or one})"
    negs = " + ".join(f'T.Cast("int64", {t} == T.int64(-1))' for t in ts) or "T.int64(0)"
    # Select computes both branches: the modulo's divisor is kept >= 1
    divides = f"{known} > 0 and T.floormod({total}, T.max({known}, {one})) == 0"
    exact = f"{known} == {total}"
    valid = [f"{t} >= T.int64(-1)" for t in ts]
    valid += [f"({negs}) <= 1", f"T.Select(({negs}) == 1, {divides}, {exact})"]
    message = (
        f"{what}: the target shape (computed from the data) does not fit the input's "
        f"{' x '.join(_dims(x_ty)) or 'scalar'} elements (ONNX Reshape: the dims' product must "
        "equal the input's element count; at most one -1, which must divide it evenly"
        + ("" if allowzero else "; a 0 copies the input's dim")
        + ")"
    )
    x = Buf("x", tuple(xs), str(x_ty.dtype))
    return assert_kernel("check_reshape", [x], ts, " and ".join(valid), message, "ValueError")


def _proven(values: list | None, in_dims: list, allowzero: bool) -> bool:
    """Whether the target ``values`` (PrimExprs, or None) provably hold as many elements as
    ``in_dims`` under ONNX's rules: a literal -1 infers; a value that may be 0 (with
    ``allowzero=0``) is proven in both cases, >= 1 and 0 (the input's dim copied). The input's
    symbolic dims are >= 0."""
    if values is None:
        return False
    analyzer = tvm.sym.Analyzer()
    in_dims = [as_i64(d) for d in in_dims]
    total = as_i64(1)
    for d in in_dims:
        total = total * d
    with contextlib.ExitStack() as stack:
        for d in in_dims:
            if not isinstance(d, tirx.IntImm):
                stack.enter_context(analyzer.constraint_scope(d >= 0))
        choices, infer = [], 0
        for i, v in enumerate(values):
            literal = int(v.value) if isinstance(v, tirx.IntImm) else None
            if literal == -1:
                infer += 1
                continue
            if literal is None and not analyzer.can_prove(v >= 0):
                return False
            if allowzero or i >= len(in_dims) or analyzer.can_prove(v >= 1):
                choices.append([(None, v)])
            elif literal == 0:
                choices.append([(None, in_dims[i])])
            else:
                choices.append([(v >= 1, v), (v == 0, in_dims[i])])
        if infer > 1 or sum(len(c) > 1 for c in choices) > 4:
            return False
        for case in itertools.product(*choices):
            with contextlib.ExitStack() as scope:
                for fact, _ in case:
                    if fact is not None:
                        scope.enter_context(analyzer.constraint_scope(fact))
                known = as_i64(1)
                for _, v in case:
                    known = known * v
                if infer == 0:
                    ok = analyzer.can_prove(known == total)
                else:
                    ok = analyzer.can_prove(known >= 1) and analyzer.can_prove(
                        tirx.floormod(total, known) == 0
                    )
                if not ok:
                    return False
    return True


def _values(bb, expr, depth: int = 0) -> list | None:
    """The int64 values of a 1-D integer tensor computed from shapes and constants only
    (``shape_to_tensor``, casts, elementwise + - * //, ``concat``), as PrimExprs; None for
    anything else (data)."""
    if depth > 64:
        return None
    if isinstance(expr, relax.Var):
        bound = bb.lookup_binding(expr)
        return None if bound is None else _values(bb, bound, depth + 1)
    if isinstance(expr, GenericConst):
        array = expr.value.numpy()
        if array.ndim > 1 or array.dtype.kind not in "iu":
            return None
        return [as_i64(int(v)) for v in array.reshape(-1)]
    if isinstance(expr, relax.ShapeExpr):
        return [as_i64(v) for v in expr.values]
    name = op_name(expr)
    if name == "relax.shape_to_tensor":
        return _values(bb, expr.args[0], depth + 1)
    if name == "relax.astype" and str(expr.attrs.dtype) in ("int64", "int32"):
        return _values(bb, expr.args[0], depth + 1)
    if name == "relax.concat" and int(expr.attrs.axis or 0) == 0:
        parts = [_values(bb, a, depth + 1) for a in expr.args[0].fields]
        return None if any(p is None for p in parts) else [v for p in parts for v in p]
    if name in _ARITH:
        a, b = (_values(bb, arg, depth + 1) for arg in expr.args[:2])
        if a is None or b is None or 1 not in (len(a), len(b)) and len(a) != len(b):
            return None
        n = max(len(a), len(b))
        a, b = (v * n if len(v) == 1 else v for v in (a, b))
        return [_ARITH[name](x, y) for x, y in zip(a, b, strict=True)]
    return None


def _dims(x_ty: relax.TensorType) -> list[str]:
    shape = x_ty.shape
    if not isinstance(shape, relax.ShapeExpr):
        return []
    return [str(d.value) if hasattr(d, "value") else str(d) for d in shape.values]
