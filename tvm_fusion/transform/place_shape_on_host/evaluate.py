"""PlaceShapeOnHost, recognising shape arithmetic: int tensor chains evaluated symbolically.

:class:`_Evaluator` follows an int tensor back through the ops that compute it (shape_to_tensor
of a shape or of ``shape_of``, int constants, take/strided_slice on axis 0, concat, reshapes and
casts, elementwise arithmetic, comparisons, logical ops, where, scatter_elements at constant
indices, sum/prod) and gives each element as a ``PrimExpr`` over the function's symbolic dims,
or None with the reason in ``why``. A short int tensor it cannot evaluate (computed from data)
is recorded in ``reads``: its value is read once at run time into fresh dims, and evaluation goes
on from them. Also here: the dtype sets and the small expression helpers the other modules of
the pass share.
"""

from __future__ import annotations

import numpy as np
from tvm import relax, tirx
from tvm.ir import PrimType
from tvm.ir.expr import GenericConst

from .._common import op_name, shape_dims

_INT = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_MAX_ELEMS = 16  # shape tensors are short; longer int tensors are data
# Float shape arithmetic (the importer's Range: ceil((limit - start) / delta) in float64) is
# followed only while every value is an exact integer: int casts, integral constants, + - *,
# min/max, and ceil/floor of a division by a positive integer constant.
_FLOAT = ("float16", "float32", "float64")


def _floordiv(a, b):
    """``a // b``, a negative constant divisor written positive (``n // -1`` is ``-n // 1``,
    that is ``-n``). The importer computes a Range's length as ``-((limit - start) // delta)``;
    with ``delta = -1`` the division stayed in every extent after it (``0 - n // -1``, which
    the analyzer does not simplify) and the build failed ("Binding of variable rmod ...
    conflicts"). (The analyzer itself writes ``-n // 2`` as ``n // -2``, which builds.)"""
    if isinstance(b, tirx.IntImm) and int(b.value) < 0:
        return tirx.floordiv(-a, _negated(b))
    return tirx.floordiv(a, b)


def _negated(value: tirx.IntImm) -> tirx.IntImm:
    return tirx.IntImm(str(value.ty.dtype), -int(value.value))


def _floormod(a, b):
    """``a % b`` with ``b`` a negative constant is ``-((-a) % -b)``."""
    if isinstance(b, tirx.IntImm) and int(b.value) < 0:
        return -tirx.floormod(-a, _negated(b))
    return tirx.floormod(a, b)


def _truncdiv(a, b):
    """Integer Div (truncating), a negative constant divisor written positive."""
    if isinstance(b, tirx.IntImm) and int(b.value) < 0:
        return -tirx.truncdiv(a, _negated(b))
    return tirx.truncdiv(a, b)


_BINARY = {
    "relax.add": lambda a, b: a + b,
    "relax.subtract": lambda a, b: a - b,
    "relax.multiply": lambda a, b: a * b,
    "relax.floor_divide": _floordiv,
    "relax.floor_mod": _floormod,
    "relax.minimum": tirx.min,
    "relax.maximum": tirx.max,
}
_COMPARE = {
    "relax.less": lambda a, b: a < b,
    "relax.less_equal": lambda a, b: a <= b,
    "relax.greater": lambda a, b: a > b,
    "relax.greater_equal": lambda a, b: a >= b,
    "relax.equal": lambda a, b: a == b,
    "relax.not_equal": lambda a, b: a != b,
}
_LOGICAL = {
    "relax.logical_and": tirx.And,
    "relax.logical_or": tirx.Or,
}
# ops whose result depends on the sign of an operand: not evaluated over values read at run time
# (graph inputs, data), which may be negative, while TVM takes every dim a ``match_cast``
# defines to be >= 0 and folds ``s_0 < 0`` to false (issue #40: ``Where(Less(s, 0), Neg(s), s)``
# as a Reshape target; its ``T.Select(s_0 < 0, ...)`` also sent CanonicalizeBindings into
# endless recursion, a segfault). Such a chain stays tensor ops; its result is read instead.
_SIGNED = (*_COMPARE, "relax.minimum", "relax.maximum", "relax.floor_divide", "relax.floor_mod")
_PASS_THROUGH = ("relax.reshape", "relax.squeeze", "relax.expand_dims", "relax.flatten")


def _is_to_shape(expr) -> bool:
    """``R.tensor_to_shape(t)`` or the importer's ``call_packed("vm.builtin.tensor_to_shape")``."""
    if op_name(expr) == "relax.tensor_to_shape":
        return True
    return (
        isinstance(expr, relax.Call)
        and isinstance(expr.op, relax.ExternFunc)
        and expr.op.global_symbol == "vm.builtin.tensor_to_shape"
        and len(expr.args) == 1
    )


def _i64(value) -> tirx.Expr:
    if isinstance(value, bool):
        return tirx.const(value, "bool")
    if isinstance(value, int):
        return tirx.IntImm("int64", value)
    dtype = str(value.ty.dtype)
    if dtype == "bool" or dtype == "int64":
        return value
    return tirx.Cast("int64", value)


class _Value:
    """A small int/bool tensor: its elements as PrimExprs and its rank (0 or 1)."""

    __slots__ = ("elems", "rank")

    def __init__(self, elems: list, rank: int):
        self.elems = elems
        self.rank = rank

    def broadcast(self, n: int) -> list | None:
        if len(self.elems) == n:
            return self.elems
        if len(self.elems) == 1:
            return self.elems * n
        return None


def _float_op(expr) -> bool:
    sinfo = getattr(expr, "ty", None)
    return isinstance(sinfo, relax.TensorType) and str(sinfo.dtype) in _FLOAT


def _strip_casts(expr):
    """``int64(float32(n))`` is ``n`` for the dims this pass sees (exact below 2**24)."""
    if isinstance(expr, tirx.Cast):
        inner = expr.value
        if (
            isinstance(inner, tirx.Cast)
            and str(expr.ty.dtype).startswith("int")
            and str(inner.value.ty.dtype).startswith("int")
        ):
            return _strip_casts(inner.value)
        return tirx.Cast(str(expr.ty.dtype), _strip_casts(inner))
    for kind, build in (
        (tirx.Add, tirx.Add),
        (tirx.Sub, tirx.Sub),
        (tirx.Mul, tirx.Mul),
        (tirx.FloorDiv, tirx.FloorDiv),
        (tirx.FloorMod, tirx.FloorMod),
        (tirx.Max, tirx.Max),
        (tirx.Min, tirx.Min),
    ):
        if isinstance(expr, kind):
            return build(_strip_casts(expr.a), _strip_casts(expr.b))
    return expr


def _readable(var) -> bool:
    """A variable holding a short int tensor of static shape (rank 0 or 1)."""
    sinfo = getattr(var, "ty", None)
    if not isinstance(var, relax.Var) or not isinstance(sinfo, relax.TensorType):
        return False
    if sinfo.dtype not in ("int32", "int64") or not isinstance(sinfo.shape, relax.ShapeExpr):
        return False
    dims = sinfo.shape.values
    if sinfo.ndim == 0:
        return True
    return (
        sinfo.ndim == 1
        and isinstance(dims[0], tirx.IntImm)
        and 1 <= int(dims[0].value) <= _MAX_ELEMS
    )


def _is_bool(value: tirx.Expr) -> bool:
    return str(value.ty.dtype) == "bool"


class _Evaluator:
    """Evaluates int tensor expressions element by element, looking through bindings."""

    def __init__(self, var2val: dict, inputs: dict, analyzer):
        self.var2val = var2val
        self.inputs = inputs  # param -> list of fresh dims (shape tensors that are graph inputs)
        self.reads: dict = {}  # var -> fresh dims: data-dependent shape values, read once
        self.analyzer = analyzer
        self.memo: dict = {}
        self.why = ""

    def resolve(self, expr):
        seen = 0
        while isinstance(expr, relax.Var) and expr in self.var2val and seen < 256:
            expr = self.var2val[expr]
            seen += 1
        return expr

    def _signed_read(self, elems, name: str) -> bool:
        """Whether ``elems`` use a value read at run time; then ``name`` is refused."""
        read = {d for dims in (*self.inputs.values(), *self.reads.values()) for d in dims}
        if any(v in read for e in elems for v in tirx.analysis.undefined_vars(e)):
            self.fail(f"{name} of a value read at run time (may be negative; TVM takes dims >= 0)")
            return True
        return False

    def fail(self, why: str) -> None:
        if not self.why:
            self.why = why
        return None

    def value(self, expr) -> _Value | None:
        if isinstance(expr, relax.Var) and expr in self.inputs:
            return _Value(list(self.inputs[expr]), 1)
        key = expr
        if key in self.memo:
            return self.memo[key]
        result = self._value(self.resolve(expr))
        if result is None and _readable(expr):
            # a short int tensor computed from data (``max(sum(mask))``): its value exists only
            # at run time; read it once and go on symbolically from fresh dims
            length = int(expr.ty.shape.values[0].value) if expr.ty.ndim == 1 else 1
            self.reads[expr] = [tirx.Var(f"{expr.name}_{k}", "int64") for k in range(length)]
            result = _Value(list(self.reads[expr]), expr.ty.ndim)
        if result is not None:
            result = _Value(
                [self.analyzer.simplify(_strip_casts(e)) for e in result.elems], result.rank
            )
        self.memo[key] = result
        return result

    def _value(self, expr) -> _Value | None:
        if isinstance(expr, relax.Var) and expr in self.inputs:
            return _Value(list(self.inputs[expr]), 1)
        if isinstance(getattr(expr, "ty", None), PrimType):
            return _Value([_i64(expr)], 0)
        if isinstance(expr, GenericConst):
            return self._const(expr)
        sinfo = getattr(expr, "ty", None)
        if isinstance(sinfo, relax.TensorType):
            if sinfo.dtype not in (*_INT, "bool", *_FLOAT):
                return self.fail(f"{sinfo.dtype} tensor")
            if sinfo.ndim not in (0, 1):
                return self.fail(f"rank-{sinfo.ndim} tensor")
        name = op_name(expr)
        if name is None:
            return self.fail(f"{type(expr).__name__} is not an op")
        handler = getattr(self, "_" + name.removeprefix("relax.").replace(".", "_"), None)
        if name in _BINARY or name in _COMPARE or name in _LOGICAL or name == "relax.divide":
            return self._binary(expr, name)
        if name in _PASS_THROUGH:
            return self._reshape_like(expr)
        if handler is None:
            return self.fail(f"{name} is not shape arithmetic this pass knows")
        return handler(expr)

    # -- leaves
    def _const(self, expr) -> _Value | None:
        arr = expr.value.numpy()
        if arr.ndim > 1 or arr.size > _MAX_ELEMS:
            return self.fail("constant too large for a shape")
        if arr.dtype.name == "bool":
            return _Value([tirx.const(bool(v), "bool") for v in arr.reshape(-1)], arr.ndim)
        if arr.dtype.name in _FLOAT and np.all(np.mod(arr, 1) == 0) and np.all(abs(arr) < 2**24):
            arr = arr.astype("int64")  # an exact integer held in a float
        if arr.dtype.name not in _INT:
            return self.fail(f"{arr.dtype} constant")
        return _Value([_i64(int(v)) for v in arr.reshape(-1)], arr.ndim)

    def shape_values(self, shape) -> list | None:
        dims = shape_dims(self.resolve(shape))
        return dims if dims is not None else self.fail("shape with unknown dims")

    def _shape_to_tensor(self, expr) -> _Value | None:
        values = self.shape_values(expr.args[0])
        return None if values is None else _Value([_i64(_strip_casts(v)) for v in values], 1)

    def _size(self, expr) -> _Value | None:
        sinfo = expr.args[0].ty
        if not isinstance(sinfo, relax.TensorType) or not isinstance(sinfo.shape, relax.ShapeExpr):
            return self.fail("size of a tensor of unknown shape")
        total = _i64(1)
        for dim in sinfo.shape.values:
            total = total * _i64(dim)
        return _Value([total], 0)

    # -- structure
    def _reshape_like(self, expr) -> _Value | None:
        inner = self.value(expr.args[0])
        if inner is None:
            return None
        sinfo = expr.ty
        rank = sinfo.ndim if isinstance(sinfo, relax.TensorType) else -1
        if rank not in (0, 1) or (rank == 0 and len(inner.elems) != 1):
            return self.fail("reshape to a rank this pass does not track")
        return _Value(inner.elems, rank)

    def _astype(self, expr) -> _Value | None:
        inner = self.value(expr.args[0])
        if inner is None:
            return None
        dtype = str(expr.attrs.dtype)
        if dtype in _INT:
            return _Value(
                [tirx.Cast("int64", e) if _is_bool(e) else e for e in inner.elems], inner.rank
            )
        if dtype == "bool":
            return _Value([e if _is_bool(e) else e != 0 for e in inner.elems], inner.rank)
        if dtype in _FLOAT and not any(map(_is_bool, inner.elems)):
            return inner  # exact integers (see _FLOAT)
        return self.fail(f"astype to {dtype}")

    def _take(self, expr) -> _Value | None:
        data, index = self.value(expr.args[0]), self.value(expr.args[1])
        if data is None or index is None:
            return None
        axis = expr.attrs.axis
        if data.rank != 1 or (axis is not None and int(axis) not in (0, -1)):
            return self.fail("take on a tensor that is not a 1-D shape")
        mode = str(expr.attrs.mode)
        n = len(data.elems)
        picked = []
        for idx in index.elems:
            if not isinstance(idx, tirx.IntImm):
                return self.fail("take at a run-time index")
            i = int(idx.value)
            if mode == "wrap":
                i %= n
            elif mode == "clip":
                i = min(max(i, 0), n - 1)
            elif not 0 <= i < n:
                return self.fail(f"take index {i} out of range {n}")
            picked.append(data.elems[i])
        return _Value(picked, index.rank)

    def _strided_slice(self, expr) -> _Value | None:
        data = self.value(expr.args[0])
        if data is None or data.rank != 1:
            return self.fail("strided_slice of a non-1-D shape") if data is not None else None
        axes, begin, end = expr.args[1], expr.args[2], expr.args[3]
        strides = expr.args[4] if len(expr.args) > 4 else None

        def ints(tup):
            if tup is None:
                return None
            out = []
            for item in tup.fields if isinstance(tup, relax.Tuple) else tup:
                value = item
                if not isinstance(value, tirx.IntImm):
                    return None
                out.append(int(value.value))
            return out

        axes_v, begin_v, end_v = ints(axes), ints(begin), ints(end)
        strides_v = ints(strides) if strides is not None else [1]
        if None in (axes_v, begin_v, end_v, strides_v) or axes_v != [0]:
            return self.fail("strided_slice with run-time bounds")
        return _Value(data.elems[slice(begin_v[0], end_v[0], strides_v[0])], 1)

    def _concat(self, expr) -> _Value | None:
        fields = self.resolve(expr.args[0])
        if not isinstance(fields, relax.Tuple):
            return self.fail("concat of a tuple variable")
        elems = []
        for field in fields.fields:
            value = self.value(field)
            if value is None:
                return None
            elems += value.elems
        return _Value(elems, 1)

    def _scatter_elements(self, expr) -> _Value | None:
        data, index, updates = (self.value(a) for a in expr.args[:3])
        if data is None or index is None or updates is None:
            return None
        if str(expr.attrs.reduction) != "update" or int(expr.attrs.axis) != 0:
            return self.fail("scatter_elements with a reduction")
        elems = list(data.elems)
        for pos, idx in enumerate(index.elems):
            if not isinstance(idx, tirx.IntImm) or not -len(elems) <= int(idx.value) < len(elems):
                return self.fail("scatter_elements at a run-time index")
            elems[int(idx.value)] = updates.elems[pos if len(updates.elems) > 1 else 0]
        return _Value(elems, data.rank)

    def _where(self, expr) -> _Value | None:
        cond, lhs, rhs = (self.value(a) for a in expr.args)
        if cond is None or lhs is None or rhs is None:
            return None
        n = max(len(cond.elems), len(lhs.elems), len(rhs.elems))
        c, a, b = cond.broadcast(n), lhs.broadcast(n), rhs.broadcast(n)
        if c is None or a is None or b is None:
            return self.fail("where with mismatched lengths")
        elems = []
        for ci, ai, bi in zip(c, a, b, strict=True):
            ci = self.analyzer.simplify(ci)
            if isinstance(ci, tirx.IntImm):
                elems.append(ai if int(ci.value) else bi)
            else:
                elems.append(tirx.Select(ci, ai, bi))
        return _Value(elems, max(cond.rank, lhs.rank, rhs.rank))

    def _rounded(self, expr, up: bool) -> _Value | None:
        inner = self.resolve(expr.args[0])
        if op_name(inner) != "relax.divide":
            return self.value(expr.args[0])  # exact integers round to themselves
        lhs, rhs = self.value(inner.args[0]), self.value(inner.args[1])
        if lhs is None or rhs is None:
            return None
        if len(rhs.elems) != 1 or not isinstance(rhs.elems[0], tirx.IntImm):
            return self.fail("division by a run-time value")
        d = int(rhs.elems[0].value)
        if d <= 0:
            return self.fail("division by a non-positive constant")
        if up:
            return _Value([tirx.floordiv(x + (d - 1), d) for x in lhs.elems], lhs.rank)
        return _Value([tirx.floordiv(x, d) for x in lhs.elems], lhs.rank)

    def _ceil(self, expr) -> _Value | None:
        return self._rounded(expr, up=True)

    def _floor(self, expr) -> _Value | None:
        return self._rounded(expr, up=False)

    def _negative(self, expr) -> _Value | None:
        inner = self.value(expr.args[0])
        return None if inner is None else _Value([-e for e in inner.elems], inner.rank)

    def _abs(self, expr) -> _Value | None:
        inner = self.value(expr.args[0])
        if inner is None or self._signed_read(inner.elems, "abs"):
            return None
        return _Value([tirx.Select(e < 0, -e, e) for e in inner.elems], inner.rank)

    def _logical_not(self, expr) -> _Value | None:
        inner = self.value(expr.args[0])
        return None if inner is None else _Value([tirx.Not(e) for e in inner.elems], inner.rank)

    def _reduce(self, expr, combine, start) -> _Value | None:
        inner = self.value(expr.args[0])
        if inner is None:
            return None
        total = _i64(start)
        for elem in inner.elems:
            total = combine(total, elem)
        keep = bool(expr.attrs.keepdims) and inner.rank == 1
        return _Value([total], 1 if keep else 0)

    def _sum(self, expr) -> _Value | None:
        return self._reduce(expr, lambda a, b: a + b, 0)

    def _prod(self, expr) -> _Value | None:
        return self._reduce(expr, lambda a, b: a * b, 1)

    def _binary(self, expr, name) -> _Value | None:
        lhs, rhs = self.value(expr.args[0]), self.value(expr.args[1])
        if lhs is None or rhs is None:
            return None
        n = max(len(lhs.elems), len(rhs.elems))
        a, b = lhs.broadcast(n), rhs.broadcast(n)
        if a is None or b is None:
            return self.fail("elementwise op with mismatched lengths")
        rank = max(lhs.rank, rhs.rank)
        if name in _SIGNED and self._signed_read(a + b, name.removeprefix("relax.")):
            return None
        if name in _COMPARE:
            return _Value([_COMPARE[name](x, y) for x, y in zip(a, b, strict=True)], rank)
        if name in _LOGICAL:
            return _Value([_LOGICAL[name](x, y) for x, y in zip(a, b, strict=True)], rank)
        if any(_is_bool(x) for x in a + b):
            return self.fail(f"{name} on booleans")
        if name == "relax.divide":
            if _float_op(expr):  # exact only when dividing by 1; ceil/floor handle the rest
                if all(isinstance(y, tirx.IntImm) and int(y.value) == 1 for y in b):
                    return _Value(a, rank)
                return self.fail("float division outside ceil/floor")
            # integer Div truncates (ONNX and TIR alike)
            return _Value([_truncdiv(x, y) for x, y in zip(a, b, strict=True)], rank)
        return _Value([_BINARY[name](x, y) for x, y in zip(a, b, strict=True)], rank)
