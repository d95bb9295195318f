"""PlaceShapeOnHost: shape arithmetic on int tensors becomes symbolic shape arithmetic on the host
(ONNX Runtime PR #19769).

Exporters compute shapes on int64 tensors (``Shape -> Gather -> Mul -> Concat -> Reshape``,
``Range`` with a limit read from a shape, ``Slice`` ends from ``Shape / 2``, ``Tile`` repeats from
another input's batch); the ONNX importer folds the simplest chains and leaves the rest as
``shape_of -> shape_to_tensor -> take/concat/multiply/where/scatter_elements -> tensor_to_shape``
(or ``dynamic_strided_slice``). Each op of such a chain is a device kernel on CUDA, and the
``tensor_to_shape`` at its end copies the result back to the host and synchronises.

The pass walks backwards from every shape-consuming operand:

- ``tensor_to_shape(t)`` (what Reshape, Expand, Tile, ConstantOfShape and Range targets become),
- ``dynamic_strided_slice(x, begin, end, strides)``,

through the int tensor ops that produce ``t`` (shape_to_tensor of a shape or of ``shape_of``,
int constants, take/strided_slice on axis 0, concat, reshape/squeeze/expand_dims/astype,
elementwise add/subtract/multiply/divide/floor_divide/floor_mod/minimum/maximum/negative,
comparisons, logical ops, where, scatter_elements at constant indices, sum/prod), evaluating
every element as a ``PrimExpr`` over the function's symbolic dims. When every element is known,
the consumer is rewritten: ``tensor_to_shape(t)`` becomes ``R.shape([...])`` and
``dynamic_strided_slice`` becomes ``strided_slice`` with PrimValue bounds. The VM computes these
expressions on the host from the shapes it already has, so the chain costs no kernel and no copy.
Tensors of the chain that nothing else uses are removed; a value that also feeds a non-shape
consumer (``Size(x)`` divided into data, say) keeps its device computation for that consumer.

Shape tensors that are graph inputs (dynamo-captured models pass them) cannot be made symbolic
by reading the graph: their values exist only at run time. The pass reads each such input once,
at the top of the function (``tensor_to_shape`` + ``match_cast`` to fresh dims ``<name>_0..``),
evaluates everything downstream symbolically from those dims, and on GPU targets declares the
input a host tensor (its struct info gets the host VDevice): the caller passes it as a CPU
tensor, and reading it is no device-to-host copy.

A shape value computed from data (``max(sum(attention_mask, -1))`` as a Slice end, an argmax as
a Reshape target) has no symbolic form either. When a short int tensor (rank <= 1, at most 16
elements, static length) on a chain cannot be evaluated, it is read the same way, once, right
before the rewritten consumer, and everything after it becomes symbolic. On GPU targets the ops
between the data and the read that only reduce, cast or reshape 1-D int tensors (the max over
the per-row lengths) are placed on the host VDevice (part b of issue #8): ``to_vdevice`` copies
their 1-D input once, they are legalised as llvm kernels (``KeepHostKernelsApart`` in the
pipeline stops FuseOps from merging them into device kernels), and the read needs no further
copy. Larger inputs (the mask itself) are data and stay on the device. The module's ``vdevice``
global info lists the device first and the host after it, so the VM is created with
``[gpu, cpu]``. Anything the evaluator does not understand is left as it was, with the reason at
debug level.

A ``strided_slice`` from a positive constant begin (as written, or clamped by the importer to a
symbolic end: ``min(1, 2 * seq)``) to the end of a symbolic axis or to a symbolic end within it
is inferred ``max(end - begin, 0)`` long; it is matched to ``end - begin`` (a run-time check
that fails only where the slice would be empty), so a reshape after it (XLNet's rel_shift) is a
view, not a copy kernel.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import IRModule, relax, tirx
from tvm.ir import PrimType
from tvm.ir.expr import GenericConst
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._common import at_most, get_logger, op_name, record_rewrite, shape_dims, skip

logger = get_logger(__name__)
NAME = "PlaceShapeOnHost"
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
# ops that may run on the host VDevice between a copied 1-D int tensor and a shape read
_HOST_OPS = (
    "relax.max",
    "relax.min",
    "relax.sum",
    "relax.prod",
    "relax.argmax",
    "relax.argmin",
    "relax.astype",
    "relax.reshape",
    "relax.squeeze",
    "relax.expand_dims",
)
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


def _int_value(value) -> int | None:
    """An int from a strided_slice argument (an IntImm in 0.27's Relax tuples)."""
    return int(value.value) if isinstance(value, tirx.IntImm) else None


def _cut_begin(begin) -> int | None:
    """A slice's begin that is a positive constant ``c`` or ``min(c, end)``, else None."""
    value = begin
    if isinstance(value, tirx.Min):
        value = value.a
    c = _int_value(value) if isinstance(value, tirx.Expr) else None
    return c if c is not None and c > 0 else None


def _is_zero(value) -> bool:
    return isinstance(value, tirx.IntImm) and int(value.value) == 0


def _reads_data(reads: dict, expr) -> bool:
    """Whether ``expr`` uses a value read at run time."""
    free = tirx.analysis.undefined_vars(expr)
    return any(d in free for dims in reads.values() for d in dims)


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
        if inner is None:
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


def _is_gpu(target) -> bool:
    return target is not None and "gpu" in target.keys


def _host_vdevice(target) -> relax.VDevice | None:
    host = target.host if target is not None and target.host is not None else None
    if host is None:
        host = tvm.target.Target("llvm")
    return relax.VDevice(host, 0, "global")


def _same_vdevice(a: relax.VDevice, b: relax.VDevice) -> bool:
    return (
        str(a.target) == str(b.target)
        and int(a.vdevice_id) == int(b.vdevice_id)
        and str(a.memory_scope) == str(b.memory_scope)
    )


def _declare_vdevices(mod: IRModule, target, host: relax.VDevice) -> None:
    """List the host VDevice in the module's ``vdevice`` global info (the VM's device index of
    each allocation comes from it); the target's own device first when the list is new."""
    known = list(mod.global_infos["vdevice"]) if "vdevice" in mod.global_infos else []
    if not known:
        known = [relax.VDevice(target, 0, "global")]
    if not any(_same_vdevice(v, host) for v in known):
        known.append(host)
    mod.update_global_info("vdevice", known)


_POS_INF = tvm.sym.ConstIntBound.POS_INF


def _tir_vars(sinfo) -> list:
    if isinstance(sinfo, relax.TensorType) and isinstance(sinfo.shape, relax.ShapeExpr):
        values = sinfo.shape.values
    elif isinstance(sinfo, relax.ShapeType) and sinfo.values is not None:
        values = sinfo.values
    else:
        return []
    found: list = []
    for value in values:
        found += [v for v in tirx.analysis.undefined_vars(value) if v not in found]
    return found


def _has_select(expr) -> bool:
    if isinstance(expr, tirx.Select):
        return True
    return any(
        _has_select(getattr(expr, field))
        for field in ("a", "b", "value")
        if isinstance(getattr(expr, field, None), tirx.Expr)
    )


def _propagate(func: relax.Function, analyzer, bounded: bool = False) -> relax.Function:
    """Let the new symbolic shapes flow: a ``match_cast`` of a shape we computed to fresh dims
    (``Shape([range_len_0])``) binds those dims to our expressions, then every op after it is
    re-inferred, so shapes the importer left unknown (``R.Tensor(ndim=3)``) become known.
    ``bounded``: the analyzer knows the dims' bounds (torch.export's ``Dim(max=...)``), and every
    shape argument is simplified with them (``min(seq, 128)`` is ``seq`` for ``seq <= 128``)."""
    binding: dict = {}
    var2val = relax.analysis.get_var2val(func)
    for block in func.body.blocks:
        for bind in block.bindings:
            if not isinstance(bind, relax.MatchCast):
                continue
            value = var2val.get(bind.value, bind.value)
            if not isinstance(value, relax.ShapeExpr):
                continue
            pattern = bind.ty
            if not isinstance(pattern, relax.ShapeType) or pattern.values is None:
                continue
            for dim, expr in zip(pattern.values, value.values, strict=False):
                if not isinstance(dim, tirx.Var) or dim in binding or dim.same_as(expr):
                    continue
                expr = analyzer.simplify(expr)  # earlier bindings substituted (analyzer.bind)
                if _has_select(expr):
                    # still a run-time choice (ONNX Reshape's 0/-1 rules on a shape input):
                    # keep the match_cast; the VM evaluates it once, kernels see a plain dim
                    continue
                binding[dim] = expr
                analyzer.bind(dim, expr)
    if not binding and not bounded:
        return func
    return relax.analysis.remove_all_unused(
        _Reinfer(analyzer).visit_expr(func.bind_symbolic_vars(binding))
    )


@mutator
class _Reinfer(PyExprMutator):
    """Re-derives the struct info of every op call (rebuilt calls are normalised anew)."""

    def __init__(self, analyzer):
        super().__init__()
        self.analyzer = analyzer

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new = super().visit_call_(call)
        if isinstance(new, relax.Call) and isinstance(new.op, tvm.ir.Op):
            args = [self._simplified(a) for a in new.args]
            return relax.Call(new.op, args, new.attrs, new.ty_args, new.span)
        return new

    def visit_shape_expr_(self, op: relax.ShapeExpr) -> relax.Expr:
        return self._simplified(op)

    def _simplified(self, arg):
        """Shapes written with ONNX's 0/-1 rules (Select(d == -1, ...)) read plainly once the
        dims are known: ``Select(batch == -1, ..., batch)`` is ``batch``."""
        if isinstance(arg, relax.ShapeExpr):
            return relax.ShapeExpr([self.analyzer.simplify(v) for v in arg.values])
        return arg


def _uses(func: relax.Function) -> dict:
    """var -> the values (call expressions) of the bindings that use it; None: returned."""
    uses: dict = {}

    def add(var, value):
        uses.setdefault(var, []).append(value)

    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value

            def visit(expr, value=value):
                if isinstance(expr, relax.Var):
                    add(expr, value)

            relax.analysis.post_order_visit(value, visit)

    def visit_ret(expr):
        if isinstance(expr, relax.Var):
            add(expr, None)

    relax.analysis.post_order_visit(func.body.body, visit_ret)
    return uses


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, target):
        super().__init__(mod)
        self.mod_ = mod
        self.target = target
        self.count = 0
        self.host_vdevice = None  # set once something is placed on the host
        self.analyzer = tvm.sym.Analyzer()

    def transform(self) -> IRModule:
        for gv, func in self.mod_.functions_items():
            if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
                continue
            new = self.rewrite_function(func, gv.name_hint)
            if new is not None:
                self.builder_.update_func(gv, new)
        mod = self.builder_.get()
        if self.host_vdevice is not None:
            _declare_vdevices(mod, self.target, self.host_vdevice)
        return mod

    def rewrite_function(self, func: relax.Function, name: str):
        self.analyzer = tvm.sym.Analyzer()
        lower, upper = (
            {str(k): int(v) for k, v in (func.attrs.get(key, None) or {}).items()}
            for key in ("tir_var_lower_bound", "tir_var_upper_bound")
        )
        self.bounded = False
        for param in func.params:  # dims of inputs are never negative; torch.export's Dim bounds
            for dim in _tir_vars(param.ty):
                lo, hi = max(lower.get(dim.name, 0), 0), upper.get(dim.name, _POS_INF)
                self.bounded |= dim.name in upper
                self.analyzer.update(dim, tvm.sym.ConstIntBound(lo, hi), override=True)
        self.var2val = dict(relax.analysis.get_var2val(func))
        for block in func.body.blocks:  # match_cast bindings too: cast(reshape(t), (1,))
            for bind in block.bindings:
                if isinstance(bind, relax.MatchCast):
                    self.var2val.setdefault(bind.var, bind.value)
        self._var_of = {bound: var for var, bound in self.var2val.items()}
        inputs = self._shape_inputs(func, name)
        self.eval = _Evaluator(self.var2val, inputs, self.analyzer)
        self.before = self.count
        self.unread = dict(inputs)  # shape inputs whose one host read is not emitted yet
        self.emitted: set = set()  # data-dependent values already read
        body = self.visit_expr(func.body)
        if self.count == self.before:
            return None
        new = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
        new = _propagate(relax.analysis.remove_all_unused(new), self.analyzer, self.bounded)
        if _is_gpu(self.target) and inputs:
            # by position: rewriting symbolic dims may have rebuilt the parameter vars
            read = [i for i, p in enumerate(func.params) if p in inputs and p not in self.unread]
            new = self._inputs_on_host(new, [new.params[i] for i in read], name)
        return new

    def _inputs_on_host(self, func: relax.Function, params: list, name: str) -> relax.Function:
        """Declare shape inputs that are now only read by ``tensor_to_shape`` host tensors."""
        uses = _uses(func)
        host = {}
        for param in params:
            users = uses.get(param, [])
            if all(_is_to_shape(value) for value in users):
                sinfo = param.ty
                host[param] = relax.Var(
                    param.name,
                    relax.TensorType(sinfo.shape, sinfo.dtype, self._host()),
                )
            else:
                skip(logger, f"{name}: input {param.name}", "still used by a kernel")
        if not host:
            return func
        new_params = [host.get(p, p) for p in func.params]
        bound = func.bind_params(dict(host))
        return relax.Function(
            new_params, bound.body, func.ret_ty, func.is_pure, func.attrs, func.span
        )

    def _shape_inputs(self, func, name) -> dict:
        """Graph inputs that are short int tensors used only where shapes are consumed."""
        inputs: dict = {}
        uses = _uses(func)
        for param in func.params:
            sinfo = param.ty
            if not isinstance(sinfo, relax.TensorType) or sinfo.dtype not in _INT:
                continue
            if sinfo.ndim != 1 or not isinstance(sinfo.shape, relax.ShapeExpr):
                continue
            length = sinfo.shape.values[0]
            if not isinstance(length, tirx.IntImm) or int(length.value) > _MAX_ELEMS:
                continue
            if not self._only_shape_uses(param, uses, set()):
                skip(logger, f"{name}: input {param.name}", "also used as data")
                continue
            inputs[param] = [
                tirx.Var(f"{param.name}_{k}", "int64") for k in range(int(length.value))
            ]
        return inputs

    def _only_shape_uses(self, var, uses, seen) -> bool:
        """Every use of ``var`` is a shape consumer or int arithmetic that only feeds them."""
        if var in seen:
            return True
        seen.add(var)
        for value in uses.get(var, []):
            if value is None:  # returned from the function
                return False
            name = op_name(value)
            if _is_to_shape(value):
                continue
            if name == "relax.dynamic_strided_slice" and not value.args[0].same_as(var):
                continue
            user = self._bound_var(value)
            sinfo = getattr(user, "ty", None)
            if user is None or not isinstance(sinfo, relax.TensorType):
                return False
            if sinfo.dtype not in (*_INT, "bool") or not self._only_shape_uses(user, uses, seen):
                return False
        return True

    def _bound_var(self, value):
        if not hasattr(self, "_var_of"):
            self._var_of = {bound: var for var, bound in self.var2val.items()}
        return self._var_of.get(value)

    def _read_inputs(self, exprs=()) -> None:
        """Emit the one host read of every shape input (before the first rewrite uses its dims),
        and of the data-dependent values that ``exprs`` (the rewrite's elements) read."""
        inputs, self.unread = self.unread, {}
        for param, dims in inputs.items():
            self._emit_read(param, dims)
        used: set = set()
        for expr in exprs:
            used.update(tirx.analysis.undefined_vars(expr))
        for var, dims in self.eval.reads.items():
            if var in self.emitted or not any(d in used for d in dims):
                continue
            self.emitted.add(var)
            value = self._host_value(var) if _is_gpu(self.target) else self.visit_expr(var)
            if value.ty.ndim == 0:
                value = self.builder_.emit(relax.op.reshape(value, [1]))
            if value.ty.dtype != "int64":
                value = self.builder_.emit(relax.op.astype(value, "int64"))
            self._emit_read(value, dims)

    def _emit_read(self, tensor, dims: list) -> None:
        """Read a 1-D int64 tensor's values into the fresh dims ``dims``."""
        shape = self.builder_.emit(relax.op.tensor_to_shape(tensor))
        self.builder_.match_cast(shape, relax.ShapeType(dims))

    def _host_value(self, var, depth: int = 0) -> relax.Expr:
        """``var``'s value on the host VDevice (part b, GPU targets): the ops that produce it
        from 1-D int tensors (reductions, casts, reshapes: ``max(sum(mask, axis=1))``) run on
        the host after one copy of their input; a larger input (the mask) is data and stays."""
        value = self.var2val.get(var)
        name = op_name(value)
        if name in _HOST_OPS and depth < 8:
            source = value.args[0]
            sinfo = getattr(source, "ty", None)
            rest = value.args[1:]
            if (
                isinstance(source, relax.Var)
                and isinstance(sinfo, relax.TensorType)
                and sinfo.dtype in (*_INT, "bool")
                and sinfo.ndim in (0, 1)
                and not any(isinstance(getattr(a, "ty", None), relax.TensorType) for a in rest)
            ):
                host = self._host_value(source, depth + 1)
                return self.builder_.emit(
                    relax.Call(value.op, [host, *rest], value.attrs, value.ty_args)
                )
        return self.builder_.emit(relax.op.to_vdevice(self.visit_expr(var), self._host()))

    def _host(self) -> relax.VDevice:
        if self.host_vdevice is None:
            self.host_vdevice = _host_vdevice(self.target)
        return self.host_vdevice

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        name = op_name(call)
        if _is_to_shape(call):
            value = self._evaluate(call.args[0], "tensor_to_shape")
            if value is not None and value.rank == 1 and not any(map(_is_bool, value.elems)):
                self.count += 1
                self._read_inputs(value.elems)
                return relax.ShapeExpr(value.elems)
        elif name == "relax.dynamic_strided_slice":
            rewritten = self._slice(call)
            if rewritten is not None:
                self.count += 1
                return rewritten
        elif name == "relax.strided_slice":
            rewritten = self._slice_to_end(call)
            if rewritten is None:
                rewritten = self._slice_within_bound(call)
            if rewritten is not None:
                self.count += 1
                return rewritten
        return super().visit_call_(call)

    def _slice_to_end(self, call: relax.Call) -> relax.Expr | None:
        """``x[..., c:]`` as exporters write it (Slice with end ``INT64_MAX``) gets the extent
        ``min(INT64_MAX, n) - min(c, n)``, which equals ``n - c`` only when ``n >= c``; the
        analyzer cannot use it, so a reshape of the slice (XLNet's rel_shift) is not proven to
        keep the element count and stays a copy kernel (1.5 ms a layer at (4, 128)). The slice
        is matched to the extent ``n - c``: a run-time check, failing only for an axis shorter
        than ``c``, where the slice is empty (a zero-length sequence)."""
        data = call.args[0]
        sinfo = data.ty
        if not isinstance(sinfo, relax.TensorType) or not isinstance(sinfo.shape, relax.ShapeExpr):
            return None
        out = call.ty
        if not isinstance(out, relax.TensorType) or not isinstance(out.shape, relax.ShapeExpr):
            return None
        if len(call.args) < 5 or not all(hasattr(a, "fields") for a in call.args[1:5]):
            return None
        axes, strides = ([_int_value(v) for v in a.fields] for a in (call.args[1], call.args[4]))
        if any(v is None for v in (*axes, *strides)):
            return None
        dims = list(sinfo.shape.values)
        shape = list(out.shape.values)
        changed = False
        for axis, b, e, st in zip(
            axes, call.args[2].fields, call.args[3].fields, strides, strict=True
        ):
            n = dims[axis % len(dims)]
            stop = self._cut_end(b, e, n)
            if isinstance(n, tirx.IntImm) or st != 1 or stop is None:
                continue
            extent = self.analyzer.simplify(stop - _i64(_cut_begin(b)))
            if self.analyzer.can_prove_equal(shape[axis % len(dims)], extent):
                continue
            shape[axis % len(dims)] = extent
            changed = True
        if not changed:
            return None
        sliced = self.builder_.emit(super().visit_call_(call))
        target = relax.TensorType(relax.ShapeExpr(shape), out.dtype, out.vdevice)
        return self.builder_.match_cast(sliced, target)

    def _slice_within_bound(self, call: relax.Call) -> relax.Expr | None:
        """``buffer[:, :seq]`` of a static axis (ALBERT's ``position_ids`` buffer of
        ``max_position_embeddings``) is inferred ``min(seq, 128)`` long, so adding it to the
        ``(batch, seq, H)`` embeddings gave a tensor of unknown shape and no pipeline built the
        model (stock neither). Where the function's bounds (torch.export's ``Dim(max=...)``)
        prove every sliced axis in bounds (begin 0, stride 1, ``0 <= end <= n``), the slice is
        emitted with ``assume_inbound``, which infers the extent ``end`` (``seq``)."""
        data, out = call.args[0].ty, call.ty
        if not self.bounded or len(call.args) < 5 or call.attrs.assume_inbound:
            return None
        if not all(
            isinstance(t, relax.TensorType) and isinstance(t.shape, relax.ShapeExpr)
            for t in (data, out)
        ) or not all(hasattr(a, "fields") for a in call.args[1:5]):
            return None
        dims, shape = list(data.shape.values), list(out.shape.values)
        changed = False
        for axis, b, e, st in zip(*(a.fields for a in call.args[1:5]), strict=True):
            axis = _int_value(axis)
            if axis is None or not _is_zero(b) or _int_value(st) != 1:
                return None
            n = dims[axis % len(dims)]
            if not isinstance(e, tirx.Expr) or not at_most(self.analyzer, e, _i64(n)):
                return None
            if not self.analyzer.can_prove(e >= 0):
                return None
            changed |= not tvm_ffi.structural_equal(shape[axis % len(dims)], e)
        if not changed:
            return None
        args = [self.visit_expr(a) for a in call.args]
        return relax.op.strided_slice(*args, assume_inbound=True)

    def _cut_end(self, begin, end, n):
        """The end of a slice ``[c, end)`` of an axis of length ``n`` that ``_slice_to_end``
        declares ``end - c`` long, or None: ``c`` is a positive constant, given as it is or as
        the importer clamps it to a symbolic end (``min(1, seq * 2)``, XLNet's rel_shift:
        inferred ``max(seq * 2 - 1, 0)`` long, so the reshape after it was a copy kernel, a
        quarter of the model's time at (8, 64)), and the end is ``INT64_MAX`` or within the
        axis."""
        if _cut_begin(begin) is None:
            return None
        value = end
        if not isinstance(value, tirx.Expr):
            return None
        stop = _int_value(value)
        if stop is not None:
            return n if stop >= (1 << 31) - 1 else None
        if isinstance(begin, tirx.Min) and not self.analyzer.can_prove_equal(begin.b, value):
            return None
        return value if at_most(self.analyzer, value, _i64(n)) else None

    def _evaluate(self, expr, what: str) -> _Value | None:
        self.eval.why = ""
        value = self.eval.value(expr)
        if value is None:
            skip(logger, what, self.eval.why or "not shape arithmetic")
        return value

    def _slice(self, call: relax.Call) -> relax.Expr | None:
        data = call.args[0]
        sinfo = data.ty
        if not isinstance(sinfo, relax.TensorType) or sinfo.ndim < 0:
            return None
        parts = [self._evaluate(a, "dynamic_strided_slice") for a in call.args[1:4]]
        if any(p is None for p in parts):
            return None
        begin, end, strides = (p.elems for p in parts)
        if not len(begin) == len(end) == len(strides) <= sinfo.ndim:
            return skip(logger, "dynamic_strided_slice", "bounds of different lengths") or None
        if any(not isinstance(s, tirx.IntImm) or int(s.value) == 0 for s in strides):
            return skip(logger, "dynamic_strided_slice", "run-time or zero strides") or None
        axes = list(range(len(begin)))
        dims = list(sinfo.shape.values) if isinstance(sinfo.shape, relax.ShapeExpr) else None
        inbound = dims is not None and all(
            isinstance(st, tirx.IntImm)
            and int(st.value) > 0
            and self.analyzer.can_prove(b >= 0)
            and self.analyzer.can_prove(b <= e)
            and at_most(self.analyzer, e, _i64(d))
            for b, e, st, d in zip(begin, end, strides, dims, strict=False)
        )
        self._read_inputs([*begin, *end])
        if any(_reads_data(self.eval.reads, e) for e in (*begin, *end)):
            # keep only the axes that are cut: a whole axis sliced by bounds read at run time
            # infers a ``max(batch, 0)`` extent, on which CanonicalizeBindings recurses forever
            kept = [
                k
                for k in axes
                if not (
                    dims is not None
                    and _is_zero(begin[k])
                    and int(strides[k].value) == 1
                    and self.analyzer.can_prove(end[k] >= _i64(dims[k]))
                )
            ]
            axes, begin, end, strides = (
                [seq[k] for k in kept] for seq in (axes, begin, end, strides)
            )
        return relax.op.strided_slice(
            self.visit_expr(data), axes, begin, end, strides, assume_inbound=inbound
        )


@tvm.transform.module_pass(opt_level=0, name=NAME)
class PlaceShapeOnHost:
    """Makes shape arithmetic on int tensors symbolic (see the module docstring)."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        target = self.target or tvm.target.Target.current(allow_none=True)
        rewriter = _Rewriter(mod, target)
        mod = rewriter.transform()
        record_rewrite(NAME, rewriter.count)
        return mod
