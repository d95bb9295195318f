"""GatherToSlice: ``take(x, arange(a, b, s), axis)`` becomes ``strided_slice`` (ORT PR #13599).

Matches ``R.take(x, idx, axis)`` whose index tensor ``idx`` is provably an arithmetic
progression ``a, a+s, ..., a+(n-1)s`` with a constant non-zero step (1-D, or several dims whose
every row is that progression: the position embedding ``embedding(position_ids[:, :seq])``
of a ``(1, max_pos)`` arange buffer, expanded to the batch or not):

- ``R.arange(a, b, s)`` (constant or symbolic bounds, e.g. a dynamic ``klen``);
- a constant index tensor whose values are a progression (what FoldConstant and the ONNX
  importer leave of a constant Range);
- either of those through ``astype`` to an integer type, a ``reshape`` to 1-D of the same
  length (the dynamo exporter's ``index_select(x, d, arange(n))``: ``Range`` -> ``Reshape([n])``
  -> ``Gather``), ``multiply``/``add``/``subtract`` by integer scalars, and the ONNX importer's
  index normalisation ``where(less(i, 0), add(i, dim), i)``, which is the identity for provably
  non-negative indices and ``i + dim`` for provably negative ones;
- rows: a constant ``(1, ..., 1, n)`` progression, a reshape / ``expand_dims`` of a 1-D one to
  that shape, a ``strided_slice`` of one along its last axis (non-negative begin, positive
  stride), a ``broadcast_to`` of one to more rows.

Emits ``strided_slice(x, [axis], [begin], [end], [s], assume_inbound=True)`` (the index's
rows put in front of ``axis`` by ``expand_dims``, then ``broadcast_to`` the take's shape when
they are not ones; with a
``match_cast`` to the take's shape when TVM cannot see the two shapes are equal). A slice reads
contiguous memory, fuses with its elementwise neighbours (``take`` is opaque to FuseOps) and its
gradient is a slice-scatter instead of a serial scatter-add (see ``tvm_fusion.lower.gradients``).

``R.grad.take_backward(g, x, idx, axis)`` with such indices (what ``relax.transform.Gradient``
makes of a take when the graph is differentiated before this pass runs) becomes ``pad(g)`` for
a contiguous static range and ``slice_scatter(zeros_like(x), g, ...)`` otherwise: a
progression's indices never repeat, so the gradient needs no scatter-add.

Where it must run: before LegalizeOps (Phase 1).

Left alone, with the reason logged at debug level:

- indices that may be negative, a zero step (repeated indices), a non-integer index, an index
  of several dims whose rows are not one progression, the gradient (``take_backward``) of such
  an index;
- indices that may fall outside ``[0, dim)`` -- except for ``mode="fast"`` (the default, and what
  the ONNX importer emits): that mode already promises in-bound indices (TVM: "fast mode
  segfaults when there are out-of-bounds indices"), so a symbolic upper bound that cannot be
  proven keeps the same promise; ``mode="clip"``/``"wrap"`` need a proof;
- a negative step whose last index is 0 on an axis of symbolic length (no end value expresses
  "before index 0" there).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import IRModule, relax, tirx
from tvm.ir import PrimType
from tvm.ir.expr import GenericConst
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._common import as_i64 as _i64
from ._common import get_logger, op_name, record_rewrite, shape_dims, skip

logger = get_logger(__name__)
NAME = "GatherToSlice"
_INT = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


@tvm.transform.module_pass(opt_level=0, name=NAME)
class GatherToSlice:
    """Replaces ``take(x, arange(a, b, s), axis)`` by ``strided_slice(x, [axis], [a], [b], [s])``
    (see the module docstring for what it proves first)."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        rewriter = _Rewriter(mod)
        mod = rewriter.transform()
        record_rewrite(NAME, rewriter.count)
        return mod


@dataclasses.dataclass
class Progression:
    """Index values ``start + i * step`` for ``i`` in ``[0, length)``."""

    start: tirx.Expr
    step: int
    length: tirx.Expr
    # the index tensor's leading dims: () for a 1-D index; (1, ...) or any extents for an
    # index whose every row is this progression (``position_ids[:, :seq]``, expanded to the
    # batch)
    rows: tuple = ()

    def last(self) -> tirx.Expr:
        return self.start + (self.length - 1) * self.step


def _is_prim(expr) -> bool:
    return isinstance(getattr(expr, "ty", None), PrimType)


class _Values:
    """Reads what an index expression computes, looking through variable bindings."""

    def __init__(self, var2val: dict):
        self.var2val = var2val

    def resolve(self, expr):
        seen = 0
        while isinstance(expr, relax.Var) and expr in self.var2val and seen < 64:
            expr = self.var2val[expr]
            seen += 1
        return expr

    def scalar(self, expr) -> tirx.Expr | None:
        """A scalar integer tensor (or prim value) as a PrimExpr."""
        if _is_prim(expr):
            return _i64(expr)
        expr = self.resolve(expr)
        if _is_prim(expr):
            return _i64(expr)
        if isinstance(expr, GenericConst):
            arr = expr.value.numpy()
            if arr.size == 1 and arr.dtype.name in _INT:
                return _i64(int(arr.reshape(-1)[0]))
            return None
        name = op_name(expr)
        if name in ("relax.reshape", "relax.squeeze", "relax.astype") and expr.args:
            return self.scalar(expr.args[0])
        if name == "relax.take":
            # take(shape_to_tensor(shape), i): one dimension of a shape
            index = self.scalar(expr.args[1])
            shape = self.shape_values(expr.args[0])
            if index is not None and shape is not None and isinstance(index, tirx.IntImm):
                i = int(index.value)
                if -len(shape) <= i < len(shape):
                    return _i64(shape[i])
        return None

    def shape_values(self, expr) -> list | None:
        """``shape_to_tensor(shape)`` as the list of its PrimExprs."""
        expr = self.resolve(expr)
        if op_name(expr) != "relax.shape_to_tensor":
            return None
        return shape_dims(self.resolve(expr.args[0]))

    def progression(self, expr, analyzer) -> Progression | None:
        expr = self.resolve(expr)
        sinfo = getattr(expr, "ty", None)
        if not isinstance(sinfo, relax.TensorType) or sinfo.ndim < 1 or sinfo.dtype not in _INT:
            return None
        if sinfo.ndim > 1:
            return self._rows(expr, sinfo, analyzer)
        if isinstance(expr, GenericConst):
            return _from_array(expr.value.numpy())
        name = op_name(expr)
        if name == "relax.arange":
            start, _end, step = expr.args
            if not isinstance(step, tirx.IntImm) or int(step.value) == 0:
                return None
            if not isinstance(sinfo.shape, relax.ShapeExpr):
                return None
            step_v = int(step.value)
            start, end = _i64(start), _i64(_end)
            # ceil((end - start) / step); an empty range is the user's problem either way
            length = analyzer.simplify(
                tirx.floordiv(end - start + (step_v - 1 if step_v > 0 else step_v + 1), step_v)
            )
            declared = _i64(sinfo.shape.values[0])
            if not analyzer.can_prove_equal(length, declared):
                # 0.27 infers ceil-div as if the step were positive: arange(7, 0, -1) is
                # declared with 9 elements while it computes 7. Nothing to trust there.
                logger.debug(
                    "arange%s: declared length %s, computes %s", tuple(expr.args), declared, length
                )
                return None
            return Progression(start, step_v, length)
        if name == "relax.astype":
            return self.progression(expr.args[0], analyzer)
        if name == "relax.reshape":
            # reshape of a 1-D progression to 1-D (the dynamo exporter's index_select writes
            # arange(n) -> reshape([n])): row-major order is kept, so the values are the same
            # when the length provably is.
            prog = self.progression(expr.args[0], analyzer)
            if prog is None or not isinstance(sinfo.shape, relax.ShapeExpr):
                return None
            if not analyzer.can_prove_equal(_i64(sinfo.shape.values[0]), prog.length):
                return None
            return prog
        if name in ("relax.add", "relax.subtract", "relax.multiply"):
            return self._arithmetic(expr, analyzer)
        if name == "relax.where":
            return self._normalised(expr, analyzer)
        if name == "relax.strided_slice":
            return self._sliced(expr, sinfo, analyzer)
        return None

    def _rows(self, expr, sinfo, analyzer) -> Progression | None:
        """An index of several dims whose every row is one progression: a constant
        ``(1, ..., 1, n)`` array (a ``position_ids`` buffer), a reshape / ``expand_dims`` of a
        1-D progression to such a shape, a slice of one along its last axis
        (``position_ids[:, :seq]``), a ``broadcast_to`` of one to more rows, and the ops of
        the 1-D case (casts, integer scalars, the importer's negative-index ``where``)."""
        if not isinstance(sinfo.shape, relax.ShapeExpr):
            return None
        dims = [_i64(d) for d in sinfo.shape.values]
        unit_rows = all(isinstance(d, tirx.IntImm) and int(d.value) == 1 for d in dims[:-1])
        if isinstance(expr, GenericConst):
            arr = expr.value.numpy()
            if not unit_rows:
                return None
            prog = _from_array(arr.reshape(-1))
            return dataclasses.replace(prog, rows=tuple(dims[:-1])) if prog else None
        name = op_name(expr)
        if name in ("relax.reshape", "relax.expand_dims") and unit_rows:
            prog = self.progression(expr.args[0], analyzer)
            if prog is None or any(
                not (isinstance(r, tirx.IntImm) and int(r.value) == 1) for r in prog.rows
            ):
                return None
            if not analyzer.can_prove_equal(dims[-1], prog.length):
                return None
            return dataclasses.replace(prog, rows=tuple(dims[:-1]))
        if name == "relax.broadcast_to":
            prog = self.progression(expr.args[0], analyzer)
            if prog is None or not analyzer.can_prove_equal(dims[-1], prog.length):
                return None
            if any(not (isinstance(r, tirx.IntImm) and int(r.value) == 1) for r in prog.rows):
                return None
            return dataclasses.replace(prog, rows=tuple(dims[:-1]))
        if name in (
            "relax.astype",
            "relax.add",
            "relax.subtract",
            "relax.multiply",
            "relax.where",
            "relax.strided_slice",
        ):
            # the 1-D rules, the rows kept: an operand is the progression of these rows, the
            # other a scalar (checked by the 1-D rule on the same expression)
            return self._rows_elementwise(expr, sinfo, dims, analyzer)
        return None

    def _rows_elementwise(self, expr, sinfo, dims, analyzer) -> Progression | None:
        name = op_name(expr)
        if name == "relax.strided_slice":
            return self._sliced(expr, sinfo, analyzer)
        if name == "relax.astype":
            return self.progression(expr.args[0], analyzer)
        if name == "relax.where":
            prog = self._normalised(expr, analyzer)
        else:
            prog = self._arithmetic(expr, analyzer)
        if prog is None or len(prog.rows) != len(dims) - 1:
            return None
        if not all(
            analyzer.can_prove_equal(a, b) for a, b in zip(prog.rows, dims[:-1], strict=True)
        ):
            return None
        return prog

    def _arithmetic(self, expr, analyzer) -> Progression | None:
        """``add`` / ``subtract`` / ``multiply`` of a progression by an integer scalar (its
        rows kept)."""
        name = op_name(expr)
        lhs, rhs = expr.args
        prog, other = self.progression(lhs, analyzer), rhs
        if prog is None and name != "relax.subtract":
            prog, other = self.progression(rhs, analyzer), lhs
        if prog is None:
            return None
        value = self.scalar(other)
        if value is None:
            return None
        if name == "relax.add":
            return dataclasses.replace(prog, start=prog.start + value)
        if name == "relax.subtract":
            return dataclasses.replace(prog, start=prog.start - value)
        if not isinstance(value, tirx.IntImm):
            return None
        factor = int(value.value)
        return dataclasses.replace(prog, start=prog.start * factor, step=prog.step * factor)

    def _sliced(self, expr, sinfo, analyzer) -> Progression | None:
        """``strided_slice`` of a progression along its last axis, from a non-negative begin
        with a positive stride, its length the slice's declared one (``assume_inbound`` or a
        static extent inside the progression)."""
        data, axes, begin, _end, strides = expr.args[:5]
        prog = self.progression(data, analyzer)
        if prog is None or not isinstance(sinfo.shape, relax.ShapeExpr):
            return None
        ndim = len(prog.rows) + 1
        axes_v = [int(a) % ndim for a in _tuple_values(axes)]
        begin_v, stride_v = _tuple_values(begin), _tuple_values(strides)
        if axes_v != [ndim - 1] or len(begin_v) != 1 or len(stride_v) != 1:
            return None
        b, st = _i64(begin_v[0]), _i64(stride_v[0])
        if not isinstance(st, tirx.IntImm) or int(st.value) <= 0:
            return None
        if not analyzer.can_prove(b >= 0):
            return None
        length = _i64(sinfo.shape.values[-1])
        inbound = bool(expr.attrs.assume_inbound) if expr.attrs is not None else False
        if not inbound and not analyzer.can_prove(b + (length - 1) * st < prog.length):
            return None
        rows = tuple(_i64(d) for d in sinfo.shape.values[:-1])
        return Progression(prog.start + b * prog.step, prog.step * int(st.value), length, rows)

    def _normalised(self, where, analyzer) -> Progression | None:
        """``where(less(i, 0), add(i, dim), i)``: the ONNX importer's negative-index fix."""
        cond, wrapped, plain = (self.resolve(a) for a in where.args)
        if op_name(cond) != "relax.less" or op_name(wrapped) != "relax.add":
            return None
        zero = self.scalar(cond.args[1])
        if zero is None or not isinstance(zero, tirx.IntImm) or int(zero.value) != 0:
            return None
        base = self.resolve(cond.args[0])
        if not self.resolve(plain).same_as(base):
            return None
        add_lhs, add_rhs = (self.resolve(a) for a in wrapped.args)
        dim_expr = add_rhs if add_lhs.same_as(base) else add_lhs if add_rhs.same_as(base) else None
        if dim_expr is None:
            return None
        prog = self.progression(base, analyzer)
        if prog is None:
            return None
        lo = prog.start if prog.step > 0 else prog.last()
        hi = prog.last() if prog.step > 0 else prog.start
        if analyzer.can_prove(lo >= 0):
            return prog
        dim = self.scalar(dim_expr)
        if dim is not None and analyzer.can_prove(hi < 0):
            return Progression(prog.start + dim, prog.step, prog.length)
        return None


def _tuple_values(value) -> list:
    """The elements of a strided_slice argument (a Relax tuple of PrimValues or a shape)."""
    if isinstance(value, relax.Tuple):
        return [getattr(f, "value", f) for f in value.fields]
    if isinstance(value, relax.ShapeExpr):
        return list(value.values)
    return [getattr(v, "value", v) for v in value]


def _from_array(arr: np.ndarray) -> Progression | None:
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.name not in _INT:
        return None
    if arr.size == 1:
        return Progression(_i64(int(arr[0])), 1, _i64(1))
    diffs = np.diff(arr.astype("int64"))
    if not np.all(diffs == diffs[0]) or diffs[0] == 0:
        return None
    return Progression(_i64(int(arr[0])), int(diffs[0]), _i64(arr.size))


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
            new_func = self.visit_expr(func)
            new_func = relax.analysis.remove_all_unused(new_func)
            self.builder_.update_func(gv, new_func)
        return self.builder_.get()

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        name = op_name(call)
        if name == "relax.take":
            replaced = self._rewrite(call)
        elif name == "relax.grad.take_backward":
            replaced = self._rewrite_backward(call)
        else:
            replaced = None
        if replaced is None:
            return super().visit_call_(call)
        self.count += 1
        return replaced

    def _analyse(self, what: str, x, indices, axis, mode: str):
        """The progression of ``indices`` on ``x``'s axis, proven in-bound: (axis, dim, prog,
        analyzer), or None (reason logged)."""
        x_sinfo = x.ty
        if not isinstance(x_sinfo, relax.TensorType) or not isinstance(
            x_sinfo.shape, relax.ShapeExpr
        ):
            return _leave(what, "input shape unknown")
        if axis is None:
            return _leave(what, "take without an axis flattens the input")
        ndim = len(x_sinfo.shape.values)
        axis = int(axis) % ndim
        dim = _i64(x_sinfo.shape.values[axis])
        analyzer = tvm.sym.Analyzer()
        prog = self.values.progression(indices, analyzer)
        if prog is None:
            return _leave(what, "indices are not a provable arithmetic progression")
        if prog.step == 0:
            return _leave(what, "zero step: repeated indices")
        first, last = prog.start, prog.last()
        low, high = (first, last) if prog.step > 0 else (last, first)
        if analyzer.can_prove(prog.length <= 0):
            return _leave(what, "empty index range")
        if not analyzer.can_prove(low >= 0):
            return _leave(what, "indices may be negative")
        if analyzer.can_prove(high >= dim):
            return _leave(what, "indices past the end of the axis")
        if not analyzer.can_prove(high < dim):
            if mode not in ("fast", ""):
                return _leave(what, f"indices may exceed the axis (mode={mode})")
            logger.debug("%s: upper bound unproven; mode='fast' promises in-bound indices", what)
        return axis, dim, prog, analyzer

    def _rewrite(self, call: relax.Call) -> relax.Expr | None:
        what = f"take at {call.args[0]}"
        x, indices = call.args
        out_sinfo = call.ty
        found = self._analyse(what, x, indices, call.attrs.axis, str(call.attrs.mode))
        if found is None:
            return None
        axis, dim, prog, analyzer = found
        step, first, last = prog.step, prog.start, prog.last()
        # Negative strides keep assume_inbound=False: 0.27 infers a wrong length for them with
        # assume_inbound=True (strided_slice(x[10], 7, 0, -1) gets 9), and an end of
        # -(dim + 1) needs the normalisation to mean "before index 0".
        inbound = step > 0
        if step > 0:
            begin, end = first, last + 1
        elif analyzer.can_prove(last >= 1):
            begin, end = first, last - 1
        elif isinstance(dim, tirx.IntImm):
            begin, end = first, _i64(-(int(dim.value) + 1))
        else:
            return _leave(what, "negative step down to index 0 on a symbolic axis")
        begin, end = analyzer.simplify(begin), analyzer.simplify(end)
        new_x = self.visit_expr(x)
        sliced = self.builder_.normalize(
            relax.op.strided_slice(new_x, [axis], [begin], [end], [step], assume_inbound=inbound)
        )
        if prog.rows:
            # an index of rows of one progression: the slice with the rows' dims in front of
            # its axis, broadcast to them (a view when they are ones)
            sliced = self.builder_.normalize(
                relax.op.expand_dims(sliced, [axis + i for i in range(len(prog.rows))])
            )
            if not all(isinstance(r, tirx.IntImm) and int(r.value) == 1 for r in prog.rows):
                if not isinstance(out_sinfo.shape, relax.ShapeExpr):
                    return _leave(what, "the take's shape is unknown")
                sliced = self.builder_.normalize(
                    relax.op.broadcast_to(self.builder_.emit(sliced), out_sinfo.shape)
                )
        if not _same_shape(sliced.ty, out_sinfo, analyzer):
            return _leave(what, "slice shape not provably the take's shape")
        if not _struct_equal(sliced.ty, out_sinfo):
            sliced = self.builder_.match_cast(self.builder_.emit(sliced), out_sinfo)
        return sliced

    def _rewrite_backward(self, call: relax.Call) -> relax.Expr | None:
        """``take_backward(g, x, arange(...), axis)`` (what ``relax.transform.Gradient`` makes of
        a take) becomes ``pad(g)`` (step 1, static bounds) or ``slice_scatter(zeros_like(x), g,
        ...)``: indices of a progression never
        repeat, so no scatter-add; a negative step scatters the flipped gradient."""
        grad, x, indices = call.args[:3]
        what = f"take_backward at {x}"
        found = self._analyse(what, x, indices, call.attrs.axis, str(call.attrs.mode))
        if found is None:
            return None
        axis, dim, prog, analyzer = found
        if prog.rows:
            return _leave(what, "a gradient of an index of several rows (not rewritten)")
        g_sinfo = grad.ty
        if not isinstance(g_sinfo, relax.TensorType) or not isinstance(
            g_sinfo.shape, relax.ShapeExpr
        ):
            return _leave(what, "gradient shape unknown")
        if not analyzer.can_prove_equal(_i64(g_sinfo.shape.values[axis]), prog.length):
            return _leave(what, "gradient length differs from the index count")
        step, first, last = prog.step, prog.start, prog.last()
        new_grad = self.visit_expr(grad)
        if step < 0:
            new_grad = self.builder_.emit(relax.op.flip(new_grad, axis))
            first, last, step = last, first, -step
        start, stop = analyzer.simplify(first), analyzer.simplify(last + 1)
        after = analyzer.simplify(dim - stop)
        if step == 1 and isinstance(start, tirx.IntImm) and isinstance(after, tirx.IntImm):
            # A contiguous range: zero padding around the gradient, one injective kernel that
            # fuses with the gradient's producer and writes every element once.
            widths = [0] * (2 * len(x.ty.shape.values))
            widths[2 * axis], widths[2 * axis + 1] = int(start.value), int(after.value)
            padded = self.builder_.normalize(relax.op.nn.pad(new_grad, widths))
            if _struct_equal(padded.ty, call.ty):
                return padded
        base = self.builder_.emit(relax.op.zeros_like(self.visit_expr(x)))
        scattered = self.builder_.normalize(
            relax.op.slice_scatter(base, new_grad, start, stop, step, axis)
        )
        if not _struct_equal(scattered.ty, call.ty):
            scattered = self.builder_.match_cast(self.builder_.emit(scattered), call.ty)
        return scattered


def _leave(what: str, reason: str) -> None:
    skip(logger, what, reason)
    return None


def _struct_equal(a, b) -> bool:
    try:
        tvm.ir.assert_structural_equal(a, b)
        return True
    except (ValueError, AssertionError):
        return False


def _same_shape(a, b, analyzer) -> bool:
    if not isinstance(a, relax.TensorType) or not isinstance(b, relax.TensorType):
        return False
    if a.dtype != b.dtype or a.ndim != b.ndim:
        return False
    if not isinstance(a.shape, relax.ShapeExpr) or not isinstance(b.shape, relax.ShapeExpr):
        return False
    return all(
        analyzer.can_prove_equal(_i64(x), _i64(y))
        for x, y in zip(a.shape.values, b.shape.values, strict=True)
    )
