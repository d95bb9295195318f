"""PlaceShapeOnHost, the rewrite: shape consumers whose operands evaluate become symbolic shapes.

``tensor_to_shape(t)`` becomes ``R.shape([...])`` and ``dynamic_strided_slice`` a
``strided_slice`` with PrimValue bounds, once :class:`.evaluate._Evaluator` knows every element;
a ``strided_slice`` from a positive constant begin to the end of a symbolic axis (or to a
symbolic end within it) is matched to ``end - begin``, and one that the function's dim bounds
prove in bounds gets ``assume_inbound``. :func:`_propagate` then binds the fresh dims of the
``match_cast``s to the computed expressions and re-infers the ops after them. The reads of
values known only at run time come from :class:`.host._HostReads`.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import IRModule, relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._common import at_most, get_logger, op_name, skip
from .evaluate import _Evaluator, _i64, _is_bool, _is_to_shape, _Value
from .host import _declare_vdevices, _HostReads, _is_gpu

logger = get_logger(__package__)  # the pass's one logger, as before the split


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


@mutator
class _Rewriter(PyExprMutator, _HostReads):
    """Rewrites the shape consumers of every Relax function of a module."""

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
        if dims is not None:
            # an end past the axis (``Slice(x, c, 2**62)``, "to the end") is the axis' length:
            # the slice can then be proven in bounds, and an unproven one infers extents as
            # ``max(batch, 0)``, on which FuseTIR's CanonicalizeBindings recursed until the
            # process died (a (batch, 4, 2) input cut on its static axis 1)
            end = [
                _i64(d) if int(st.value) > 0 and self.analyzer.can_prove(e >= _i64(d)) else e
                for e, st, d in zip(end, strides, dims, strict=False)
            ]
        inbound = dims is not None and all(
            isinstance(st, tirx.IntImm)
            and int(st.value) > 0
            and self.analyzer.can_prove(b >= 0)
            and self.analyzer.can_prove(b <= e)
            and at_most(self.analyzer, e, _i64(d))
            for b, e, st, d in zip(begin, end, strides, dims, strict=False)
        )
        self._read_inputs([*begin, *end])
        if dims is not None:
            # keep only the axes that are cut: a whole axis sliced by bounds that are not proven
            # in bounds (read at run time, or another axis') infers a ``max(batch, 0)`` extent,
            # on which CanonicalizeBindings recurses forever
            kept = [
                k
                for k in axes
                if not (
                    _is_zero(begin[k])
                    and int(strides[k].value) == 1
                    and self.analyzer.can_prove(end[k] >= _i64(dims[k]))
                )
            ]
            axes, begin, end, strides = (
                [seq[k] for k in kept] for seq in (axes, begin, end, strides)
            )
        if not axes:  # every axis whole: the slice is its input
            return self.visit_expr(data)
        return relax.op.strided_slice(
            self.visit_expr(data), axes, begin, end, strides, assume_inbound=inbound
        )
