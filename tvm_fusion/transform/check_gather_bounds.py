"""CheckGatherBounds: a run-time range check before every ``take`` whose indices are not proven.

``R.take(x, idx, axis, mode="fast")`` (ONNX ``Gather``, torch ``embedding`` / ``index_select``)
reads ``x`` at ``idx`` without a check: an id past the table reads the process's heap, a huge
one kills it. Token ids come from the user, so every such take whose indices are not provably
in ``[0, n)`` (``n`` the extent of ``axis``, static or symbolic; the product of all dims for a
take without an axis) gets, before it::

    bad = sum(astype(logical_or(less(idx, 0), greater_equal(idx, n)), "int64"))   # one kernel
    zero = call_pure_packed("tvm_fusion.check_gather_bounds", bad, dtype, message)
    y = take(x, add(idx, zero), axis, mode="fast")

The packed function raises ``IndexError`` (one line naming the op, its data, the axis and the
number of bad indices) when ``bad`` is not 0, and returns a zero of the index dtype otherwise,
so in-range ids give exactly the results of the unchecked take. The zero ties the check to the
take: a pure call whose result nobody reads would be removed, and ``R.assert_op`` is impure
(not allowed in a dataflow block nor in a pure function). The zero is a new tensor, never an
alias of ``bad``: the memory planner assumes packed calls keep none of their arguments.

Cost (CPU, measured on the corpus' distilbert/gpt2 exports at (3, 7), 1 thread): the Python
callback and the two small kernels add 25-50 us per checked take and call, 80-95% of those
toy models' 0.06-0.13 ms. A TIR kernel with an ``assert`` (no Python on the way) is the next
step on CPU; on GPU the count must reach the host either way (a sync per check).

Left as they are (range proven, or no read outside the buffer possible):

- ``mode="clip"`` / ``"wrap"``;
- constant indices provably inside the axis (outside it: a warning at compile time, and the
  check, which raises on every call);
- indices that are an arithmetic progression inside the axis (``arange``, a constant
  ``Range``; what GatherToSlice proves, through casts, reshapes, slices and the ONNX importer's
  negative-index ``where``);
- ``argmax`` / ``argmin`` / ``topk`` indices over an axis no longer than the take's, through
  casts, views and the importer's ``where``.

Where it runs: early in Phase 1, after PlaceShapeOnHost, before GatherToSlice and
FuseCrossEntropy (they see the same ``take``; its index becomes ``add(idx, zero)`` only where
the range is unproven, which those passes do not rewrite anyway).

Not covered yet: ``gather_elements``, ``gather_nd``, ``take_backward`` and the scatter ops
(writes), and data-dependent ``strided_slice`` bounds.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import IRModule, relax, tirx
from tvm.ir import StringImm
from tvm.ir.expr import GenericConst
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._common import as_i64, get_logger, op_name, record_rewrite, skip
from .gather_to_slice import _Values

logger = get_logger(__name__)
NAME = "CheckGatherBounds"
CHECK_FUNC = "tvm_fusion.check_gather_bounds"
# ops whose output keeps a subset of its input's values
_VIEWS = (
    "relax.astype",
    "relax.reshape",
    "relax.expand_dims",
    "relax.squeeze",
    "relax.permute_dims",
    "relax.strided_slice",
    "relax.broadcast_to",
    "relax.flatten",
)
_INT_BITS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64}
_ZEROS: dict = {}


@tvm_ffi.register_global_func(CHECK_FUNC, override=True)
def _check(bad, dtype: str, message: str):
    """Raise when ``bad`` (a 0-d count of out-of-range indices) is not 0, else return a cached
    0-d zero of ``dtype`` on ``bad``'s device (nobody writes it: it is no planned buffer)."""
    count = int(bad.numpy())
    if count:
        raise IndexError(f"{message}: {count} index value(s) outside it")
    key = (bad.device.dlpack_device_type(), bad.device.index, dtype)
    zero = _ZEROS.get(key)
    if zero is None:
        zero = _ZEROS[key] = tvm.runtime.tensor(np.zeros((), dtype), bad.device)
    return zero


@tvm.transform.module_pass(opt_level=0, name=NAME)
class CheckGatherBounds:
    """Puts a run-time range check before each ``take`` whose indices are not proven in range
    (see the module docstring)."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        rewriter = _Rewriter(mod)
        mod = rewriter.transform()
        record_rewrite(NAME, rewriter.count)
        return mod


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.mod = mod
        self.count = 0
        self.values = _Values({})

    def transform(self) -> IRModule:
        for gv, func in self.mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
                continue
            self.values = _Values(relax.analysis.get_var2val(func))
            self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get() if self.count else self.mod

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) != "relax.take":
            return call
        checked = self._checked(call)
        if checked is None:
            return call
        self.count += 1
        return relax.op.take(call.args[0], checked, call.attrs.axis, call.attrs.mode)

    def _checked(self, call: relax.Call) -> relax.Expr | None:
        """The checked index of ``take``, or None when its range is proven (or unknowable)."""
        x, idx = call.args
        what = f"take of {_name(x)}"
        if str(call.attrs.mode) in ("clip", "wrap"):
            return _leave(what, f"mode={call.attrs.mode} reads inside the buffer")
        extent = _extent(x, call.attrs.axis)
        idx_sinfo = idx.ty
        if extent is None or not isinstance(idx_sinfo, relax.TensorType):
            logger.warning("%s: data shape or index type unknown, left unchecked", what)
            return None
        analyzer = tvm.sym.Analyzer()
        if self._proven(what, idx, extent, analyzer):
            return None
        axis = "all" if call.attrs.axis is None else f"axis {int(call.attrs.axis)}"
        size = int(extent.value) if isinstance(extent, tirx.IntImm) else extent
        message = (
            f"index out of range in take (ONNX Gather, torch embedding/index_select) of "
            f"{_name(x)}, {axis} of extent {size}"
        )
        bb, dtype = self.builder_, str(idx_sinfo.dtype)
        wide = idx if dtype == "int64" else bb.emit(relax.op.astype(idx, "int64"))
        low = relax.op.less(wide, relax.const(0, "int64"))
        if isinstance(extent, tirx.IntImm):
            high = relax.op.greater_equal(wide, relax.const(int(extent.value), "int64"))
        else:
            high = relax.op.greater_equal(wide, relax.prim_value(extent))
        outside = bb.emit(relax.op.logical_or(bb.emit(low), bb.emit(high)))
        bad = bb.emit(relax.op.sum(relax.op.astype(outside, "int64")))
        zero = bb.emit(
            relax.op.call_pure_packed(
                CHECK_FUNC,
                bad,
                StringImm(dtype),
                StringImm(message),
                ty_args=relax.TensorType((), dtype),
            )
        )
        return bb.emit(relax.op.add(idx, zero))

    def _proven(self, what: str, idx, extent, analyzer) -> bool:
        found = self._range(idx, analyzer)
        if found is not None:
            low, high = found
            if analyzer.can_prove(low >= 0) and analyzer.can_prove(high <= extent):
                return _proved(what, "index values (constants, argmax/topk) inside the axis")
            if isinstance(self.values.resolve(idx), GenericConst):
                logger.warning(
                    "%s: constant index outside [0, %s), checked at run time", what, extent
                )
                return False
        prog = self.values.progression(idx, analyzer)
        if prog is not None and prog.step != 0:
            first, last = prog.start, prog.last()
            low, high = (first, last) if prog.step > 0 else (last, first)
            # GatherToSlice's progression looks through casts; the values must fit the index
            # dtype (a constant 200 cast to int8 is -56)
            fits = _fits(analyzer, (low, high + 1), str(idx.ty.dtype))
            if fits and analyzer.can_prove(high < extent):
                return _proved(what, "an arithmetic progression inside the axis")
        return False

    def _range(self, expr, analyzer, depth: int = 0) -> tuple | None:
        """``(low, high)`` with ``low <= expr < high`` for every value of the index: constants,
        the indices an argmax/argmin/topk made, and views of those (slices, broadcasts,
        reshapes, casts that keep the values, the importer's negative-index ``where``)."""
        if depth > 32:
            return None
        expr = self.values.resolve(expr)
        if isinstance(expr, GenericConst):
            arr = expr.value.numpy()
            if arr.dtype.kind not in "iu":
                return None
            if arr.size == 0:
                return as_i64(0), as_i64(0)
            return as_i64(int(arr.min())), as_i64(int(arr.max()) + 1)
        if isinstance(expr, relax.TupleGetItem):
            inner = self.values.resolve(expr.tuple_value)
            if op_name(inner) == "relax.topk" and expr.index == 1:
                return _from_zero(_extent(inner.args[0], inner.attrs.axis))
            return None
        name = op_name(expr)
        if name in ("relax.argmax", "relax.argmin"):
            return _from_zero(_extent(expr.args[0], expr.attrs.axis))
        if name == "relax.topk" and str(expr.attrs.ret_type) == "indices":
            return _from_zero(_extent(expr.args[0], expr.attrs.axis))
        if name in _VIEWS:
            found = self._range(expr.args[0], analyzer, depth + 1)
            if name == "relax.astype" and found is not None:
                # a cast keeps the values only where the new type holds them
                dtype = str(expr.ty.dtype)
                if dtype not in _INT_BITS:
                    return None
                if not _fits(analyzer, found, dtype):
                    return None
            return found
        if name == "relax.where":
            # the ONNX importer's where(less(i, 0), add(i, n), i): i itself when i >= 0
            plain = self.values.resolve(expr.args[2])
            cond = self.values.resolve(expr.args[0])
            if op_name(cond) == "relax.less" and self.values.resolve(cond.args[0]).same_as(plain):
                found = self._range(plain, analyzer, depth + 1)
                if found is not None and analyzer.can_prove(found[0] >= 0):
                    return found
        return None


def _fits(analyzer, found: tuple, dtype: str) -> bool:
    """``low >= 0`` and ``high <= 2**(bits - 1)``: a signed ``dtype`` holds every value."""
    if dtype not in _INT_BITS or not analyzer.can_prove(found[0] >= 0):
        return False
    return dtype == "int64" or analyzer.can_prove(found[1] <= as_i64(1 << (_INT_BITS[dtype] - 1)))


def _from_zero(extent) -> tuple | None:
    return None if extent is None else (as_i64(0), extent)


def _extent(x, axis) -> tirx.Expr | None:
    """The extent of ``x``'s ``axis`` (all of ``x`` for None) as an int64 PrimExpr."""
    sinfo = x.ty
    if not isinstance(sinfo, relax.TensorType) or not isinstance(sinfo.shape, relax.ShapeExpr):
        return None
    dims = [as_i64(d) for d in sinfo.shape.values]
    if axis is None:
        total = tirx.IntImm("int64", 1)
        for d in dims:
            total = total * d
        return tvm.sym.Analyzer().simplify(total)
    axis = int(axis)
    if not -len(dims) <= axis < len(dims):
        return None
    return dims[axis % len(dims)]


def _name(x) -> str:
    return repr(x.name) if isinstance(x, relax.Var) else "a constant"


def _leave(what: str, reason: str) -> None:
    skip(logger, what, reason)
    return None


def _proved(what: str, reason: str) -> bool:
    skip(logger, what, reason)
    return True
